"""The batch types every layer shares: a Rollout (sampled responses with what the KL needs from
the sampling pass) and the ResponseRow an engine or an episode fills before padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor


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
    truncated: Tensor  # [N] bool: cut at the length limit, without EOS or a stop string

    @property
    def responses(self) -> Tensor:
        return self.sequences[:, self.prompt_len :]

    @property
    def prompts(self) -> tuple[Tensor, Tensor]:
        """The left-padded prompts' ids and their attention mask, [N, P] each."""
        return self.sequences[:, : self.prompt_len], self.attention_mask[:, : self.prompt_len]

    def to(self, device: torch.device | str) -> Rollout:
        """This batch with every tensor on `device`."""
        return Rollout(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()})

    def select(self, rows: Tensor) -> Rollout:
        """The rows `rows` (a 1-D index tensor) of this batch."""
        picked = {k: v[rows] for k, v in vars(self).items() if isinstance(v, Tensor)}
        return replace(self, **picked, texts=[self.texts[i] for i in rows.tolist()])

    @staticmethod
    def cat(parts: Sequence[Rollout], pad_id: int) -> Rollout:
        """The rows of `parts` in order, as one batch: prompts left-padded to the longest, responses
        right-padded to the longest (positions come from the attention mask, so no row changes)."""
        width_p, width_r = max(p.prompt_len for p in parts), max(p.response_mask.shape[1] for p in parts)

        def grown(p: Rollout) -> Rollout:
            left, right = width_p - p.prompt_len, width_r - p.response_mask.shape[1]
            return replace(
                p,
                sequences=F.pad(p.sequences, (left, right), value=pad_id),
                attention_mask=F.pad(p.attention_mask, (left, right), value=0),
                prompt_len=width_p,
                **{k: _pad_columns(getattr(p, k), right) for k in PER_TOKEN},
            )

        grown_parts = [grown(p) for p in parts]
        tensors = {
            k: torch.cat([getattr(p, k) for p in grown_parts]) for k in (*WHOLE, *PER_TOKEN, "truncated")
        }
        return Rollout(**tensors, prompt_len=width_p, texts=[t for p in grown_parts for t in p.texts])

    def trimmed(self) -> Rollout:
        """The same rows without columns that are padding in every row (left of the earliest
        prompt token, right of the longest response): positions come from the attention mask,
        so every real token's distribution is unchanged, and the forward is cheaper."""
        first = int(self.attention_mask[:, : self.prompt_len].any(0).long().argmax())
        width = int(self.response_mask.any(0).nonzero().max()) + 1 if self.response_mask.any() else 1
        end = self.prompt_len + width
        return replace(
            self,
            prompt_len=self.prompt_len - first,
            **{k: getattr(self, k)[:, first:end] for k in WHOLE},
            **{k: getattr(self, k)[:, :width] for k in PER_TOKEN},
        )


WHOLE = ("sequences", "attention_mask")  # [N, P + L]: prompt and response
PER_TOKEN = ("response_mask", "sampling_logp", "topk_ids", "entropy")  # [N, L, ...]: response only


def _pad_columns(t: Tensor, right: int) -> Tensor:
    """`t` [N, L, ...] with `right` columns of zeros (False) after its last."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, right))


@dataclass
class ResponseRow:
    """One response as per-token lists, before padding into a Rollout (an engine's output or a
    multi-turn episode, whose environment-inserted tokens have sampled False)."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # True: written by the policy
    logp: list[float] = field(default_factory=list)  # sampling log-prob (0 where not sampled)
    topk: list[list[int]] = field(default_factory=list)  # top-k ids per token (zeros where not sampled)
    entropy: list[float] = field(default_factory=list)
    truncated: bool = False  # cut at the length limit, without EOS or a stop string

    def add(self, ids, sampled: bool, logp, topk, entropy) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.logp += logp
        self.topk += topk
        self.entropy += entropy


def rollout_from_rows(
    rows: Sequence[ResponseRow], prompt_ids: Sequence[Sequence[int]], tokenizer, k: int
) -> Rollout:
    """Left-padded prompts and right-padded responses as one Rollout (CPU tensors). Every token of
    a response is attended to; only sampled ones are in response_mask."""
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    n, width = len(rows), max((len(r.ids) for r in rows), default=0)
    responses = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    real = torch.zeros(n, width, dtype=torch.bool)
    response_mask = torch.zeros(n, width, dtype=torch.bool)
    logp, entropy = torch.zeros(n, width), torch.zeros(n, width)
    topk_ids = torch.zeros(n, width, k, dtype=torch.long)
    for i, r in enumerate(rows):
        m = len(r.ids)
        if m:
            responses[i, :m], real[i, :m], response_mask[i, :m] = (
                torch.tensor(r.ids),
                True,
                torch.tensor(r.sampled),
            )
            logp[i, :m], entropy[i, :m] = torch.tensor(r.logp), torch.tensor(r.entropy)
            topk_ids[i, :m] = torch.tensor(r.topk, dtype=torch.long).view(m, k)
    return Rollout(
        sequences=torch.cat([prompts, responses], 1),
        attention_mask=torch.cat([prompt_mask, real.long()], 1),
        prompt_len=prompts.shape[1],
        response_mask=response_mask,
        sampling_logp=logp,
        topk_ids=topk_ids,
        entropy=entropy,
        texts=[tokenizer.decode(r.ids, skip_special_tokens=True) for r in rows],
        truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
    )


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id rows -> left-padded ids [N, W] and attention mask [N, W] (1 on real tokens)."""
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask
