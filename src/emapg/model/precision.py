"""Training precision (`train.precision`), in Lightning's words.

- `fp32`: parameters, gradients, AdamW's moments and every computation in float32.
- `bf16-mixed`: parameters, gradients and AdamW's moments in float32 (the master weights); the
  forward and backward passes compute in bfloat16, under `torch.autocast` in one process and
  through FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` under
  torchrun. What needs float32 stays float32: the LM head's products are accumulated and
  returned in float32 (`emapg.algo.topk.head_matmul`), and the log-softmax, log-probs, KL
  estimators, entropy, PPO ratios, advantages and loss reduction work on float32 tensors.
  This is how verl's FSDP actor, TRL (accelerate's `bf16=True`), Lightning and torchtune train.
- `bf16-true`: everything in bfloat16. An AdamW step is about lr in size, and bfloat16's spacing
  near a weight w is about |w| / 128: an update of 1e-6 to a weight of 0.02 is rounded away. So a
  run asks `kept_share` first and refuses an lr whose updates bfloat16 cannot hold
  (`check_lost_updates`).
"""

from __future__ import annotations

import platform
from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch
from torch import nn

from emapg.errors import EmapgError

Precision = Literal["fp32", "bf16-mixed", "bf16-true"]
PRECISIONS: tuple[str, ...] = Precision.__args__

# Below this share of one step's updates kept, bf16-true is refused (the user may insist): most
# of every step would be rounded away. SmolLM2-135M keeps 0.4% at lr 1e-6, 1% at 5e-6, 16% at
# 1e-4 and 56% at 3e-4 (tests/model/test_precision.py; docs/training.md, "Precision").
MIN_KEPT_SHARE = 0.5


def param_dtype(precision: str) -> torch.dtype:
    """The dtype parameters, gradients and optimiser state are kept in."""
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the forward and backward passes compute their matrix products in."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager:
    """bfloat16 autocast for `bf16-mixed` (float32 weights, bfloat16 products); nothing otherwise.
    Run forward passes under it, never the backward (it follows the forward's dtypes)."""
    if precision != "bf16-mixed":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def outside_autocast(device: torch.device | str) -> AbstractContextManager:
    """Autocast off inside an autocast region, whose cache of bfloat16 weights outlives it: the
    backward of each micro-batch, so that all of one optimiser step's forwards share one cast."""
    return torch.autocast(torch.device(device).type, enabled=False)


def native_bf16(device: torch.device | str) -> bool | None:
    """Whether `device` computes bfloat16 natively: a CUDA GPU that supports it, or an x86 CPU with
    AVX512-BF16 or AMX (elsewhere bfloat16 is emulated, slower than float32); None where it cannot
    be told (another architecture)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@torch.no_grad()
def kept_share(model: nn.Module, lr: float) -> float:
    """The share of one optimiser step's updates that the parameters' own dtype keeps: over every
    trainable element w, how often w + lr and w - lr (an AdamW step is about lr in size: exactly
    lr at its first step) round to something other than w. 1.0 for float32 at any usual lr."""
    kept, total = 0, 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        w = p.detach().reshape(-1)
        for part in w.split(1 << 24):  # a float32 copy of 16M elements at a time
            wide = part.float()
            kept += int(
                ((wide + lr).to(part.dtype) != part).sum() + ((wide - lr).to(part.dtype) != part).sum()
            )
        total += 2 * w.numel()
    return kept / max(total, 1)


def check_lost_updates(precision: str, model: nn.Module, lr: float, allowed: bool) -> None:
    """Refuse `bf16-true` at an lr whose updates its bfloat16 weights cannot hold, with the share
    measured on the model's own weights; `allowed` (train.allow_lost_updates) runs it anyway."""
    if precision != "bf16-true" or allowed or lr == 0:
        return
    share = kept_share(model, lr)
    if share < MIN_KEPT_SHARE:
        raise EmapgError(
            f"train.precision=bf16-true at optim.lr={lr:g}: bfloat16 weights would keep {share:.1%} of "
            "one step's updates (the rest rounds away, measured on this model's weights); use "
            "train.precision=bf16-mixed (float32 master weights, bfloat16 compute), or "
            "train.allow_lost_updates=true to run it anyway"
        )
