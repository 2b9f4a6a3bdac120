"""Token-level KL estimators between the policy pi and the anchor pi_ref.

Every function returns a per-token estimate whose gradient flows into the policy's
log-probs only. Notation (docs/design.md): p is the sampled token, log w = log pi_ref(p) - log pi(p),
r = pi(p) / sg(pi(p)) (value 1, gradient of log pi), s = sg(pi(p) / pi_sampling(p)).

- `sampled`: the single-sample estimators k1, k2, k3, k3pp, k4, k5.
- `from_logprobs`: any estimator from log-probs gathered at the sampled token and at the
  top-k set q. The trainer's memory-efficient path (emapg.topk summaries) calls this.
- `token_kl`: the reference entry point from full logits [..., T, V].
"""

from __future__ import annotations

import torch
from torch import Tensor

from emapg.errors import EmapgError
from emapg.topk import Summary

SAMPLED = ("k1", "k2", "k3", "k3pp", "k4", "k5")
TOPK = ("topk", "topk_paper", "truncated")
ESTIMATORS = SAMPLED + ("exact",) + TOPK
DIRECTIONS = ("reverse", "forward")

# Which KL each sampled estimator's value estimates (docs/design.md, section 2).
SAMPLED_DIRECTION = {"k1": "reverse", "k2": "reverse", "k3": "reverse", "k3pp": "reverse",
                     "k4": "reverse", "k5": "forward"}  # fmt: skip

# exp(20) ~ 5e8: beyond that a log-ratio is a numerical accident, not information, and
# exp() of it would overflow in bf16/fp16 and dominate any batch in fp32.
LOG_RATIO_CLAMP = 20.0


def check_estimator(estimator: str, direction: str) -> None:
    """Raise EmapgError unless (estimator, direction) names a known estimator of that KL."""
    if estimator not in ESTIMATORS:
        raise EmapgError(f"kl estimator must be one of {', '.join(ESTIMATORS)}; got {estimator!r}")
    if direction not in DIRECTIONS:
        raise EmapgError(f"kl direction must be 'reverse' or 'forward'; got {direction!r}")
    if estimator in SAMPLED and SAMPLED_DIRECTION[estimator] != direction:
        raise EmapgError(
            f"kl estimator {estimator!r} estimates {SAMPLED_DIRECTION[estimator]} KL; "
            f"got direction={direction!r}"
        )


def sampled(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Single-sample estimate at the sampled token from log pi(p) and log pi_ref(p)."""
    if estimator not in SAMPLED:
        raise EmapgError(f"sampled estimator must be one of {', '.join(SAMPLED)}; got {estimator!r}")
    log_w = (ref_logp.detach() - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_r = logp - logp.detach()
    if estimator == "k1":
        return -log_w
    if estimator == "k2":
        return 0.5 * log_w.square()
    k3 = torch.expm1(log_w) - log_w  # w - 1 - log w, accurate near w = 1
    if estimator == "k3":
        return k3
    if estimator == "k3pp":
        return torch.exp(log_r) * k3
    if estimator == "k4":
        return torch.exp(log_r) * (-log_w).detach()
    return torch.exp(log_w).detach() * log_w + log_r  # k5


def importance_weight(logp: Tensor, sampling_logp: Tensor, clip: tuple[float, float] | None = None) -> Tensor:
    """s = sg(pi(p) / pi_sampling(p)), optionally clipped to [s_min, s_max]."""
    log_s = (logp.detach() - sampling_logp.detach()).clamp(max=LOG_RATIO_CLAMP)
    s = torch.exp(log_s)
    return s if clip is None else s.clamp(clip[0], clip[1])


def from_logprobs(
    logp: Tensor,
    ref_logp: Tensor,
    *,
    estimator: str = "topk",
    direction: str = "reverse",
    head_logp: Tensor | None = None,
    head_ref_logp: Tensor | None = None,
    in_head: Tensor | None = None,
    weight: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate from gathered log-probs.

    logp, ref_logp: [...] policy and anchor log-probs at the sampled token.
    head_logp, head_ref_logp: [..., k] log-probs at the top-k set q (top-k estimators;
        "exact" is the top-k estimator with q = the whole vocabulary).
    in_head: [...] bool, whether the sampled token is in q.
    weight: [...] importance weight s, or None on-policy. It multiplies the sampled tail
        only for top-k estimators, and the whole estimate for sampled ones.
    """
    check_estimator(estimator, direction)
    if estimator in SAMPLED:
        est = sampled(logp, ref_logp, estimator)
        return est if weight is None else est * weight
    if head_logp is None or head_ref_logp is None or in_head is None:
        raise EmapgError(f"kl estimator {estimator!r} needs head_logp, head_ref_logp and in_head")
    head_ref_logp = head_ref_logp.detach()
    p_head = head_logp.exp()
    mass = p_head.sum(-1)
    if direction == "reverse":
        est = (p_head * (head_logp - head_ref_logp)).sum(-1)
        tail_estimator, mass_sign = "k4", -1.0
    else:
        est = (head_ref_logp.exp() * (head_ref_logp - head_logp)).sum(-1)
        tail_estimator, mass_sign = "k5", 1.0
    if estimator == "topk":
        # Zero-valued term that restores the gradient the sampled tail misses:
        # d/dtheta sum_tail pi log pi has a "+ grad pi(tail)" that the sampled tail term drops,
        # and grad pi(tail) = -grad pi(q). Without it ("topk_paper") the expected gradient is
        # off by +grad pi(q) (reverse) / -grad pi(q) (forward). See docs/design.md, section 3.
        est = est + mass_sign * (mass - mass.detach())
    if estimator == "truncated":
        return est
    tail = sampled(logp, ref_logp, tail_estimator) * (~in_head)
    return est + (tail if weight is None else tail * weight)


def _wide(x: Tensor) -> Tensor:
    """At least fp32 for the arithmetic; float64 stays float64 (exact enumeration tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_logits(name: str, x: Tensor) -> None:
    if not torch.is_floating_point(x):
        raise EmapgError(f"token_kl: {name} must be a floating-point tensor; got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise EmapgError(f"token_kl: {name} has non-finite values (nan or inf)")


def token_kl(
    logits: Tensor,
    ref_logits: Tensor,
    tokens: Tensor,
    *,
    estimator: str = "topk",
    direction: str = "reverse",
    k: int = 32,
    tail: bool = True,
    sampling_logp: Tensor | None = None,
    iw_clip: tuple[float, float] | None = None,
) -> Tensor:
    """Per-token KL estimate [..., T] from full logits [..., T, V]; gradients reach `logits` only.

    estimator: one of ESTIMATORS. For "topk" in the reverse direction the top-k set is taken
    from `sampling_logp`'s distribution when given, else from `logits` (detached); in the
    forward direction from `ref_logits`. `tail=False` drops the sampled tail (= "truncated").
    sampling_logp: full logits or log-probs [..., T, V] of the policy that sampled `tokens`;
    it supplies the importance weight s (none when absent: on-policy).
    """
    check_estimator(estimator, direction)
    if logits.dim() < 2 or logits.shape != ref_logits.shape:
        raise EmapgError(
            f"token_kl: logits and ref_logits must both be [..., T, V]; got {tuple(logits.shape)} "
            f"and {tuple(ref_logits.shape)}"
        )
    if tokens.shape != logits.shape[:-1]:
        raise EmapgError(f"token_kl: tokens must be {tuple(logits.shape[:-1])}; got {tuple(tokens.shape)}")
    vocab = logits.shape[-1]
    if tokens.dtype not in (torch.int32, torch.int64) or (
        tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab)
    ):
        raise EmapgError(f"token_kl: tokens must be integer ids in [0, {vocab})")
    if estimator in TOPK and not 0 <= k <= vocab:
        raise EmapgError(f"token_kl: k must be in [0, vocab size {vocab}]; got {k}")
    if sampling_logp is not None and sampling_logp.shape != logits.shape:
        raise EmapgError(
            f"token_kl: sampling_logp must be {tuple(logits.shape)}; got {tuple(sampling_logp.shape)}"
        )
    _check_logits("logits", logits)
    _check_logits("ref_logits", ref_logits)
    if sampling_logp is not None and bool(
        torch.isnan(sampling_logp).any() | (sampling_logp == torch.inf).any()
    ):
        raise EmapgError("token_kl: sampling_logp has nan or +inf values")

    logp_all = torch.log_softmax(_wide(logits), dim=-1)
    ref_all = torch.log_softmax(_wide(ref_logits.detach()), dim=-1)
    index = tokens.long().unsqueeze(-1)
    logp = logp_all.gather(-1, index).squeeze(-1)
    ref_logp = ref_all.gather(-1, index).squeeze(-1)
    weight = None
    if sampling_logp is not None:
        sampling_all = torch.log_softmax(_wide(sampling_logp.detach()), dim=-1)
        weight = importance_weight(logp, sampling_all.gather(-1, index).squeeze(-1), iw_clip)

    if estimator in SAMPLED:
        return from_logprobs(logp, ref_logp, estimator=estimator, direction=direction, weight=weight)
    if estimator == "exact":
        estimator, k = "topk", vocab
    elif not tail:
        estimator = "truncated"
    if direction == "forward":
        source = ref_all
    else:
        source = sampling_all if sampling_logp is not None else logp_all.detach()
    head_ids = source.topk(k, dim=-1).indices
    return from_logprobs(
        logp,
        ref_logp,
        estimator=estimator,
        direction=direction,
        head_logp=logp_all.gather(-1, head_ids),
        head_ref_logp=ref_all.gather(-1, head_ids),
        in_head=(head_ids == index).any(-1),
        weight=weight,
    )


def from_summary(
    policy: Summary,
    in_head: Tensor,
    ref_logp: Tensor,
    ref_head_logp: Tensor | None,
    *,
    estimator: str = "topk",
    direction: str = "reverse",
    sampling_logp: Tensor | None = None,
    iw_clip: tuple[float, float] | None = None,
) -> Tensor:
    """The trainer's memory-efficient path: same numbers as `token_kl`, from top-k summaries.

    policy: emapg.topk summary of the policy gathered at ids [token, q_1 .. q_k].
    ref_logp, ref_head_logp: the anchor's log-probs at the token and at q (from its summary).
    sampling_logp: [...] the sampling policy's log-prob at the token; gives the weight s.
    "exact" is "topk" with q = the whole vocabulary.
    """
    logp_ids = policy.logp()
    logp = logp_ids[..., 0]
    weight = None if sampling_logp is None else importance_weight(logp, sampling_logp, iw_clip)
    return from_logprobs(
        logp,
        ref_logp,
        estimator="topk" if estimator == "exact" else estimator,
        direction=direction,
        head_logp=logp_ids[..., 1:],
        head_ref_logp=ref_head_logp,
        in_head=in_head,
        weight=weight,
    )
