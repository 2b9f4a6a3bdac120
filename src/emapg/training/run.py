"""What a training run runs on (`Run`, built by setup.py) and what of it a checkpoint saves:
the loop's counters, the prompt sampler's position, the anchor."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import nn

from emapg import distributed
from emapg.errors import EmapgError
from emapg.eval.math import ValidationSets
from emapg.model.anchor import Anchor
from emapg.model.lora import AdapterAnchor
from emapg.rollout import RolloutEngine
from emapg.tasks.base import Example, Task
from emapg.tasks.rewards import RewardScorer
from emapg.training import checkpoint
from emapg.training.config import Config
from emapg.training.metrics import MetricsLog


@dataclass
class TrainerState:
    """The loop's counters and figures, saved with every checkpoint (state.json "trainer")."""

    optimizer_steps: int = 0
    skipped_steps: int = 0  # optimiser steps skipped for a non-finite loss or gradient
    bad_in_row: int = 0  # the current run of skipped steps
    accuracy_before: float | None = None
    accuracy: float | None = None

    @classmethod
    def from_dict(cls, saved: dict) -> TrainerState:
        """From a checkpoint's dict; older checkpoints may lack the newer counters."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


class PromptSampler:
    """Shuffled passes over the training examples; its position is part of a checkpoint."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise EmapgError("the task has no training examples")
        self.examples, self.seed = examples, seed
        self.epoch, self.position = 0, 0

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            order = torch.randperm(
                len(self.examples), generator=torch.Generator().manual_seed(self.seed + self.epoch)
            )
            take = order[self.position : self.position + n - len(out)].tolist()
            out += [self.examples[i] for i in take]
            self.position += len(take)
            if self.position == len(self.examples):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


@dataclass
class Requested:
    """An async batch asked of a worker: for which step, its rows, and the weights it is drawn with."""

    step: int
    examples: list[Example]
    drawn_at: int  # training steps done when it was asked for: the version of its weights
    version: object  # the engine's name for those weights (as pushed; the worker reports it back)
    sampler_state: dict  # the prompt sampler before this batch's prompts
    ticket: tuple[int, int]  # (worker, request), for RolloutWorkers.result


CHECKPOINT_FORMAT = 2  # 2: trainer state as TrainerState; 1 (no "format" key): the same fields


@dataclass
class Run:
    """Everything the loop runs on, built once by `setup`."""

    cfg: Config
    task: Task
    train_examples: list[Example]
    eval_examples: list[Example]
    model: nn.Module
    tokenizer: object
    eos: list[int]
    vocab: int
    engine: RolloutEngine
    scorer: RewardScorer
    anchor: Anchor | AdapterAnchor | None
    initial: Anchor | AdapterAnchor | None  # the policy's initial weights, for eval.kl's drift
    validation: ValidationSets | None  # eval.datasets
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    run_dir: Path
    log: MetricsLog | None  # rank 0 alone writes the run's files
    start: int = 0  # the step a resumed run continues after
    state: TrainerState = field(default_factory=TrainerState)
    requested: deque[Requested] = field(default_factory=deque)  # async: batches asked for, oldest first
    next_request: int = 1  # async: the step whose batch is asked for next

    def save(self, step: int) -> None:
        extra = {
            "format": CHECKPOINT_FORMAT,
            "trainer": asdict(self.state),
            # async: the prompts of batches asked for but not trained on are taken again on resume
            "sampler": self.requested[0].sampler_state if self.requested else self.sampler.state(),
            "anchor": self.anchor.state_dict() if self.anchor else None,
        }
        checkpoint.save(
            self.run_dir / "checkpoints",
            step,
            policy=self.model,
            tokenizer=self.tokenizer,
            anchor=self.anchor,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=extra,
            keep=self.cfg.train.keep_checkpoints,
        )

    def resume(self, path: Path) -> None:
        saved = checkpoint.load(
            path, policy=self.model, anchor=self.anchor, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if saved.get("format", 1) not in (1, CHECKPOINT_FORMAT):
            raise EmapgError(
                f"checkpoint {path} has format {saved['format']}; this emapg resumes formats 1 to {CHECKPOINT_FORMAT}"
            )
        self.start, self.state = saved["step"], TrainerState.from_dict(saved["trainer"])
        self.sampler.load(saved["sampler"])
        if self.anchor is not None:
            self.anchor.load_state_dict(saved["anchor"])

    def close(self) -> None:
        if self.log:
            self.log.close()
        self.scorer.close()
        if self.validation is not None:
            self.validation.close()
        self.engine.close()


def make_anchor(cfg: Config, model: nn.Module) -> Anchor | AdapterAnchor | None:
    """No anchor model at all without a KL; an EMA with eta = 1 is the frozen reference. With
    LoRA the anchor is an adapter of the policy's own model (or its base): no copy of the base."""
    if cfg.anchor.kind == "none":
        return None
    eta = 1.0 if cfg.anchor.kind == "frozen" else cfg.anchor.eta
    if cfg.lora.r:
        return AdapterAnchor(model, eta, cfg.anchor.update_period)
    anchor = Anchor(model, eta, cfg.anchor.update_period, dtype=getattr(torch, cfg.anchor_dtype))
    distributed.shard(anchor.model, cfg.compute_dtype)
    return anchor


def initial_weights(cfg: Config, model: nn.Module, anchor) -> Anchor | AdapterAnchor:
    """eval.kl's reference for drift: the policy as it starts. A frozen anchor is that already;
    with LoRA it is the base (the adapters start at zero); else a frozen copy, taken before a
    resumed run loads its checkpoint."""
    if cfg.anchor.kind == "frozen":
        return anchor
    if cfg.lora.r:
        return AdapterAnchor(model, 1.0, 1)
    initial = Anchor(model, 1.0, 1)
    distributed.shard(initial.model, cfg.compute_dtype)
    return initial


def device_of(cfg: Config) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise EmapgError("train.device=cuda but no CUDA device is available")
    return torch.device(cfg.train.device)
