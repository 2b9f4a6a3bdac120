"""Token-level KL estimators between the policy pi and the anchor pi_ref.

Every function returns a per-token estimate whose gradient flows into the policy's
log-probs only. Notation (docs/design.md): p is the sampled token, log w = log pi_ref(p) - log pi(p),
r = pi(p) / sg(pi(p)) (value 1, gradient of log pi), s = sg(pi(p) / pi_sampling(p)).

- `sampled`: the single-sample estimators k1, k2, k3, k3pp, k4, k5.
- `from_logprobs`: any estimator from log-probs gathered at the sampled token and at the
  top-k set q. The trainer's memory-efficient path (emapg.algo.topk summaries) calls this.
- `token_kl`: the reference entry point from full logits [..., T, V].

Extreme log-ratios. Every estimate and gradient is finite in float32 and float64 at any
log-ratio log-probs produce (tested to |log w| = 200; only values near |log w| ~ 1e19 would
overflow, k2's square first), and its gradient with respect to log pi(p) is the exact gradient of the estimator's own
definition (with w and log w both functions of log pi(p)), with one exception: a term
w = exp(log w) past log w = LOG_W_CAP (20, w ~ 4.9e8) is astronomically large, so there w is
capped at exp(LOG_W_CAP) -- in magnitude only, never in sign or direction:

- k1, k2, k4: no cap at all; gradients 1, -log w, -log w exactly.
- k3pp: no cap on the gradient, -log w exactly (its two w terms cancel: (w - 1 - log w) +
  (1 - w)); its value w - 1 - log w is capped as k3's is.
- k3: past the cap, w is replaced by its tangent at the cap, so the value is
  k3(C) + (e^C - 1)(log w - C) (C = LOG_W_CAP), still increasing, and the gradient is that
  function's own derivative, 1 - e^C (the exact 1 - w, capped in magnitude).
- k5: past the cap, the stop-gradient weight w is replaced by e^C: value e^C log w,
  gradient 1 - e^C.

Below the cap (log w <= C) every value and gradient is the definition's. The top-k tails use
k4 (reverse, uncapped) and k5 (forward, capped as above). The arithmetic is done in at least
float32, since exp(LOG_W_CAP) overflows float16.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import model_validator
from torch import Tensor

from emapg.algo.topk import Summary
from emapg.errors import EmapgError
from emapg.settings import Float, Section, check, setting

SAMPLED = ("k1", "k2", "k3", "k3pp", "k4", "k5")
TOPK = ("topk", "topk_paper", "truncated")
ESTIMATORS = SAMPLED + ("exact",) + TOPK
DIRECTIONS = ("reverse", "forward")

# Which KL each sampled estimator's value estimates (docs/design.md, section 2).
SAMPLED_DIRECTION = {"k1": "reverse", "k2": "reverse", "k3": "reverse", "k3pp": "reverse",
                     "k4": "reverse", "k5": "forward"}  # fmt: skip

# exp(20) ~ 5e8: beyond that a ratio is a numerical accident, not information, and exp() of
# it overflows float16 and dominates any batch in float32. Only terms in w = exp(log w) (and
# the importance weight s) are capped there; log-ratios themselves are never clamped.
LOG_W_CAP = 20.0


class KLSettings(Section):
    """The `kl` section: the KL regulariser's coefficient, estimator, direction and top-k set."""

    key: ClassVar[str] = "kl"
    beta: Float = setting(1e-3, "KL coefficient; 0 turns the KL off and builds no anchor", ge=0)
    estimator: Literal[ESTIMATORS] = setting(
        "topk", "token-level KL estimator (docs/design.md has the table)"
    )
    direction: Literal[DIRECTIONS] = setting("reverse", "reverse KL(pi||ref) or forward KL(ref||pi)")
    k: int = setting(32, "top-k set size for the top-k estimators", ge=0)
    importance_weight: bool = setting(
        True,
        "multiply the sampled estimate (top-k: its tail only) by s = pi/mu, mu the engine that drew the token: "
        "unbiased whenever pi != mu (later minibatches, an engine whose numbers differ); s = 1 on-policy. "
        "false reproduces recipes without it (verl, the paper's DeepScaleR scripts)",
    )
    iw_clip: list[Float | None] = setting(
        [], "optional [s_min, s_max] bounds on the importance weight; null: no bound on that side"
    )

    @model_validator(mode="after")
    def _rules(self):
        check_estimator(self.estimator, self.direction)
        bounds = [b for b in self.iw_clip if b is not None]
        check(
            self.iw_clip == []
            or (len(self.iw_clip) == 2 and all(b >= 0 for b in bounds) and bounds == sorted(bounds)),
            f"kl.iw_clip must be [] or [s_min, s_max] with 0 <= s_min <= s_max (null: no bound); got {self.iw_clip}",
        )
        return self


def q_source(estimator: str, direction: str) -> str:
    """Where the top-k set q of `estimator` comes from: "sampling" (reverse top-k: the top-k of
    the distribution the tokens were drawn from, pi_old), "anchor" (forward top-k: the anchor's
    own top-k), "vocab" (exact: q is the whole vocabulary) or "none" (a sampled estimator)."""
    if estimator == "exact":
        return "vocab"
    if estimator in TOPK:
        return "sampling" if direction == "reverse" else "anchor"
    return "none"


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


def _expm1_capped(log_w: Tensor) -> Tensor:
    """expm1(log w) up to LOG_W_CAP and its tangent line at the cap past it (C1, increasing).

    Its derivative is min(w, e^C): exact below the cap, e^C above. The exp branch sees a
    clamped input so that neither branch of the `where` overflows (an inf there would turn
    the masked-out gradient into nan).
    """
    below = torch.expm1(log_w.clamp(max=LOG_W_CAP))
    above = math.expm1(LOG_W_CAP) + math.exp(LOG_W_CAP) * (log_w - LOG_W_CAP)
    return torch.where(log_w > LOG_W_CAP, above, below)


def sampled(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Single-sample estimate at the sampled token from log pi(p) and log pi_ref(p).

    With log w = ref_logp - logp, r = pi(p)/sg(pi(p)) and C = LOG_W_CAP, the gradients with
    respect to logp (the module docstring says why w is capped past C):

    - k1 = -log w: gradient 1.
    - k2 = (log w)^2 / 2: gradient -log w.
    - k3 = w - 1 - log w: gradient 1 - w; past C, value k3(C) + (e^C - 1)(log w - C) and
      gradient 1 - e^C.
    - k3pp = r (w - 1 - log w): gradient -log w at every log w; value capped as k3's.
    - k4 = r sg(-log w): gradient -log w.
    - k5 = sg(w) log w + log r: gradient 1 - w; past C, w is e^C in both value and gradient.

    Computed in at least float32 (float64 stays float64); the result has that dtype.
    """
    if estimator not in SAMPLED:
        raise EmapgError(f"sampled estimator must be one of {', '.join(SAMPLED)}; got {estimator!r}")
    logp = _wide(logp)
    log_w = _wide(ref_logp).detach() - logp
    log_r = logp - logp.detach()
    if estimator == "k1":
        return -log_w
    if estimator == "k2":
        return 0.5 * log_w.square()
    if estimator == "k4":
        return torch.exp(log_r) * (-log_w).detach()
    if estimator == "k5":
        return torch.exp(log_w.clamp(max=LOG_W_CAP)).detach() * log_w + log_r
    k3 = _expm1_capped(log_w) - log_w  # w - 1 - log w, accurate near w = 1
    if estimator == "k3":
        return k3
    # k3pp: d/dlogp [r k3] = k3 + (1 - w) = -log w, exact at any log w (no w terms to cancel).
    return k3.detach() + log_r * (-log_w).detach()


def importance_weight(
    logp: Tensor, sampling_logp: Tensor, clip: tuple[float | None, float | None] | None = None
) -> Tensor:
    """s = sg(pi(p) / pi_sampling(p)), optionally clipped to [s_min, s_max].

    clip: None (or empty) for no clipping, else (s_min, s_max) where either may be None for a
    one-sided bound. s is capped at exp(LOG_W_CAP) before clipping (it carries no gradient).
    """
    log_s = (logp.detach() - sampling_logp.detach()).clamp(max=LOG_W_CAP)
    s = torch.exp(log_s)
    if not clip or (clip[0] is None and clip[1] is None):
        return s
    return s.clamp(min=clip[0], max=clip[1])


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
    in_head: [...] whether the sampled token is in q: bool, or numbers 0/1 (the paper's code
        passes a float mask), read as the boolean they mean; any other value is refused.
    weight: [...] importance weight s, or None on-policy. It multiplies the sampled tail
        only for top-k estimators, and the whole estimate for sampled ones.

    Every input is widened to at least float32 before any arithmetic (bfloat16 log-probs
    summed over a head of 32 in bfloat16 would lose their third digit).
    """
    check_estimator(estimator, direction)
    if estimator in SAMPLED:
        est = sampled(logp, ref_logp, estimator)
        return est if weight is None else est * _wide(weight)
    if head_logp is None or head_ref_logp is None or in_head is None:
        raise EmapgError(f"kl estimator {estimator!r} needs head_logp, head_ref_logp and in_head")
    in_head = _as_bool_mask(in_head)
    head_logp, head_ref_logp = _wide(head_logp), _wide(head_ref_logp).detach()
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
    return est + (tail if weight is None else tail * _wide(weight))


def _wide(x: Tensor) -> Tensor:
    """At least fp32 for the arithmetic; float64 stays float64 (exact enumeration tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _as_bool_mask(in_head: Tensor) -> Tensor:
    """`in_head` as bool. `~` of an integer 0/1 tensor is -1/-2 (uint8: 255/254), and a float
    one has no `~`: a numeric mask is read as the boolean it means, once checked to be 0/1."""
    if in_head.dtype == torch.bool:
        return in_head
    if in_head.is_complex() or not bool(((in_head == 0) | (in_head == 1)).all()):
        raise EmapgError(
            f"kl: in_head must be bool or hold only 0 and 1; got {in_head.dtype} with other values"
        )
    return in_head != 0


def _check_logits(name: str, x: Tensor) -> None:
    if not torch.is_floating_point(x):
        raise EmapgError(f"token_kl: {name} must be a floating-point tensor; got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise EmapgError(f"token_kl: {name} has non-finite values (nan or inf)")


def _check_token_kl_inputs(
    logits: Tensor,
    ref_logits: Tensor,
    tokens: Tensor,
    estimator: str,
    direction: str,
    k: int,
    sampling_logp: Tensor | None,
) -> None:
    """Raise EmapgError unless `token_kl`'s inputs agree in shape and hold usable values: token
    ids in the vocabulary, finite logits, no nan or +inf in sampling_logp."""
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
    iw_clip: tuple[float | None, float | None] | None = None,
) -> Tensor:
    """Per-token KL estimate [..., T] from full logits [..., T, V]; gradients reach `logits` only.

    estimator: one of ESTIMATORS. For "topk" in the reverse direction the top-k set is taken
    from `sampling_logp`'s distribution when given, else from `logits` (detached); in the
    forward direction from `ref_logits`. `tail=False` drops the sampled tail (= "truncated").
    sampling_logp: full logits or log-probs [..., T, V] of the policy that sampled `tokens`;
    it supplies the importance weight s (none when absent: on-policy).
    """
    _check_token_kl_inputs(logits, ref_logits, tokens, estimator, direction, k, sampling_logp)
    vocab = logits.shape[-1]
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
    iw_clip: tuple[float | None, float | None] | None = None,
) -> Tensor:
    """The trainer's memory-efficient path: same numbers as `token_kl`, from top-k summaries.

    policy: emapg.algo.topk summary of the policy gathered at ids [token, q_1 .. q_k].
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
