"""`emapg export`: a run's checkpoint, its policy or its EMA anchor, as a standard Hugging Face folder.

A checkpoint's `policy/` is already such a folder; its `anchor.safetensors` is not (bare weights,
the tied embedding stored once, no config, no tokenizer), so `from_pretrained` cannot load it.
Export loads the weights into the run's own model class (policy/'s config), where tying
restores the shared tensors, and writes config, safetensors, generation config and tokenizer
(chat template included) with `save_pretrained`: `AutoModelForCausalLM.from_pretrained(out)` and
vLLM load the folder as it is. It is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model

from emapg.errors import EmapgError
from emapg.model.models import load_model_and_tokenizer
from emapg.training.checkpoint_eval import anchor_file, find_checkpoint


def export(run_dir: str | Path, out: str | Path, step: int | None = None, *, anchor: bool = False) -> Path:
    """Write the policy (or `anchor`) saved at `step` (None: the last checkpoint) of `run_dir` to
    the new folder `out`; returns the checkpoint exported."""
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, out)  # replaces an empty folder only: never one something was written into
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


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
