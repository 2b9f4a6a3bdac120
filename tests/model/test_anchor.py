"""The EMA anchor (emapg.model.anchor) on a hand-made module: the formula, untouched by the
optimiser, its settings checked, and a bfloat16 anchor's rounding."""

import pytest
import torch
from torch import nn

from emapg.errors import EmapgError
from emapg.model.anchor import Anchor


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
