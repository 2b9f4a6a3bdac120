"""Prompts as a model sees them: a prompt is text, or chat messages (`ChatPrompt`), rendered
by the tokenizer's chat template when it has one. The one place prompts become token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChatPrompt(str):
    """A prompt of several chat messages: the text is their contents, one per line (what a
    tokenizer without a chat template sees); `messages` is what the chat template gets."""

    messages: tuple

    def __new__(cls, messages):
        self = super().__new__(cls, "\n".join(m["content"] for m in messages))
        self.messages = tuple(dict(m) for m in messages)
        return self

    def __reduce__(self):
        return ChatPrompt, (list(self.messages),)


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: bool = True) -> bool:
    """Whether prompts go through the tokenizer's chat template: asked for, and it has one."""
    return chat_template and bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], chat_template: bool = True
) -> list[list[int]]:
    """Token ids of each prompt as the model sees it before its response.

    With a chat template (and `chat_template` True) a prompt is one user turn (a ChatPrompt: its
    messages) plus the generation prompt, and the template writes its own special tokens (BOS
    included); without one it is the plain text with the tokenizer's special tokens.
    """
    if uses_chat_template(tokenizer, chat_template):
        texts = [
            tokenizer.apply_chat_template(
                list(p.messages) if isinstance(p, ChatPrompt) else [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for p in prompts
        ]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return tokenizer(list(prompts))["input_ids"]
