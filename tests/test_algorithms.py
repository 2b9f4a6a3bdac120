"""Advantages, the PPO-clip loss, loss aggregation and the EMA anchor on hand-made inputs."""

import pytest
import torch
from torch import nn

from emapg.advantages import group_advantages
from emapg.anchor import Anchor
from emapg.errors import EmapgError
from emapg.policy_loss import aggregate, aggregation_total, ppo_clip


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, "grpo", eps=0.0 + 1e-6)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # Bessel-corrected, 0.57735
    want = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    assert torch.allclose(adv[:4], want)
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: zero, not NaN


def test_drgrpo_and_batch_std_advantages_by_hand():
    rewards = torch.tensor([3.0, 1.0, 0.0, 0.0])
    assert torch.allclose(group_advantages(rewards, 2, "drgrpo"), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    batch_std = rewards.std()
    got = group_advantages(rewards, 2, "batch_std", eps=0.0)
    assert torch.allclose(got, torch.tensor([1.0, -1.0, 0.0, 0.0]) / batch_std)
    assert torch.equal(group_advantages(torch.ones(6), 3, "grpo"), torch.zeros(6))


def test_advantage_errors():
    with pytest.raises(EmapgError, match="advantage mode must be one of"):
        group_advantages(torch.ones(4), 2, "ppo")
    with pytest.raises(EmapgError, match="do not split into groups of 3"):
        group_advantages(torch.ones(4), 3)
    with pytest.raises(EmapgError, match="needs group_size >= 2"):
        group_advantages(torch.ones(4), 1, "grpo")


def test_ppo_clip_on_hand_made_ratios():
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.3, 1.5]])
    logp = torch.log(ratios).requires_grad_()
    old = torch.zeros_like(logp)
    for adv, want_loss, want_clip in [
        # A > 0: ratio above 1 + 0.28 is clipped (loss -1.28, no gradient)
        (1.0, [-0.5, -0.9, -1.0, -1.28, -1.28], [False, False, False, True, True]),
        # A < 0: ratio below 1 - 0.2 is clipped (loss 0.8)
        (-1.0, [0.8, 0.9, 1.0, 1.3, 1.5], [True, False, False, False, False]),
    ]:
        loss, clipped = ppo_clip(logp, old, torch.tensor([adv]), 0.2, 0.28)
        assert torch.allclose(loss, torch.tensor([want_loss]))
        assert clipped.tolist() == [want_clip]
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        # d(-A * ratio)/dlogp = -A * ratio where unclipped, zero where clipped
        want_grad = torch.where(torch.tensor([want_clip]), 0.0, -adv * ratios)
        assert torch.allclose(grad, want_grad)


def test_aggregations_by_hand_and_exact_accumulation():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    want = {
        "token_mean": (1 + 2 + 3 + 4) / 4,
        "seq_mean_token_mean": ((1 + 2 + 3) / 3 + 4 / 1) / 2,
        "seq_mean_token_sum": ((1 + 2 + 3) + 4) / 2,
        "seq_mean_token_sum_norm": ((1 + 2 + 3) / 5 + 4 / 5) / 2,  # length 5: the response limit
    }
    for mode, value in want.items():
        total = aggregation_total(mask, mode, length=5)
        assert aggregate(values, mask, mode, total).item() == pytest.approx(value)
        parts = aggregate(values[:1], mask[:1], mode, total) + aggregate(values[1:], mask[1:], mode, total)
        assert parts.item() == pytest.approx(value)  # micro-batches add up to the minibatch's loss


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 1, bias=False)


def _params(m):
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("eta,period", [(0.9, 1), (0.9, 3), (0.5, 2), (1.0, 1), (0.0, 2)])
def test_ema_anchor_follows_the_formula(eta, period):
    torch.manual_seed(0)
    policy = Tiny()
    anchor = Anchor(policy, eta, period)
    storage = [p.data_ptr() for p in anchor.model.parameters()]
    expected = _params(policy)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    for step in range(1, 8):
        opt.zero_grad()
        policy.b(policy.a(torch.randn(4, 3))).pow(2).sum().backward()
        opt.step()
        updated = anchor.step(policy, step)
        if step % period == 0 and eta < 1:
            expected = [eta * e + (1 - eta) * p for e, p in zip(expected, _params(policy), strict=True)]
        assert updated == (step % period == 0 and eta < 1)
        for got, want in zip(anchor.model.parameters(), expected, strict=True):
            assert torch.allclose(got, want, atol=1e-7)
    # In place: same storage, never a trainable parameter.
    assert [p.data_ptr() for p in anchor.model.parameters()] == storage
    assert not any(p.requires_grad for p in anchor.model.parameters())
    assert anchor.updates == (0 if eta == 1 else 7 // period)


def test_anchor_is_never_touched_by_the_optimizer():
    torch.manual_seed(0)
    policy = Tiny()
    anchor = Anchor(policy, 1.0, 1)
    before = _params(anchor.model)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (
            policy.b(policy.a(torch.randn(4, 3))).sum()
            + anchor.model.b(anchor.model.a(torch.randn(4, 3))).sum()
        ).backward()
        opt.step()
    for got, want in zip(anchor.model.parameters(), before, strict=True):
        assert torch.equal(got, want)
        assert got.grad is None


def test_anchor_rejects_bad_settings():
    with pytest.raises(EmapgError, match=r"anchor.eta: input should be less than or equal to 1"):
        Anchor(Tiny(), 1.5, 1)
    with pytest.raises(EmapgError, match="anchor.update_period: input should be greater than or equal to 1"):
        Anchor(Tiny(), 0.9, 0)


@pytest.mark.parametrize("eta", [0.9, 0.0])
def test_a_bfloat16_anchor_rounds_each_float32_lerp_once(eta):
    """A bfloat16 anchor beside a float32 policy: every update is the float32 lerp of the stored
    bfloat16 weights toward the policy, rounded to bfloat16 once (written out here)."""
    torch.manual_seed(0)
    policy = Tiny()
    anchor = Anchor(policy, eta, 1, dtype=torch.bfloat16)
    expected = [p.to(torch.bfloat16) for p in _params(policy)]
    assert [p.dtype for p in anchor.model.parameters()] == [torch.bfloat16] * len(expected)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    for step in range(1, 6):
        opt.zero_grad()
        policy.b(policy.a(torch.randn(4, 3))).pow(2).sum().backward()
        opt.step()
        anchor.step(policy, step)
        expected = [
            torch.lerp(e.float(), p, 1 - eta).to(torch.bfloat16)
            for e, p in zip(expected, _params(policy), strict=True)
        ]
        for got, want in zip(anchor.model.parameters(), expected, strict=True):
            assert torch.equal(got, want)
    if eta == 0.0:  # a copy of the policy, rounded once
        for got, p in zip(anchor.model.parameters(), policy.parameters(), strict=True):
            assert torch.equal(got, p.detach().to(torch.bfloat16))
