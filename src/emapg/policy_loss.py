"""PPO-clip policy loss and the aggregation of token losses, as pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

from emapg.errors import EmapgError

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def ppo_clip(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss and whether the clip was active, both [N, T].

    ratio = pi / pi_old; loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).
    A larger clip_high than clip_low ("clip-higher", DAPO) leaves room for rare tokens to grow.
    """
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def aggregate(values: Tensor, mask: Tensor, mode: str, total: float) -> Tensor:
    """Sum of a micro-batch's share of the minibatch loss (verl's loss_agg_mode names).

    token_mean: every response token of the minibatch weighs the same; `total` is the
        minibatch's number of response tokens.
    seq_mean_token_mean: every sequence weighs the same (mean over its own tokens); `total` is
        the minibatch's number of sequences.
    seq_mean_token_sum: the mean over sequences of each one's token sum; `total` as above.
    seq_mean_token_sum_norm: token sums divided by a constant length (Dr. GRPO); `total` is the
        number of sequences times that length.
    Dividing by the minibatch total, not the micro-batch's, makes gradient accumulation exact.
    """
    if mode not in AGGREGATIONS:
        raise EmapgError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}; got {mode!r}")
    mask = mask.to(values.dtype)
    per_token = values * mask
    if mode == "seq_mean_token_mean":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / total
    return per_token.sum() / total


def aggregation_total(mask: Tensor, mode: str, reduce=float, length: int = 1) -> float:
    """The `total` for `aggregate` over a whole minibatch's response mask; `reduce` sums the
    count over processes when each holds a slice of the minibatch; `length` is the constant of
    seq_mean_token_sum_norm (the response length limit)."""
    if mode == "token_mean":
        count = mask.sum()
    else:
        count = mask.any(-1).sum() * (
            length if mode == "seq_mean_token_sum_norm" else 1
        )  # sequences with tokens
    return max(reduce(float(count)), 1.0)
