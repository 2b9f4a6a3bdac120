"""`emapg export`: a run's checkpoint, its policy or its EMA anchor, as a standard Hugging Face folder.

A checkpoint's `policy/` is already such a folder; its `anchor.safetensors` is not (bare weights,
the tied embedding stored once, no config, no tokenizer), so `from_pretrained` cannot load it.
Export loads the weights into the run's own model class (policy/'s config), where tying
restores the shared tensors, and writes config, safetensors, generation config and tokenizer
(chat template included) with `save_pretrained`: `AutoModelForCausalLM.from_pretrained(out)` and
vLLM load the folder as it is. It is written under a temporary name and renamed into place.

The weights are written in the dtype asked for; by default the model's own, the dtype its
`model.path` holds (bfloat16 for most released checkpoints, float32 for the built-in model and a
GGUF's conversion), whatever the run trained in: a bf16-mixed run's checkpoint holds float32 master
weights, which a user of the released model does not expect to double in size.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model
from transformers import AutoConfig

from emapg.errors import EmapgError
from emapg.model import gguf
from emapg.model.models import load_model_and_tokenizer
from emapg.training import run_folder
from emapg.training.checkpoint_eval import anchor_file, find_checkpoint


def export(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    *,
    anchor: bool = False,
    dtype: str = "auto",
) -> tuple[Path, torch.dtype]:
    """Write the policy (or `anchor`) saved at `step` (None: the last checkpoint) of `run_dir` to
    the new folder `out` in `dtype` (auto: the model's own); returns the checkpoint exported and
    the dtype written."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise EmapgError(f"{run_dir}: no such run directory")
    path = find_checkpoint(run_dir, step)
    weights = anchor_file(path) if anchor else None
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise EmapgError(f"--out {out} exists and is not an empty folder; export never overwrites")
    # The policy in its saved dtype, the anchor in its own (anchor.dtype may differ from the policy's).
    model, tokenizer = load_model_and_tokenizer(path / "policy", dtype=_dtype(weights) if weights else "auto")
    if weights is not None:
        try:
            load_model(model, str(weights))  # strict: every weight, tied ones through their one copy
        except (RuntimeError, SafetensorError) as e:
            raise EmapgError(f"{weights} does not fit {path / 'policy'}'s model ({_first_line(e)})") from None
    written = own_dtype(run_dir, model.dtype) if dtype == "auto" else getattr(torch, dtype)
    model.to(written)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, out)  # replaces an empty folder only: never one something was written into
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, written


def own_dtype(run_dir: Path, saved: torch.dtype) -> torch.dtype:
    """The dtype of the weights the run started from: its model.path's config (a GGUF's conversion
    and the built-in model are float32); `saved`, the checkpoint's, where that model is gone."""
    path = run_folder.saved_config(run_dir).get("model", {}).get("path", "builtin:tiny")
    if path == "builtin:tiny" or gguf.is_gguf(path):
        return torch.float32
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return saved
    own = getattr(config, "dtype", None)
    return own if isinstance(own, torch.dtype) else saved


def _dtype(weights: Path):
    """The dtype of an anchor file's tensors (one for all: the anchor is cast whole)."""
    try:
        with safe_open(str(weights), "pt") as f:
            return f.get_tensor(next(iter(f.keys()))).dtype
    except (OSError, SafetensorError, StopIteration) as e:
        raise EmapgError(f"{weights} cannot be read ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
