"""Metrics: one JSON object per line in metrics.jsonl, flushed per step; TensorBoard and W&B."""

from __future__ import annotations

import json
import os
from pathlib import Path

from emapg.errors import EmapgError


class MetricsLog:
    """Appends records to `<run>/metrics.jsonl` and mirrors them to the optional backends."""

    def __init__(
        self, run_dir: Path, *, resume_step: int | None, tensorboard: bool, wandb: bool, config: dict
    ):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run replaces an old run of the same name
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise EmapgError("train.wandb=true needs wandb: pip install wandb") from None
            self.wandb = wandb_module.init(project="emapg", name=run_dir.name, config=config, resume="allow")

    def _truncate_after(self, step: int) -> None:
        """Drop records past the resumed checkpoint and any torn last line (atomic rewrite)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        step = record["step"]
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
