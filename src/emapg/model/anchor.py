"""The KL anchor: a frozen reference model or an EMA of the policy, updated in place."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import ClassVar, Literal

import torch
from torch import nn

from emapg import distributed
from emapg.settings import Float, Section, setting, validated

KINDS = ("ema", "frozen", "none")  # anchor.kind: an EMA of the policy, the frozen start, no anchor
PERIOD_UNITS = ("training_steps", "optimizer_steps")  # what anchor.update_period counts


class EMASchedule(Section):
    """An EMA anchor's decay and period: the rule every anchor (the model's, a LoRA adapter's,
    the TRL integration's) is built under."""

    key: ClassVar[str] = "anchor"
    eta: Float = setting(0.9, "EMA decay: anchor <- eta * anchor + (1 - eta) * policy", ge=0, le=1)
    update_period: int = setting(10, "steps between EMA updates, counted in anchor.period_unit", ge=1)

    @classmethod
    def of(cls, eta: float, update_period: int, names: dict[str, str] | None = None) -> EMASchedule:
        """The schedule, or one line naming what is wrong (`names`: the caller's field names)."""
        return validated(cls, {"eta": eta, "update_period": update_period}, cls.key, names)


class AnchorSettings(EMASchedule):
    """The `anchor` section: the KL's anchor, a frozen reference or an EMA of the policy."""

    kind: Literal[KINDS] = setting("ema", "ema, frozen (eta = 1) or none (needs kl.beta = 0)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "the anchor's parameter dtype; auto: the policy's (float32 under bf16-mixed; docs/training.md: "
        "bf16 EMA drift)",
    )
    period_unit: Literal[PERIOD_UNITS] = setting(
        "training_steps", "what update_period counts: rollout batches (the paper's) or optimiser steps"
    )


class Anchor:
    """pi_ref for the KL term.

    eta = 1 is plain GRPO's frozen reference; eta < 1 is the EMA anchor
    theta_ema <- eta * theta_ema + (1 - eta) * theta, applied every `update_period` steps
    (training steps, as in the paper, or optimiser steps: the caller counts). The anchor holds one copy of the weights; updates are in-place lerps
    (torch._foreach_lerp_), so no second copy is allocated per step; sharded by FSDP, each rank
    lerps its own shards. Its parameters never require grad and are never seen by the optimiser.
    In a dtype of its own (bfloat16 beside a float32 policy) each update is computed in the wider
    dtype and rounded once; an update smaller than half the anchor's rounding step is lost there
    (docs/training.md measures the drift this causes).
    """

    def __init__(
        self,
        policy: nn.Module,
        eta: float,
        update_period: int,
        *,
        model: nn.Module | None = None,
        dtype: torch.dtype | None = None,
    ):
        """`model`: a reference copy that already exists (e.g. TRL's ref_model) to use as the anchor
        in place; by default the anchor deep-copies `policy`. `dtype`: the anchor's own parameter
        dtype (e.g. bfloat16 beside a float32 policy); by default the policy's."""
        EMASchedule.of(eta, update_period)
        self.eta, self.update_period = eta, update_period
        self.model = (copy.deepcopy(policy) if model is None else model).eval().requires_grad_(False)
        if dtype is not None:
            self.model.to(dtype)
        self.updates = 0

    @contextmanager
    def active(self):
        """The model to run as the anchor (a LoRA anchor switches adapters here instead)."""
        yield self.model

    @torch.no_grad()
    def step(self, policy: nn.Module, count: int) -> bool:
        """Call after step number `count` (1-based) of the unit the period counts (training or
        optimiser steps); True when it updated."""
        if self.eta == 1.0 or count % self.update_period:
            return False
        # FSDP: free gathered copies, then lerp each rank's local shards (views of the DTensors).
        distributed.reshard(self.model)
        distributed.reshard(policy)
        mine = [distributed.local(p) for p in self.model.parameters()]
        theirs = [distributed.local(p.detach()) for p in policy.parameters()]
        if len(mine) != len(theirs):
            raise RuntimeError("anchor and policy have different parameter lists")
        if all(a.dtype == p.dtype for a, p in zip(mine, theirs, strict=True)):
            torch._foreach_lerp_(mine, theirs, 1.0 - self.eta)
        else:  # an anchor in its own dtype: lerp in the wider one, round once (one tensor at a time)
            for a, p in zip(mine, theirs, strict=True):
                wide = torch.promote_types(a.dtype, p.dtype)
                a.copy_(torch.lerp(a.to(wide), p.to(wide), 1.0 - self.eta))
        self.updates += 1
        return True

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
