"""The estimators against exact expectations, by enumeration over a small vocabulary.

For a distribution mu that samples the token p, the expectation of an estimate is
sum_p mu(p) * est(p): we evaluate every p at once (T = V positions, token p at position p,
the same distributions everywhere) and weight by mu. Gradients of that sum are the
expected per-sample gradients (mu and the importance weights are constants), compared with
autograd's gradient of the exact KL.
"""

import math

import pytest
import torch

from emapg.algo import kl
from emapg.errors import EmapgError

V = 7
DT = torch.float64


def make(seed: int, off_policy: bool):
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(V, generator=g, dtype=DT) * 1.5).requires_grad_()
    ref = torch.randn(V, generator=g, dtype=DT) * 1.5
    sampling = torch.randn(V, generator=g, dtype=DT) * 1.5 if off_policy else None
    return theta, ref, sampling


def exact_kl(theta, ref, direction):
    logp, ref_logp = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    if direction == "reverse":
        return (logp.exp() * (logp - ref_logp)).sum()
    return (ref_logp.exp() * (ref_logp - logp)).sum()


def expectation(theta, ref, sampling, estimator, direction, k=0, tail=True):
    """(E_mu[est], E_mu[grad est]) with mu = sampling distribution (or the policy)."""
    tokens = torch.arange(V)
    est = kl.token_kl(
        theta.expand(V, V),
        ref.expand(V, V),
        tokens,
        estimator=estimator,
        direction=direction,
        k=k,
        tail=tail,
        sampling_logp=None if sampling is None else sampling.expand(V, V),
    )
    mu = torch.softmax(sampling if sampling is not None else theta.detach(), -1)
    value = (mu * est).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def truth(theta, ref, direction):
    value = exact_kl(theta, ref, direction)
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def close(a, b):
    return torch.allclose(a, b, atol=1e-10, rtol=1e-8)


# (estimator, direction, value unbiased, gradient unbiased), docs/design.md's table.
SAMPLED_TABLE = [
    ("k1", "reverse", True, False),
    ("k2", "reverse", False, True),
    ("k3", "reverse", True, False),
    ("k3pp", "reverse", True, True),
    ("k4", "reverse", True, True),
    ("k5", "forward", True, True),
]


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator,direction,value_ok,grad_ok", SAMPLED_TABLE)
def test_sampled_estimators_bias_table(estimator, direction, value_ok, grad_ok, seed, off_policy):
    theta, ref, sampling = make(seed, off_policy)
    value, grad = expectation(theta, ref, sampling, estimator, direction)
    true_value, true_grad = truth(theta, ref, direction)
    assert close(value, true_value) == value_ok
    assert close(grad, true_grad) == grad_ok


def test_k1_gradient_is_zero_and_k3_gradient_is_forward_kl():
    theta, ref, _ = make(3, False)
    _, g1 = expectation(theta, ref, None, "k1", "reverse")
    assert close(g1, torch.zeros(V, dtype=DT))
    _, g3 = expectation(theta, ref, None, "k3", "reverse")
    assert close(g3, truth(theta, ref, "forward")[1])


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("k", range(V + 1))
def test_topk_unbiased_in_value_and_gradient_for_every_k(k, direction, off_policy):
    theta, ref, sampling = make(10 + k, off_policy)
    value, grad = expectation(theta, ref, sampling, "topk", direction, k=k)
    true_value, true_grad = truth(theta, ref, direction)
    assert close(value, true_value)
    assert close(grad, true_grad)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("k", range(1, V))
def test_topk_paper_gradient_is_off_by_grad_of_head_mass(k, direction):
    """The printed algorithm: right value, gradient off by +grad pi(q) (reverse) / -grad pi(q)."""
    theta, ref, sampling = make(20 + k, True)
    value, grad = expectation(theta, ref, sampling, "topk_paper", direction, k=k)
    true_value, true_grad = truth(theta, ref, direction)
    source = sampling if direction == "reverse" else ref
    q = source.topk(k).indices
    (grad_mass,) = torch.autograd.grad(torch.softmax(theta, -1)[q].sum(), theta)
    sign = 1.0 if direction == "reverse" else -1.0
    assert close(value, true_value)
    assert not close(grad, true_grad)
    assert close(grad - true_grad, sign * grad_mass)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_limits_exact_and_sampled(direction):
    theta, ref, sampling = make(5, True)
    tokens = torch.arange(V)
    args = (theta.expand(V, V), ref.expand(V, V), tokens)
    kw = {"direction": direction, "sampling_logp": sampling.expand(V, V)}
    full = kl.token_kl(*args, estimator="topk", k=V, **kw)
    exact = kl.token_kl(*args, estimator="exact", **kw)
    assert close(full, exact)
    assert close(exact, exact_kl(theta, ref, direction).detach().expand(V))
    none = kl.token_kl(*args, estimator="topk", k=0, **kw)
    sampled = kl.token_kl(*args, estimator="k4" if direction == "reverse" else "k5", **kw)
    assert close(none, sampled)
    for a, b in [(full, exact), (none, sampled)]:
        ga = torch.autograd.grad(a.sum(), theta, retain_graph=True)[0]
        gb = torch.autograd.grad(b.sum(), theta, retain_graph=True)[0]
        assert close(ga, gb)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_truncated_is_biased_below_full_vocab_and_exact_at_it(direction):
    theta, ref, _ = make(6, False)
    true_value, _ = truth(theta, ref, direction)
    for k in range(V):
        value, _ = expectation(theta, ref, None, "truncated", direction, k=k)
        assert not close(value, true_value)
        assert close(value, expectation(theta, ref, None, "topk", direction, k=k, tail=False)[0])
    assert close(expectation(theta, ref, None, "truncated", direction, k=V)[0], true_value)


def test_importance_weight_clip_bounds_the_weight():
    logp = torch.tensor([0.0, -3.0, -0.1])
    sampling = torch.tensor([-3.0, 0.0, -0.1])
    s = kl.importance_weight(logp, sampling, (0.5, 2.0))
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))


def test_extreme_log_ratios_stay_finite():
    logp = torch.tensor([-200.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -200.0])
    for est in ("k1", "k2", "k3", "k3pp", "k4", "k5"):
        out = kl.sampled(logp, ref, est)
        (g,) = torch.autograd.grad(out.sum(), logp)
        assert torch.isfinite(out).all() and torch.isfinite(g).all(), est


CAP = kl.LOG_W_CAP
LOG_W_GRID = [-40.0, -25.0, -20.5, -5.0, 0.0, 0.25, 5.0, 20.0, 20.5, 25.0, 40.0]


def grid_logprobs(dtype):
    """logp (a leaf) and ref_logp with ref_logp - logp exactly LOG_W_GRID in `dtype`."""
    x = torch.tensor(LOG_W_GRID, dtype=torch.float64)
    logp = torch.where(x > 0, -0.5 - x, torch.full_like(x, -0.5))
    ref = torch.where(x > 0, torch.full_like(x, -0.5), x - 0.5)
    logp, ref = logp.to(dtype).requires_grad_(), ref.to(dtype)
    assert (ref - logp).tolist() == LOG_W_GRID
    return logp, ref


def by_hand(estimator, x):
    """(value, d value / d logp) of the definition at log w = x (d log w / d logp = -1,
    d w / d logp = -w, d r / d logp = r = 1); past LOG_W_CAP, the documented cap."""
    w = math.exp(min(x, CAP))  # w itself at or below the cap, e^CAP past it
    # past the cap, w's tangent at the cap: k3(CAP) + (e^CAP - 1)(x - CAP)
    k3 = math.expm1(min(x, CAP)) - min(x, CAP) + (math.exp(CAP) - 1) * max(x - CAP, 0.0)
    return {
        "k1": (-x, 1.0),  # -log w
        "k2": (x * x / 2, -x),  # (log w)^2 / 2
        "k3": (k3, 1 - w),  # w - 1 - log w: -w + 1
        "k3pp": (k3, -x),  # r k3: k3 + (1 - w) = -log w, never capped
        "k4": (-x, -x),  # r sg(-log w)
        "k5": (w * x, 1 - w),  # sg(w) log w + log r: -w + 1
    }[estimator]


def naive(estimator, logp, ref):
    """The definitions verbatim, no clamp or cap (float64 only: w = e^40 is finite there)."""
    log_w = ref - logp
    w, r = log_w.exp(), (logp - logp.detach()).exp()
    return {
        "k1": -log_w,
        "k2": 0.5 * log_w**2,
        "k3": w - 1 - log_w,
        "k3pp": r * (w - 1 - log_w),
        "k4": r * (-log_w).detach(),
        "k5": w.detach() * log_w + r.log(),
    }[estimator]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", kl.SAMPLED)
def test_sampled_value_and_gradient_at_extreme_log_ratios(estimator, dtype):
    """|log w| up to 40: finite, and the definition's value and gradient (or the documented cap)."""
    logp, ref = grid_logprobs(dtype)
    out = kl.sampled(logp, ref, estimator)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(grad).all()
    value, want = zip(*(by_hand(estimator, x) for x in LOG_W_GRID), strict=True)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 1e-6}
    torch.testing.assert_close(out.double(), torch.tensor(value, dtype=torch.float64), **tol)
    torch.testing.assert_close(grad.double(), torch.tensor(want, dtype=torch.float64), **tol)


@pytest.mark.parametrize("estimator", kl.SAMPLED)
def test_sampled_gradient_is_autograd_of_definition_and_capped_only_in_magnitude(estimator):
    """Checks `by_hand` against autograd of the unclamped definitions (float64), and that past
    the cap the gradient keeps the exact one's sign and is no larger than it."""
    logp, ref = grid_logprobs(torch.float64)
    (exact,) = torch.autograd.grad(naive(estimator, logp, ref).sum(), logp)
    (ours,) = torch.autograd.grad(kl.sampled(logp, ref, estimator).sum(), logp)
    assert torch.isfinite(exact).all()
    for i, x in enumerate(LOG_W_GRID):
        hand = by_hand(estimator, x)[1]
        if x <= CAP or estimator in ("k1", "k2", "k3pp", "k4"):
            # naive k3pp sums two ~w terms that cancel: absolute error ~ eps * w
            assert exact[i].item() == pytest.approx(hand, rel=1e-12, abs=1e-12 * math.exp(x)), x
            assert ours[i].item() == pytest.approx(hand, rel=1e-12, abs=1e-12), x
        else:
            assert math.copysign(1, ours[i].item()) == math.copysign(1, exact[i].item()), x
            assert abs(ours[i].item()) <= abs(exact[i].item()), x
            assert ours[i].item() == pytest.approx(1 - math.exp(CAP), rel=1e-12), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", ["topk", "topk_paper"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_tail_at_extreme_log_ratios(direction, estimator, dtype):
    """The sampled tail (k4 reverse, k5 forward) at log w = +-40: finite, tail gradient exact
    (reverse: -log w) or capped with its sign (forward: 1 - min(w, e^CAP))."""
    logp = torch.tensor([-45.0, -5.0], dtype=dtype, requires_grad=True)
    ref = torch.tensor([-5.0, -45.0], dtype=dtype)  # log w = +40 (policy far below anchor), -40
    head = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.4]], dtype=dtype)).requires_grad_()
    head_ref = torch.log(torch.tensor([[0.5, 0.2], [0.7, 0.1]], dtype=dtype))
    kw = {"direction": direction, "head_logp": head, "head_ref_logp": head_ref}
    out = kl.from_logprobs(logp, ref, estimator=estimator, in_head=torch.tensor([False, False]), **kw)
    g_logp, g_head = torch.autograd.grad(out.sum(), (logp, head))
    assert torch.isfinite(out).all() and torch.isfinite(g_logp).all() and torch.isfinite(g_head).all()
    tail = "k4" if direction == "reverse" else "k5"
    truncated = kl.from_logprobs(logp, ref, estimator="truncated", in_head=torch.tensor([True, True]), **kw)
    want = [by_hand(tail, x) for x in (40.0, -40.0)]
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 1e-6}
    torch.testing.assert_close(
        (out - truncated).detach().double(), torch.tensor([v for v, _ in want], dtype=torch.float64), **tol
    )
    torch.testing.assert_close(
        g_logp.double(), torch.tensor([g for _, g in want], dtype=torch.float64), **tol
    )
    # where the policy has drifted far below the anchor the regulariser pushes log pi(p) up
    assert g_logp[0] < 0 and g_logp[1] > 0
    if direction == "reverse":
        assert g_logp[0].item() == -40.0
    else:
        assert g_logp[0].item() == pytest.approx(1 - math.exp(CAP), rel=1e-6)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_token_kl_from_logits_at_extreme_log_ratios_is_finite(direction):
    """Full float32 logits, the sampled token 40 nats below the anchor and off the top-k set."""
    logits = torch.tensor([[3.0, 2.0, 0.0, -40.0], [3.0, 2.0, 0.0, 0.0]], requires_grad=True)
    ref_logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [3.0, 2.0, 0.0, -40.0]])
    tokens = torch.tensor([3, 3])
    for estimator in ("topk", "topk_paper", "k4" if direction == "reverse" else "k5"):
        out = kl.token_kl(logits, ref_logits, tokens, estimator=estimator, direction=direction, k=2)
        (grad,) = torch.autograd.grad(out.sum(), logits)
        assert torch.isfinite(out).all() and torch.isfinite(grad).all(), estimator
        assert grad[0, 3] < 0 and grad[1, 3] > 0, estimator


def test_importance_weight_one_sided_clip():
    logp = torch.tensor([0.0, -3.0, -0.1, 50.0])
    sampling = torch.tensor([-3.0, 0.0, -0.1, 0.0])
    s = torch.tensor([math.exp(3), math.exp(-3), 1.0, math.exp(CAP)])  # s capped at e^CAP
    assert torch.allclose(kl.importance_weight(logp, sampling), s)
    for clip in [(), (None, None)]:
        assert torch.allclose(kl.importance_weight(logp, sampling, clip), s)
    upper = kl.importance_weight(logp, sampling, (None, 2.0))
    assert torch.allclose(upper, torch.tensor([2.0, math.exp(-3), 1.0, 2.0]))
    lower = kl.importance_weight(logp, sampling, (0.5, None))
    assert torch.allclose(lower, torch.tensor([math.exp(3), 0.5, 1.0, math.exp(CAP)]))
    theta, ref, sampling_logits = make(7, True)
    tokens = torch.arange(V)
    args = (theta.expand(V, V), ref.expand(V, V), tokens)
    kw = {"estimator": "k3", "sampling_logp": sampling_logits.expand(V, V)}
    unclipped = kl.token_kl(*args, **kw)
    one_sided = kl.token_kl(*args, iw_clip=(None, 1.0), **kw)
    ratio = (torch.log_softmax(theta, -1) - torch.log_softmax(sampling_logits, -1)).exp().detach()
    assert close(one_sided, unclipped / ratio * ratio.clamp(max=1.0))


def test_topk_variance_falls_with_k():
    """Monte Carlo: same samples for every k; the sampled tail is all the variance there is."""
    vocab, n = 50, 4000
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(vocab, generator=g, dtype=DT) * 2
    ref = theta + torch.randn(vocab, generator=g, dtype=DT) * 0.7
    tokens = torch.multinomial(torch.softmax(theta, -1), n, replacement=True, generator=g)
    stds = []
    for k in (0, 2, 8, 32, vocab):
        est = kl.token_kl(theta.expand(n, vocab), ref.expand(n, vocab), tokens, estimator="topk", k=k)
        stds.append(est.std().item())
    k4 = kl.token_kl(theta.expand(n, vocab), ref.expand(n, vocab), tokens, estimator="k4").std().item()
    assert stds[0] == pytest.approx(k4, rel=1e-9)
    assert all(a > b for a, b in zip(stds, stds[1:], strict=False)), stds
    assert stds[-1] < 1e-12
    assert stds[2] < 0.5 * k4


BAD_INPUTS = [
    ({"estimator": "k9"}, "kl estimator must be one of"),
    ({"direction": "sideways"}, "kl direction must be"),
    ({"estimator": "k5"}, "estimates forward KL"),
    ({"k": -1}, "k must be in"),
    ({"k": V + 1}, "k must be in"),
]


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS)
def test_bad_arguments_raise_one_clear_line(kwargs, message):
    logits = torch.zeros(3, V)
    with pytest.raises(EmapgError, match=message) as info:
        kl.token_kl(logits, logits, torch.zeros(3, dtype=torch.long), **kwargs)
    assert "\n" not in str(info.value)


def test_bad_tensors_raise_one_clear_line():
    good = torch.zeros(3, V)
    tokens = torch.zeros(3, dtype=torch.long)
    cases = [
        ((good, torch.zeros(3, V + 1), tokens), "logits and ref_logits must both be"),
        ((good, good, torch.zeros(4, dtype=torch.long)), "tokens must be"),
        ((good, good, torch.full((3,), V)), r"tokens must be integer ids in \[0, 7\)"),
        ((good, good, torch.full((3,), -1)), "tokens must be integer ids"),
        ((good, good, tokens.float()), "tokens must be integer ids"),
        (
            (good.clone().index_fill_(1, torch.tensor([2]), float("nan")), good, tokens),
            "logits has non-finite",
        ),
        ((good, good.clone().fill_(float("inf")), tokens), "ref_logits has non-finite"),
    ]
    for args, message in cases:
        with pytest.raises(EmapgError, match=message):
            kl.token_kl(*args, k=2)
    with pytest.raises(EmapgError, match="sampling_logp must be"):
        kl.token_kl(good, good, tokens, k=2, sampling_logp=torch.zeros(2, V))


def _gathered(seed: int, vocab: int = 300, positions: int = 16, k: int = 32):
    """Log-probs of a policy and an anchor over `vocab` tokens at `positions` positions, gathered
    at a sampled token and at the policy's top-k set q, as other frameworks pass them."""
    g = torch.Generator().manual_seed(seed)
    logp_all = torch.log_softmax(torch.randn(positions, vocab, generator=g, dtype=DT) * 2, -1)
    ref_all = torch.log_softmax(torch.randn(positions, vocab, generator=g, dtype=DT) * 2, -1)
    tokens = torch.multinomial(logp_all.exp(), 1, generator=g)
    q = logp_all.topk(k, -1).indices
    return {
        "logp": logp_all.gather(-1, tokens)[:, 0],
        "ref_logp": ref_all.gather(-1, tokens)[:, 0],
        "head_logp": logp_all.gather(-1, q),
        "head_ref_logp": ref_all.gather(-1, q),
    }, (q == tokens).any(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.int32])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_a_numeric_in_head_mask_means_its_boolean(dtype, direction):
    """The paper's code passes `not_in_topk.to(dtype)`; `~` of an integer 0/1 mask is -1/-2 (or
    255/254), a silently wrong tail. A 0/1 mask of any dtype gives the bool mask's numbers."""
    tensors, in_head = _gathered(0)
    assert in_head.any() and (~in_head).any()  # both branches of the tail are exercised
    want = kl.from_logprobs(**tensors, estimator="topk", direction=direction, in_head=in_head)
    got = kl.from_logprobs(**tensors, estimator="topk", direction=direction, in_head=in_head.to(dtype))
    assert torch.equal(got, want)


def test_an_in_head_mask_with_other_values_is_one_line():
    tensors, in_head = _gathered(0)
    for bad in (in_head.long() * 2 - 1, in_head.float() * 0.5):
        with pytest.raises(EmapgError, match="in_head must be bool or hold only 0 and 1") as e:
            kl.from_logprobs(**tensors, in_head=bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("estimator", ["topk", "truncated", "k3"])
def test_bfloat16_inputs_are_computed_in_float32(estimator, direction):
    """bfloat16 log-probs (300-token vocabulary, k = 32) give exactly the float32 computation of
    the same bfloat16 values; summed over the head in bfloat16 they would be off by more than
    1e-5, which the last assertion shows (the test has teeth)."""
    if estimator == "k3" and direction == "forward":
        pytest.skip("k3 estimates reverse KL")
    tensors, in_head = _gathered(1)
    low = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    got = kl.from_logprobs(**low, estimator=estimator, direction=direction, in_head=in_head)
    want = kl.from_logprobs(
        **{k: v.float() for k, v in low.items()}, estimator=estimator, direction=direction, in_head=in_head
    )
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if estimator != "k3":
        h, r = low["head_logp"], low["head_ref_logp"]
        in_bf16 = (h.exp() * (h - r)).sum(-1) if direction == "reverse" else (r.exp() * (r - h)).sum(-1)
        in_f64 = (
            (h.double().exp() * (h.double() - r.double())).sum(-1)
            if direction == "reverse"
            else (r.double().exp() * (r.double() - h.double())).sum(-1)
        )
        assert (in_bf16.double() - in_f64).abs().max() > 1e-5
