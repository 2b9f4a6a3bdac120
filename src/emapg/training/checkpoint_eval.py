"""`emapg eval --run`: a run's checkpoint evaluated as the run evaluated it.

The policy saved at a step, or with `anchor=True` the anchor, sampled on the run's held-out
examples with its own eval section and seed (`trainer.eval_params`) through the engine the run
used: the figure is the run's eval/accuracy (eval/anchor/accuracy) at that step, recomputed from
the saved weights alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model

from emapg.errors import EmapgError
from emapg.eval.evaluate import held_out
from emapg.model.models import load_model_and_tokenizer
from emapg.rollout import eos_ids, make_engine
from emapg.tasks import make_task
from emapg.tasks.rewards import RewardScorer
from emapg.training import checkpoint, run_folder
from emapg.training.config import build
from emapg.training.evaluation import eval_params
from emapg.training.run import device_of


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The run's checkpoint at `step` (None: its last), or one line naming what is there."""
    saved = checkpoint.list_checkpoints(run_dir / "checkpoints")
    if not saved:
        raise EmapgError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    if step is None:
        return saved[-1]
    wanted = run_dir / "checkpoints" / f"step_{step}"
    if wanted not in saved:
        raise EmapgError(f"{run_dir}: no checkpoint step_{step}; saved: {', '.join(p.name for p in saved)}")
    return wanted


def anchor_file(path: Path) -> Path:
    """The anchor's weights in checkpoint `path`, or why a checkpoint has none to load here."""
    if (path / "adapters").is_dir():
        raise EmapgError(
            f"{path}: a LoRA run's anchor is an adapter on the base model, which the checkpoint does not "
            "hold; --anchor reads full-model anchors (anchor.safetensors)"
        )
    if (path / "sharded").is_dir():
        raise EmapgError(
            f"{path}: written by several processes, its anchor is in sharded/ only; --anchor reads "
            "the anchor.safetensors of a one-process run"
        )
    weights = path / "anchor.safetensors"
    if not weights.is_file():
        raise EmapgError(f"{path}: no anchor.safetensors (the run had anchor.kind=none)")
    return weights


def evaluate_checkpoint(run_dir: str | Path, step: int | None = None, *, anchor: bool = False) -> dict:
    """Held-out accuracy of the policy (or anchor) saved at `step` (None: the last checkpoint)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise EmapgError(f"{run_dir}: no config.yaml (is this a run directory?)")
    cfg = build(run_folder.saved_config(run_dir))
    path = find_checkpoint(run_dir, step)
    weights = anchor_file(path) if anchor else None
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # as the run had: a reduction's order is the threads'
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    model, tokenizer = load_model_and_tokenizer(path / "policy", dtype=getattr(torch, cfg.param_dtype))
    if weights is not None:
        load_model(model, str(weights))
    model.to(device_of(cfg)).eval()
    engine = make_engine(cfg.rollout, model, tokenizer, str(path / "policy"), cfg.engine_needs)
    try:
        engine.sync_weights(
            model, ("checkpoint", str(weights))
        )  # an engine that loaded policy/ takes the anchor
        with RewardScorer(
            task, timeout_s=cfg.task.reward_timeout_s, isolation=cfg.task.reward_isolation
        ) as scorer:
            got = held_out(
                engine, tokenizer, task, task.eval_examples(), scorer, eval_params(cfg),
                samples=cfg.eval.samples_per_problem, chat_template=cfg.model.chat_template,
                eos=eos_ids(model, tokenizer),
            )  # fmt: skip
    finally:
        engine.close()
    return {
        "run": str(run_dir),
        "checkpoint": str(path),
        "weights": "anchor" if anchor else "policy",
        "accuracy": got.accuracy,
        "problems": len(task.eval_examples()),
        "samples_per_problem": cfg.eval.samples_per_problem,
    }


def write_results(results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return out / "results.json"
