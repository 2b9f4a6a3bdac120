"""The policy losses (emapg.algo.policy_loss) on hand-made inputs: PPO-clip, the dual clip, CISPO,
GSPO's sequence ratio, and the loss aggregations."""

import pytest
import torch

from emapg.algo.policy_loss import aggregate, aggregation_total, cispo, log_ratio, ppo_clip


def test_ppo_clip_on_hand_made_ratios():
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.3, 1.5]])
    logp = torch.log(ratios).requires_grad_()
    old = torch.zeros_like(logp)
    for a, want_loss, want_clip in [
        # A > 0: ratio above 1 + 0.28 is clipped (loss -1.28, no gradient)
        (1.0, [-0.5, -0.9, -1.0, -1.28, -1.28], [False, False, False, True, True]),
        # A < 0: ratio below 1 - 0.2 is clipped (loss 0.8)
        (-1.0, [0.8, 0.9, 1.0, 1.3, 1.5], [True, False, False, False, False]),
    ]:
        ratio = log_ratio(logp, old, torch.ones_like(logp, dtype=torch.bool), "token")
        loss, clipped = ppo_clip(ratio, torch.tensor([a]), 0.2, 0.28)
        assert torch.allclose(loss, torch.tensor([want_loss]))
        assert clipped.tolist() == [want_clip]
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        # d(-A * ratio)/dlogp = -A * ratio where unclipped, zero where clipped
        want_grad = torch.where(torch.tensor([want_clip]), 0.0, -a * ratios)
        assert torch.allclose(grad, want_grad)


def test_dual_clip_bounds_a_negative_advantages_loss():
    """A = -1 and ratio 5: PPO-clip alone gives 5.0 with gradient 5.0; verl's dual clip (c = 3)
    gives 3.0 with gradient 0. Positive advantages and ratios under c are untouched."""
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_()
    a = torch.tensor([[-1.0, -1.0, 1.0]])
    for c, want_loss, want_grad in [
        (0.0, [5.0, 2.0, -1.2], [5.0, 2.0, 0.0]),
        (3.0, [3.0, 2.0, -1.2], [0.0, 2.0, 0.0]),
    ]:
        loss, clipped = ppo_clip(logp - 0.0, a, 0.2, 0.2, dual_clip=c)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.allclose(loss, torch.tensor([want_loss])) and torch.allclose(
            grad, torch.tensor([want_grad])
        )
        assert clipped.tolist() == [[c > 0, False, True]]


def test_cispo_weight_is_clipped_and_carries_no_gradient():
    logp = torch.log(torch.tensor([[0.5, 1.1, 2.0]])).requires_grad_()
    old = torch.zeros_like(logp)
    a = torch.tensor([2.0])
    ratio = log_ratio(logp, old, torch.ones_like(logp, dtype=torch.bool), "token")
    loss, clipped = cispo(ratio, logp, a, 0.2, 0.28)
    weight = torch.tensor([[0.8, 1.1, 1.28]])  # clip(r, 0.8, 1.28)
    assert torch.allclose(loss, -weight * 2.0 * logp.detach())
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(grad, -weight * 2.0)  # d/dlogp of -sg(w) A log pi: the weight is a constant
    assert clipped.tolist() == [[True, False, True]]


def test_gspo_sequence_ratio_has_gspos_gradient():
    """GSPO (Zheng et al. 2025): s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|); with a sequence-mean
    aggregation the gradient of -min(s_i A_i, clip(s_i) A_i) is -s_i A_i (1/|y_i|) grad log pi(y_i,t)
    per token of an unclipped sequence, and 0 for a clipped one."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    logp = (old + 0.05 * torch.randn(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    a = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    ratio = log_ratio(logp, old, mask, "sequence")
    loss_tok, clipped = ppo_clip(ratio, a, 0.01, 0.01, dual_clip=0.0)
    loss = aggregate(loss_tok, mask, "seq_mean_token_mean", aggregation_total(mask, "seq_mean_token_mean"))
    (grad,) = torch.autograd.grad(loss, logp)
    n = mask.sum(-1)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / n)
    outside = ((s > 1.01) & (a > 0)) | ((s < 0.99) & (a < 0))
    assert outside.any() and not outside.all()  # both cases are checked
    want = torch.where(outside, 0.0, -s * a / n / 3).unsqueeze(-1) * mask
    torch.testing.assert_close(grad, want)
    assert torch.equal(clipped[mask], outside.unsqueeze(-1).expand_as(mask)[mask])


def test_aggregations_by_hand_and_exact_accumulation():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    want = {
        "token_mean": (1 + 2 + 3 + 4) / 4,
        "seq_mean_token_mean": ((1 + 2 + 3) / 3 + 4 / 1) / 2,
        "seq_mean_token_sum": ((1 + 2 + 3) + 4) / 2,
        "seq_mean_token_sum_norm": ((1 + 2 + 3) + 4) / 5,  # verl's: the token sums over L = 5 alone
    }
    for mode, value in want.items():
        total = aggregation_total(mask, mode, length=5)
        assert aggregate(values, mask, mode, total).item() == pytest.approx(value)
        parts = aggregate(values[:1], mask[:1], mode, total) + aggregate(values[1:], mask[1:], mode, total)
        assert parts.item() == pytest.approx(value)  # micro-batches add up to the minibatch's loss


def test_seq_mean_token_sum_norm_is_verls_value():
    """All losses 1, lengths [2, 3], L = 4: verl's agg_loss gives 1.25 (the earlier emapg 0.625)."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    total = aggregation_total(mask, "seq_mean_token_sum_norm", length=4)
    assert aggregate(torch.ones(2, 4), mask, "seq_mean_token_sum_norm", total).item() == 1.25
