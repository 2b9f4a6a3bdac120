"""Rollout-mismatch correction between pi_old (the trainer's policy) and mu (the engine that sampled).

An inference engine samples with numbers that are not the trainer's (bf16 vLLM against a float32
trainer, other kernels, other reduction orders) and, with top-p, from a truncated distribution.
The PPO ratio pi_theta / pi_old then needs one more factor, pi_old / mu per token, to be an
importance weight of the distribution that really drew the tokens (verl's "decoupled" PPO).
These pure functions turn the two log-probs into per-token weights and a keep mask:

- none: weight 1, every token kept.
- token_tis: weight min(pi_old/mu, C) per token (truncated importance sampling, verl's default).
- seq_tis: weight min(prod_t pi_old/mu, C), the same for every token of a sequence.
- token_mask: tokens whose ratio leaves [1/C, C] are dropped.
- seq_mask: sequences whose product ratio leaves [1/C, C] are dropped (TRL's default mode).
- geo_mask: sequences whose geometric-mean ratio leaves [1/C, C] are dropped.

With mu == pi_old every mode is the identity: weights exactly 1, nothing dropped. The
weights multiply the policy-gradient term only; a dropped token leaves the loss altogether
(policy term, KL and the aggregation's count), as verl's rejection modes do. The KL needs
no such weight: its own importance weight already divides by mu (docs/design.md, section 7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from emapg.errors import EmapgError

MODES = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask")
MASKS = ("token_mask", "seq_mask", "geo_mask")


@dataclass
class Correction:
    weight: Tensor  # [N, L] multiplies the policy-gradient loss of each token (no gradient)
    keep: Tensor  # [N, L] bool: response tokens that stay in the loss


def correct(old_logp: Tensor, sampling_logp: Tensor, mask: Tensor, mode: str, cap: float) -> Correction:
    """Weights and keep mask for the response tokens `mask` [N, L] (bool), from log pi_old and
    log mu at the sampled tokens [N, L]. `cap` is C > 1."""
    if mode not in MODES:
        raise EmapgError(f"rollout correction must be one of {', '.join(MODES)}; got {mode!r}")
    if not cap > 1:
        raise EmapgError(f"rollout correction cap must be > 1; got {cap}")
    log_ratio = ((old_logp.detach().double() - sampling_logp.detach().double()) * mask).to(torch.float32)
    ones = torch.ones_like(log_ratio)
    if mode == "none":
        return Correction(ones, mask)
    log_cap = torch.tensor(cap, dtype=torch.float64).log().item()
    if mode == "token_tis":
        return Correction(log_ratio.clamp(max=log_cap).exp(), mask)
    if mode == "token_mask":
        return Correction(ones, mask & (log_ratio.abs() <= log_cap))
    seq = log_ratio.sum(-1, keepdim=True)  # log of the sequence's product ratio
    if mode == "seq_tis":
        return Correction(seq.clamp(max=log_cap).exp().expand_as(log_ratio).contiguous(), mask)
    if mode == "geo_mask":
        seq = seq / mask.sum(-1, keepdim=True).clamp(min=1)
    return Correction(ones, mask & (seq.abs() <= log_cap))


def mismatch_metrics(
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    old_topk: Tensor | None = None,
    engine_topk: Tensor | None = None,
) -> dict[str, float]:
    """How far the engine's distribution mu is from pi_old on the response tokens `mask`:
    the mean k3 estimate of KL(mu || pi_old) per token (tokens were drawn from mu), the largest
    |log pi_old - log mu|, and, given both top-k sets [N, L, k], the mean share of the engine's
    top-k that is in pi_old's (1: the same sets).

    Returns sums, not means (keys ending in _sum, and "tokens"), so that processes and
    micro-batches add up; `finish_mismatch` turns them into the logged figures."""
    log_w = (old_logp.detach().double() - sampling_logp.detach().double())[mask]
    out = {
        "kl_sum": float((torch.expm1(log_w) - log_w).sum()),
        "max_abs_logp": float(log_w.abs().max()) if log_w.numel() else 0.0,
        "tokens": float(mask.sum()),
    }
    if old_topk is not None and engine_topk is not None and old_topk.shape[-1]:
        shared = (engine_topk.unsqueeze(-1) == old_topk.unsqueeze(-2)).any(-1).sum(-1)
        out["topk_overlap_sum"] = float((shared.double() / old_topk.shape[-1])[mask].sum())
    return out


def dropped_sequences(keep: Tensor, mask: Tensor) -> Tensor:
    """[N] bool: sequences with response tokens of which none is kept."""
    return mask.any(-1) & ~(keep & mask).any(-1)
