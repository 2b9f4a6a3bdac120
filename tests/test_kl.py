"""The estimators against exact expectations, by enumeration over a small vocabulary.

For a distribution mu that samples the token p, the expectation of an estimate is
sum_p mu(p) * est(p): we evaluate every p at once (T = V positions, token p at position p,
the same distributions everywhere) and weight by mu. Gradients of that sum are the
expected per-sample gradients (mu and the importance weights are constants), compared with
autograd's gradient of the exact KL.
"""

import pytest
import torch

from emapg import kl
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
