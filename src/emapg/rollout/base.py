"""What every rollout engine returns, and how prompts become model input."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from transformers import PreTrainedTokenizerBase


@dataclass
class Rollout:
    """A batch of sampled responses, laid out [left-padded prompt | response].

    Positions past a response's end hold padding and have response_mask False; every
    per-token tensor is [N, L] over the response columns.
    """

    sequences: Tensor  # [N, P + L] token ids
    attention_mask: Tensor  # [N, P + L] 1 on real prompt tokens and on response tokens
    prompt_len: int  # P
    response_mask: Tensor  # [N, L] bool: sampled tokens, up to and including EOS / stop
    sampling_logp: Tensor  # [N, L] log pi_sampling(token), the tempered policy at sampling time
    topk_ids: Tensor  # [N, L, k] top-k ids of the sampling distribution (k = 0: none)
    entropy: Tensor  # [N, L] entropy of the sampling distribution
    texts: list[str]  # decoded responses, special tokens removed

    @property
    def responses(self) -> Tensor:
        return self.sequences[:, self.prompt_len :]


def format_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], chat_template: bool
) -> tuple[list[str], bool]:
    """Wrap each prompt as a user turn when the tokenizer has a chat template.

    Returns the texts and whether tokenizing them should add special tokens: a chat
    template already writes its own (BOS included), a plain prompt needs the tokenizer's.
    """
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return prompts, True
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    return texts, False
