"""Rollout-mismatch correction (emapg.algo.rollout_correction) and the KL's importance weight when the
engine mu differs from pi_old: expected values written out or computed by enumeration."""

import math

import pytest
import torch

from emapg.algo import kl, rollout_correction
from emapg.algo.rollout_correction import correct, dropped_sequences, mismatch_metrics
from emapg.errors import EmapgError

# Two sequences; row 1's last column is padding. Ratios pi_old / mu per token:
RATIOS = [[0.5, 3.0, 1.5], [1.2, 0.9, 7.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
CAP = 2.0


def _logps():
    old = torch.log(torch.tensor(RATIOS, dtype=torch.float64)) - 1.0
    return old.float(), torch.full((2, 3), -1.0)


def test_each_mode_on_written_out_ratios():
    old, mu = _logps()
    f = pytest.approx
    c = correct(old, mu, MASK, "token_tis", CAP)
    assert c.weight[MASK].tolist() == f([0.5, 2.0, 1.5, 1.2, 0.9], rel=1e-6)
    assert torch.equal(c.keep, MASK)
    c = correct(old, mu, MASK, "seq_tis", CAP)  # products 2.25 (capped at 2) and 1.08
    assert c.weight[MASK].tolist() == f([2.0, 2.0, 2.0, 1.08, 1.08], rel=1e-6)
    c = correct(old, mu, MASK, "token_mask", CAP)  # 3.0 leaves [0.5, 2]; 0.5 is on its edge
    assert c.keep.tolist() == [[True, False, True], [True, True, False]]
    assert torch.equal(c.weight, torch.ones(2, 3))
    c = correct(old, mu, MASK, "seq_mask", CAP)  # 2.25 > 2: row 0 goes; 1.08 stays
    assert c.keep.tolist() == [[False, False, False], [True, True, False]]
    assert dropped_sequences(c.keep, MASK).tolist() == [True, False]
    c = correct(old, mu, MASK, "geo_mask", CAP)  # 2.25 ** (1/3) = 1.31 and 1.08 ** (1/2): both stay
    assert torch.equal(c.keep, MASK)
    c = correct(old, mu, MASK, "geo_mask", 1.2)  # 1.31 > 1.2: row 0 goes; 1.039 stays
    assert c.keep.tolist() == [[False, False, False], [True, True, False]]
    c = correct(old, mu, MASK, "none", CAP)
    assert torch.equal(c.weight, torch.ones(2, 3)) and torch.equal(c.keep, MASK)


@pytest.mark.parametrize("mode", rollout_correction.MODES)
def test_identity_when_the_engine_is_pi_old(mode):
    logp = -torch.rand(4, 7) * 5
    mask = torch.rand(4, 7) > 0.2
    c = correct(logp, logp.clone(), mask, mode, 1.5)
    assert torch.equal(c.weight, torch.ones(4, 7))  # exactly 1: multiplying by it changes no bit
    assert torch.equal(c.keep, mask)


def test_bad_mode_or_cap_is_one_line():
    logp, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(EmapgError, match="rollout correction must be one of"):
        correct(logp, logp, mask, "tis", 2.0)
    with pytest.raises(EmapgError, match="cap must be > 1"):
        correct(logp, logp, mask, "token_tis", 1.0)


def test_untruncated_token_weight_makes_the_expectation_pi_olds():
    """Sum over the vocabulary of mu(j) w(j) f(j) = sum of pi_old(j) f(j): the weight turns
    tokens drawn from mu into an estimate under pi_old (cap far above every ratio)."""
    torch.manual_seed(0)
    mu = torch.softmax(torch.randn(9, dtype=torch.float64), 0)
    old = torch.softmax(torch.randn(9, dtype=torch.float64), 0)
    f = torch.randn(9, dtype=torch.float64)
    w = correct(old.log()[None], mu.log()[None], torch.ones(1, 9, dtype=torch.bool), "token_tis", 1e6).weight[
        0
    ]
    assert float((mu * w.double() * f).sum()) == pytest.approx(float((old * f).sum()), rel=1e-6)


def test_mismatch_metrics_written_out():
    old, mu = _logps()
    old_topk = torch.tensor([[[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 4], [0, 0]]])
    engine_topk = torch.tensor([[[2, 1], [3, 9], [7, 8]], [[1, 2], [4, 3], [5, 5]]])
    m = mismatch_metrics(old, mu, MASK, old_topk, engine_topk)
    k3 = sum(r - 1 - math.log(r) for r in (0.5, 3.0, 1.5, 1.2, 0.9))
    assert m["kl_sum"] == pytest.approx(k3, rel=1e-6)
    assert m["max_abs_logp"] == pytest.approx(math.log(3.0), rel=1e-6)
    assert m["tokens"] == 5
    assert m["topk_overlap_sum"] == pytest.approx(1 + 0.5 + 0 + 1 + 1)


def test_mismatch_kl_is_kl_of_mu_against_pi_old_in_expectation():
    torch.manual_seed(1)
    mu = torch.softmax(torch.randn(7, dtype=torch.float64), 0)
    old = torch.softmax(torch.randn(7, dtype=torch.float64), 0)
    all_tokens = torch.ones(7, 1, dtype=torch.bool)
    per_token = [mismatch_metrics(old.log()[j : j + 1, None], mu.log()[j : j + 1, None], all_tokens[:1])["kl_sum"]
                 for j in range(7)]  # fmt: skip
    expected = float((mu * (mu.log() - old.log())).sum())
    assert sum(m * k for m, k in zip(mu.tolist(), per_token, strict=True)) == pytest.approx(
        expected, rel=1e-9
    )


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_kl_stays_unbiased_when_mu_differs_from_pi_old(direction):
    """Tokens drawn from mu, q = pi_old's top-k (reverse; the anchor's for forward), the tail
    weighted by s = pi/mu: the expected estimate and gradient are the exact KL's. Dividing by
    pi_old instead (the trainer's own pass) is biased: the tail's weight must be mu's."""
    torch.manual_seed(2)
    vocab, k = 8, 3
    logits = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(vocab, dtype=torch.float64)
    old = torch.randn(vocab, dtype=torch.float64)  # pi_old: q's source, not what drew the tokens
    mu = old + 0.7 * torch.randn(vocab, dtype=torch.float64)  # the engine: another distribution
    logp, ref_logp = torch.log_softmax(logits, 0), torch.log_softmax(ref, 0)
    mu_logp, old_logp = torch.log_softmax(mu, 0), torch.log_softmax(old, 0)
    q = (old_logp if direction == "reverse" else ref_logp).topk(k).indices

    def expected_estimate(divide_by):
        tokens = torch.arange(vocab)
        est = kl.from_logprobs(
            logp[tokens], ref_logp[tokens], estimator="topk", direction=direction,
            head_logp=logp[q].expand(vocab, k), head_ref_logp=ref_logp[q].expand(vocab, k),
            in_head=(tokens[:, None] == q).any(-1), weight=kl.importance_weight(logp[tokens], divide_by[tokens]),
        )  # fmt: skip
        return (mu_logp.exp() * est).sum()

    p, r = logp.exp(), ref_logp.exp()
    exact = (p * (logp - ref_logp)).sum() if direction == "reverse" else (r * (ref_logp - logp)).sum()
    (exact_grad,) = torch.autograd.grad(exact, logits, retain_graph=True)
    value = expected_estimate(mu_logp)
    (grad,) = torch.autograd.grad(value, logits, retain_graph=True)
    assert float(value.detach()) == pytest.approx(float(exact.detach()), rel=1e-10)
    torch.testing.assert_close(grad, exact_grad, rtol=1e-9, atol=1e-12)
    assert abs(float(expected_estimate(old_logp).detach()) - float(exact.detach())) > 1e-3
