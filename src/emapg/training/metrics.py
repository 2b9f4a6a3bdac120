"""Run logs: one JSON object per line in metrics.jsonl (per step) and samples.jsonl (a few
responses per evaluation), flushed as written; TensorBoard and W&B mirror the metrics. And the
step's phase timer, whose seconds are logged as time/<phase>_s."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from emapg.errors import EmapgError


class JsonLines:
    """An append-only jsonl file of records with a "step"; on resume, records past the resumed
    step (and a torn last line) are dropped first, so a killed run never leaves duplicates."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif path.exists():
            path.unlink()  # a fresh run replaces an old run of the same name
        self.file = path.open("a")

    def _truncate_after(self, step: int) -> None:
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

    def write(self, records: list[dict]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in records))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class MetricsLog:
    """Appends records to `<run>/metrics.jsonl` and sampled responses to `<run>/samples.jsonl`,
    and mirrors the metrics to the optional backends."""

    def __init__(
        self, run_dir: Path, *, resume_step: int | None, tensorboard: bool, wandb: bool, config: dict
    ):
        self.metrics = JsonLines(run_dir / "metrics.jsonl", resume_step)
        self.samples = JsonLines(run_dir / "samples.jsonl", resume_step)
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

    def log(self, record: dict) -> None:
        self.metrics.write([record])
        step = record["step"]
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        self.samples.write([{"step": step, **s} for s in samples])

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def device_memory(device: torch.device) -> dict:
    """memory/peak_gib on a GPU: the most memory tensors held since the last reading (a step's
    peak, read at its end), as torch's allocator counts it; nothing on a CPU."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"memory/peak_gib": peak}


class PhaseTimer:
    """Wall seconds per phase of a step; a phase timed inside another counts only as itself."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._inner = [0.0]  # per open phase: seconds spent in phases nested inside it

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.seconds[phase] = self.seconds.get(phase, 0.0) + took - self._inner.pop()
            self._inner[-1] += took
