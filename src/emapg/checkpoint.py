"""Crash-safe checkpoints: written to a temporary directory, flushed, then renamed into place.

runs/<name>/checkpoints/step_N/
  policy/            save_pretrained (safetensors) + tokenizer
  anchor.safetensors the anchor's weights (absent without an anchor)
  optimizer.pt       optimiser and scheduler state (tensors and numbers only: weights_only load)
  rng.safetensors    torch CPU (and CUDA) generator states
  state.json         step, optimiser steps, anchor updates, data position, Python RNG
A directory named step_N is complete by construction; partial ones are `.tmp-*` and ignored.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from emapg.errors import EmapgError

STEP_DIR = re.compile(r"^step_(\d+)$")


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(
    directory: Path, step: int, *, policy, tokenizer, anchor, optimizer, scheduler, state: dict, keep: int
) -> Path:
    """Write checkpoint `step_<step>` under `directory` atomically; keep the newest `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".tmp-step_{step}-"))
    try:
        policy.save_pretrained(tmp / "policy", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "policy")
        if anchor is not None:
            save_model(anchor.model, str(tmp / "anchor.safetensors"))
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt"
        )
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(tmp / "rng.safetensors"))
        full_state = {**state, "step": step, "python_rng": random.getstate()}
        (tmp / "state.json").write_text(json.dumps(full_state))
        _fsync_tree(tmp)
        final = directory / f"step_{step}"
        if final.exists():  # a re-run of the same step after a resume: replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_tree(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    return final


def remove_partial(directory: Path) -> None:
    """Delete `.tmp-*` directories a killed save left behind (never a complete step_N)."""
    if directory.is_dir():
        for path in directory.glob(".tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def load(path: Path, **objects) -> dict:
    """Restore everything `save` wrote into the live objects; returns state.json's contents.
    A damaged checkpoint stops with one line (EmapgError), never a traceback or an unpickling."""
    try:
        return _load(path, **objects)
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError, SafetensorError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EmapgError(f"checkpoint {path} cannot be loaded: {detail}") from None


def _load(path: Path, *, policy, anchor, optimizer, scheduler) -> dict:
    missing, unexpected = load_model(policy, str(path / "policy" / "model.safetensors"), strict=False)
    if unexpected or [m for m in missing if m not in _tied_names(policy)]:
        raise RuntimeError(f"checkpoint {path}: policy weights do not match the model")
    if anchor is not None:
        load_model(anchor.model, str(path / "anchor.safetensors"))
    states = torch.load(path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and "cuda0" in rng:
        torch.cuda.set_rng_state_all([rng[f"cuda{i}"] for i in range(torch.cuda.device_count())])
    state = json.loads((path / "state.json").read_text())
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    return state


def _tied_names(model) -> set[str]:
    """Parameter names that save_pretrained leaves out because they share storage."""
    seen, tied = {}, set()
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            tied.add(name)
        seen.setdefault(key, name)
    return tied
