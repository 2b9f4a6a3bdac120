"""The policy's optimiser (AdamW) and its learning-rate schedule (linear warm-up, then constant)."""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch
from pydantic import Field

from emapg.settings import Float, Section, setting

Beta = Annotated[Float, Field(ge=0, lt=1)]


class OptimSettings(Section):
    """The `optim` section: the AdamW optimiser and its schedule."""

    key: ClassVar[str] = "optim"
    lr: Float = setting(
        2e-4, "AdamW learning rate (0: the weights never change, a baseline that samples and evaluates)", ge=0
    )
    weight_decay: Float = setting(0.0, "AdamW weight decay", ge=0)
    betas: list[Beta] = setting([0.9, 0.99], "AdamW betas", min_length=2, max_length=2)
    warmup_steps: int = setting(5, "linear warm-up, in optimiser steps", ge=0)
    warmup_ratio: Float = setting(
        0.0, "linear warm-up as a share of all optimiser steps; > 0 overrides warmup_steps", ge=0, lt=1
    )
    max_grad_norm: Float = setting(1.0, "gradient clipping by global norm; 0 disables", ge=0)


def make_optimizer(
    params, settings: OptimSettings, lr: float, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` at `lr` (optim.lr, or lora.lr for adapters) and its schedule over
    `total_steps` optimiser steps: a linear warm-up, then the constant `lr`."""
    params = list(params)
    # torch's fused kernel: one pass over each tensor instead of about ten elementwise ops; on 2
    # CPU cores 5x faster at Qwen2.5-0.5B's size (benchmarks/roofline.py; docs/design.md, "Speed").
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW(
        params, lr=lr, betas=tuple(settings.betas), weight_decay=settings.weight_decay, fused=fused
    )
    ratio = settings.warmup_ratio
    warmup = max(round(ratio * total_steps) if ratio else settings.warmup_steps, 1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
