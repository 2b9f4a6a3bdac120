"""LoRA through peft (`lora.r > 0`): adapters, the adapter anchor, merged and adapter checkpoints.

One peft model holds everything. The policy is the frozen base plus the trainable adapter
"policy"; the optimiser sees only that adapter. The EMA anchor is the same model with a second,
frozen adapter "anchor" active, whose tensors are lerped toward the policy adapter's: the EMA of
the adapter factors (A and B), not of the weights, and no second copy of the base. The frozen
anchor (eta = 1) is the same model with its adapters disabled: the base, no copy at all.

Checkpoint layout with LoRA (one process): `policy/` is the merged model (base + scale * B @ A)
in HF format, so `emapg eval --model .../policy` and any HF loader use it unchanged;
`adapters/policy/` and `adapters/anchor/` are the adapters in peft's format (safetensors and
adapter_config.json; `PeftModel.from_pretrained(base, ".../adapters/policy")` loads one), and
resuming loads them into the live model, bit for bit.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, ClassVar

import torch
from pydantic import StringConstraints
from safetensors.torch import load_file
from torch import nn

from emapg.errors import EmapgError
from emapg.model.anchor import EMASchedule
from emapg.settings import Float, Section, setting

POLICY, ANCHOR = "policy", "anchor"  # the two adapters' names
INSTALL = "pip install 'emapg[lora]'"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSettings(Section):
    """The `lora` section: adapters (through peft) instead of every weight; the anchor is an adapter too."""

    key: ClassVar[str] = "lora"
    r: int = setting(0, "LoRA rank; 0 trains every weight. > 0 needs peft (pip install 'emapg[lora]')", ge=0)
    alpha: Float = setting(
        32.0, "LoRA scale numerator: the adapter adds (alpha / r) * B @ A to each weight", gt=0
    )
    dropout: Float = setting(
        0.0, "dropout on the adapter's input while training (0: log-probs match sampling)", ge=0, lt=1
    )
    target_modules: list[Annotated[str, StringConstraints(min_length=1)]] = setting(
        TARGETS,
        "modules that get adapters (Llama/Qwen names); [all-linear]: every linear but the head",
        min_length=1,
    )
    lr: Float = setting(2e-3, "AdamW learning rate when lora.r > 0 (in place of optim.lr)", gt=0)


def is_peft(model) -> bool:
    """Whether `model` is a peft model (checked without importing peft)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def unwrap(model: nn.Module) -> nn.Module:
    """A peft model's transformers model, whose layers carry the LoRA modules (the active adapter
    applies when it runs); any other model as it is."""
    return model.get_base_model() if is_peft(model) else model


def require_peft(r: int):
    """The peft module; a missing peft stops with one line naming the install command."""
    try:
        import peft
    except ImportError:
        raise EmapgError(f"lora.r={r} needs peft: {INSTALL}") from None
    return peft


def wrap(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """`model` with a trainable LoRA adapter "policy" and its base frozen."""
    peft = require_peft(settings.r)
    targets = settings.target_modules
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return peft.get_peft_model(model, config, adapter_name=POLICY)
    except ValueError as e:  # e.g. no module matches lora.target_modules
        raise EmapgError(f"lora.target_modules={targets}: {str(e).splitlines()[0]}") from None


def adapter_params(model: nn.Module, adapter: str) -> dict[str, nn.Parameter]:
    """The parameters of one adapter, by name."""
    return {n: p for n, p in model.named_parameters() if f".{adapter}." in n and ".lora_" in n}


def adapter_bytes(model: nn.Module, adapter: str) -> int:
    return sum(p.numel() * p.element_size() for p in adapter_params(model, adapter).values())


class AdapterAnchor:
    """pi_ref of a LoRA policy, with `Anchor`'s interface (`active`, `step`, `updates`, state).

    eta < 1: a frozen adapter "anchor" on the same model, started as a copy of the policy
    adapter and lerped toward it every `update_period` optimiser steps
    (anchor <- eta * anchor + (1 - eta) * policy, on each adapter tensor). Its extra memory is
    the adapter's bytes (`extra_bytes`). eta = 1: the base model (adapters disabled), no extra memory.
    """

    def __init__(self, model: nn.Module, eta: float, update_period: int):
        EMASchedule.of(eta, update_period)
        self.peft, self.eta, self.update_period, self.updates = model, eta, update_period, 0
        self.mine: list[torch.Tensor] = []
        self.theirs: list[torch.Tensor] = []
        if eta == 1.0:
            return
        config = copy.deepcopy(model.peft_config[POLICY])
        config.lora_dropout = 0.0  # the anchor pass runs in eval mode anyway
        model.add_adapter(ANCHOR, config)  # not active: peft leaves it frozen
        anchor = adapter_params(model, ANCHOR)
        with torch.no_grad():
            for name, p in adapter_params(model, POLICY).items():
                a = anchor[name.replace(f".{POLICY}.", f".{ANCHOR}.")]
                a.requires_grad_(False).copy_(p)
                self.mine.append(a)
                self.theirs.append(p)

    @contextmanager
    def active(self):
        """The model as the anchor, for a no-grad pass; the policy adapter is active again after."""
        model, training = self.peft, self.peft.training
        model.eval()
        try:
            if self.eta == 1.0:
                with model.disable_adapter():
                    yield unwrap(model)
            else:
                model.set_adapter(ANCHOR)  # under no_grad: no graph, whatever requires_grad says
                try:
                    yield unwrap(model)
                finally:
                    model.set_adapter(POLICY)  # trainable again; the anchor adapter stays frozen
        finally:
            model.train(training)

    @torch.no_grad()
    def step(self, policy: nn.Module, optimizer_step: int) -> bool:
        """Call after optimiser step number `optimizer_step` (1-based); True when it updated."""
        if self.eta == 1.0 or optimizer_step % self.update_period:
            return False
        torch._foreach_lerp_(self.mine, [p.detach() for p in self.theirs], 1.0 - self.eta)
        self.updates += 1
        return True

    def extra_bytes(self) -> int:
        """Memory the anchor adds to the policy: its adapter's tensors (0 for the frozen base)."""
        return sum(t.numel() * t.element_size() for t in self.mine)

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights with its adapter merged (W + scale * B @ A), under the base model's
    names, leaving the live model untouched; only the adapted weights are new tensors."""
    from peft.tuners.lora import LoraLayer

    inner = unwrap(model)
    out = {k.replace(".base_layer.", "."): v for k, v in inner.state_dict().items() if ".lora_" not in k}
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and POLICY in module.lora_A:
            weight = module.get_base_layer().weight
            out[f"{name}.weight"] = weight + module.get_delta_weight(POLICY).to(weight.dtype)
    return out


def save(model: nn.Module, directory: Path, tied: set[str]) -> None:
    """policy/ (merged, HF format) and adapters/<name>/ (peft format) under `directory`;
    `tied`: parameter names save_pretrained leaves out."""
    merged = {k: v for k, v in merged_state_dict(model).items() if k not in tied}
    unwrap(model).save_pretrained(directory / "policy", state_dict=merged, safe_serialization=True)
    model.save_pretrained(directory / "adapters", safe_serialization=True)


def load(model: nn.Module, directory: Path) -> None:
    """Every adapter of `model` from `directory`/adapters/<name>/, exactly as saved."""
    from peft import set_peft_model_state_dict

    for name in model.peft_config:
        file = directory / "adapters" / name / "adapter_model.safetensors"
        if not file.is_file():
            raise RuntimeError(f"no adapter {name!r} at {file} (was the run started with lora.r > 0?)")
        result = set_peft_model_state_dict(model, load_file(str(file)), adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k and ".lora_" in k]
        if result.unexpected_keys or missing:
            raise RuntimeError(
                f"adapter {name!r} does not match the model ({(result.unexpected_keys + missing)[0]})"
            )
