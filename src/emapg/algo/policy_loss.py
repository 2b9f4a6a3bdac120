"""The policy-gradient term and the aggregation of token losses, as pure tensor functions.

Per token, from the log-ratio log(pi / pi_old) (`log_ratio`: per token, or GSPO's per sequence):

- `ppo_clip`: PPO's clipped surrogate, max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), with
  the dual clip of Ye et al. (2020) for A < 0 (verl's clip_ratio_c): the loss bounded by c |A|.
- `cispo`: CISPO (MiniMax-M1): -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi, every token
  keeping a gradient, the clipped weight carrying none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from emapg.errors import EmapgError

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
LOSSES = ("ppo_clip", "cispo")
RATIO_LEVELS = ("token", "sequence")


def log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log(pi / pi_old) per token [N, T] (`level` "token"), or GSPO's sequence-level ratio
    ("sequence"): s_i = exp(mean over the sequence's tokens of log(pi / pi_old)), written per token
    as sg(log s_i) + log pi - sg(log pi): the value is the sequence's, the gradient of token t is
    s_i grad log pi(y_t), so a sequence-mean aggregation gives GSPO's s_i A_i (1/|y_i|) sum_t
    grad log pi(y_t)."""
    delta = logp - old_logp.detach()
    if level == "token":
        return delta
    mask = mask.to(delta.dtype)
    sequence = (delta.detach() * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return sequence + logp - logp.detach()


def ppo_clip(
    log_ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss and whether a clip was active, both [N, T].

    ratio r = exp(log_ratio); loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)). A larger
    clip_high than clip_low ("clip-higher", DAPO) leaves room for rare tokens to grow. With
    `dual_clip` c > 1 and A < 0 the loss is min(that, -c A): a token far above its old probability
    can push the loss no further than c |A|, and there carries no gradient. 0: no dual clip.
    """
    ratio = torch.exp(log_ratio)
    adv = _per_token(advantages)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss, active = torch.maximum(unclipped, clipped), clipped > unclipped
    if dual_clip:
        bound = -adv * dual_clip
        lower = (adv < 0) & (loss > bound)
        loss, active = torch.where(lower, bound, loss), active | lower
    return loss, active


def cispo(
    log_ratio: Tensor, logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi and whether the
    weight was clipped, both [N, T]. clip_low = 1 leaves the weight unbounded below (MiniMax-M1)."""
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * _per_token(advantages) * logp, weight != ratio


def _per_token(advantages: Tensor) -> Tensor:
    adv = advantages.detach()
    return adv.unsqueeze(-1) if adv.dim() == 1 else adv


def aggregate(values: Tensor, mask: Tensor, mode: str, total: float) -> Tensor:
    """Sum of a micro-batch's share of the minibatch loss (verl's loss_agg_mode names and values).

    token_mean: every response token of the minibatch weighs the same; `total` is the
        minibatch's number of response tokens.
    seq_mean_token_mean: every sequence weighs the same (mean over its own tokens); `total` is
        the minibatch's number of sequences.
    seq_mean_token_sum: the mean over sequences of each one's token sum; `total` as above.
    seq_mean_token_sum_norm: verl's: the minibatch's token sums divided by a constant length L
        only, not by the number of sequences, so its scale grows with the minibatch (Dr. GRPO's
        own normalisation also divides by the sequences: seq_mean_token_sum over L); `total` is L.
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
    count over processes when each holds a slice of the minibatch; `length` is the constant L of
    seq_mean_token_sum_norm (the response length limit)."""
    if mode == "seq_mean_token_sum_norm":
        return float(length)
    count = mask.sum() if mode == "token_mean" else mask.any(-1).sum()  # tokens, or sequences with tokens
    return max(reduce(float(count)), 1.0)
