"""Advantages (emapg.algo.advantages) on hand-made inputs: GRPO, Dr. GRPO, batch std, RLOO,
REINFORCE++, a user's estimator by import path, and DAPO's overlong shaping."""

import pytest
import torch

from emapg.algo.advantages import advantages, overlong_shaping
from emapg.errors import EmapgError


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
