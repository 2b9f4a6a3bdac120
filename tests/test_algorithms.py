"""Advantages, the PPO-clip loss, loss aggregation and the EMA anchor on hand-made inputs."""

import pytest
import torch
from torch import nn

from emapg.algo.advantages import advantages, overlong_shaping
from emapg.algo.policy_loss import aggregate, aggregation_total, cispo, log_ratio, ppo_clip
from emapg.errors import EmapgError
from emapg.model.anchor import Anchor


def adv(name, rewards, group_size, lengths=None):
    lengths = torch.ones_like(rewards) if lengths is None else lengths
    return advantages(name, rewards, group_size, lengths)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    got = adv("grpo", rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # Bessel-corrected, 0.57735
    want = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    assert torch.allclose(got[:4], want)
    assert torch.equal(got[4:], torch.zeros(4))  # all equal: zero, not NaN


def test_drgrpo_and_batch_std_advantages_by_hand():
    rewards = torch.tensor([3.0, 1.0, 0.0, 0.0])
    assert torch.allclose(adv("drgrpo", rewards, 2), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    batch_std = rewards.std()
    assert torch.allclose(
        adv("batch_std", rewards, 2), torch.tensor([1.0, -1.0, 0.0, 0.0]) / (batch_std + 1e-6)
    )
    assert torch.equal(adv("grpo", torch.ones(6), 3), torch.zeros(6))


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "batch_std", "rloo"])
@pytest.mark.parametrize("value", [0.8025, 0.7, 1 / 3])
def test_a_group_of_equal_partial_credit_rewards_gets_exactly_zero(name, value):
    """verl's own functions beside ours: eight rewards of 0.8025 gave +0.106 to every sample (the
    float32 rounding of r - mean, divided by a std of ~1e-8)."""
    rewards = torch.cat([torch.full((8,), value), torch.tensor([0.0, 1.0] * 4)])
    got = adv(name, rewards, 8)
    assert torch.equal(got[:8], torch.zeros(8)) and bool((got[8:] != 0).all())


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, 1.0, 2.0, 2.0])
    want = [r - (sum(g) - r) / (len(g) - 1) for g in (rewards[:4].tolist(), rewards[4:].tolist()) for r in g]
    assert torch.allclose(adv("rloo", rewards, 4), torch.tensor(want))


def test_reinforce_pp_whitens_over_every_token_of_the_batch():
    """REINFORCE++ (verl's reinforce_plus_plus, gamma 1, outcome reward): each token's return is its
    sequence's reward; masked whitening over all tokens weighs a sequence by its length."""
    rewards, lengths = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0]), torch.tensor([2, 5, 1, 3, 4, 1])
    tokens = torch.cat([torch.full((int(n),), float(r)) for r, n in zip(rewards, lengths, strict=True)])
    want = (rewards - tokens.mean()) / (tokens.var() + 1e-8).sqrt()  # var: Bessel over tokens
    assert torch.allclose(adv("reinforce_pp", rewards, 3, lengths), want)
    assert torch.allclose(adv("reinforce_pp", rewards, 1, lengths), want)  # no groups needed


def test_a_users_estimator_by_import_path(tmp_path):
    module = tmp_path / "my_adv.py"
    module.write_text("def doubled(rewards, group_size, lengths):\n    return 2 * rewards\n")
    assert torch.equal(adv(f"{module}:doubled", torch.tensor([1.0, 0.5]), 2), torch.tensor([2.0, 1.0]))
    bad = tmp_path / "bad_adv.py"
    bad.write_text("def short(rewards, group_size, lengths):\n    return rewards[:1]\n")
    with pytest.raises(EmapgError, match="expected 2 finite advantages"):
        adv(f"{bad}:short", torch.tensor([1.0, 0.5]), 2)


def test_advantage_errors():
    with pytest.raises(EmapgError, match="algo.advantage: unknown 'ppo'"):
        adv("ppo", torch.ones(4), 2)
    with pytest.raises(EmapgError, match="do not split into groups of 3"):
        adv("grpo", torch.ones(4), 3)
    with pytest.raises(EmapgError, match="needs rollout.group_size >= 2"):
        adv("grpo", torch.ones(4), 1)


def test_overlong_shaping_is_daps_linear_penalty():
    lengths = torch.tensor([0, 6, 7, 8, 9, 10])  # limit 10, buffer 4: from 6 tokens on
    assert torch.allclose(
        overlong_shaping(lengths, 10, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    )
    assert torch.equal(overlong_shaping(lengths, 10, 0), torch.zeros(6))


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
