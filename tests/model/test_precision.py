"""train.precision's parts: dtypes, the share of updates bfloat16 keeps, the refusal, and the LM
head's float32 products under bfloat16 compute."""

from pathlib import Path

import pytest
import torch
from torch import nn

from emapg.algo import topk
from emapg.errors import EmapgError
from emapg.model import precision
from emapg.model.lm_head import Head


def test_each_precision_keeps_and_computes_in_its_dtypes():
    assert [precision.param_dtype(p) for p in precision.PRECISIONS] == [
        torch.float32,
        torch.float32,
        torch.bfloat16,
    ]
    assert [precision.compute_dtype(p) for p in precision.PRECISIONS] == [
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
    ]
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for name, want in (("fp32", torch.float32), ("bf16-mixed", torch.bfloat16), ("bf16-true", torch.float32)):
        with precision.autocast(name, "cpu"):  # bf16-true's weights are bfloat16 already: no autocast
            assert (x @ w).dtype == want
            with precision.outside_autocast("cpu"):
                assert (x @ w).dtype == torch.float32


def test_kept_share_counts_the_updates_that_survive_rounding():
    # bfloat16's spacing is 2^-7 above 1.0 and 2^-8 below it; near 2^-10 it is 2^-17. An update
    # survives when it is more than half a spacing (a tie rounds to even: back to 1.0).
    model = nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0**-10]]))
    assert precision.kept_share(model, 2.0**-16) == 0.5  # the small weight moves both ways, 1.0 neither
    assert precision.kept_share(model, 2.0**-8) == 0.75  # 1.0 moves down (a whole step), not up (a tie)
    assert precision.kept_share(model, 2.0**-7) == 1.0
    assert precision.kept_share(model.float(), 1e-6) == 1.0  # float32: every update at any usual lr


def test_bf16_true_at_an_lr_it_cannot_hold_is_refused_with_the_figure():
    model = nn.Linear(64, 64).to(torch.bfloat16)  # weights of about 0.07: a spacing near 2^-11
    with pytest.raises(EmapgError) as refused:
        precision.check_lost_updates("bf16-true", model, 1e-6, allowed=False)
    message = str(refused.value)
    share = precision.kept_share(model, 1e-6)
    assert share < 0.05 and f"keep {share:.1%} of one step's updates" in message
    assert "train.precision=bf16-mixed" in message and "train.allow_lost_updates=true" in message
    assert "\n" not in message
    precision.check_lost_updates("bf16-true", model, 1e-6, allowed=True)  # insisted on
    precision.check_lost_updates("bf16-true", model, 0.05, allowed=False)  # an lr it can hold
    precision.check_lost_updates("bf16-mixed", model.float(), 1e-6, allowed=False)


def test_native_bf16_reads_the_cpus_flags():
    native = precision.native_bf16("cpu")
    if native is not None:  # an x86-64 CPU: its flags say
        flags = Path("/proc/cpuinfo").read_text()
        assert native == (" avx512_bf16" in flags or " amx_bf16" in flags)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def test_head_matmul_rounds_operands_and_keeps_float32_products():
    # Against float64 products of the bfloat16-rounded operands: the error is float32 accumulation's
    # (about 1e-6 here), while a bfloat16 matmul's rounded output is off by 1e-2 (2^-9 of 16).
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g), torch.randn(96, 200, generator=g)
    want = _rounded(a) @ _rounded(b)
    got = topk.head_matmul(a, b, torch.bfloat16)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()
    assert ((a.bfloat16() @ b.bfloat16()).double() - want).abs().max() > 1e-3 * want.abs().max()
    exact = topk.head_matmul(a, b, torch.float32)  # float32 operands: a float32 matmul, as before
    assert torch.equal(exact, a @ b)


def test_head_under_autocast_is_the_bfloat16_operand_head_with_float32_output():
    g = torch.Generator().manual_seed(1)
    # width 96: oneDNN leaves the smallest products (under about 10^4 multiply-adds) in float32
    hidden, weight = torch.randn(3, 5, 96, generator=g), torch.randn(40, 96, generator=g)
    ids = torch.randint(0, 40, (3, 5, 2), generator=g)
    head = Head(weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head.operand(hidden) == torch.bfloat16
        s = head.summarize(hidden, ids, topk=4, entropy=True)
    assert head.operand(hidden) == torch.float32  # outside autocast: the weight's own
    logits = _rounded(hidden) @ _rounded(weight).T  # the reference, in float64
    lse = torch.logsumexp(logits, -1)
    assert s.lse.dtype == s.gathered.dtype == torch.float32
    torch.testing.assert_close(s.lse.double(), lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(
        s.logp().double(), logits.gather(-1, ids) - lse.unsqueeze(-1), rtol=0, atol=1e-4
    )
    assert torch.equal(s.topk_ids, logits.topk(4, -1).indices)
