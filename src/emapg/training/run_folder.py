"""A run's folder, `<train.output_dir>/<train.name>`: one run per folder.

A new run never writes into a folder that holds another run's checkpoints: they would
outlive the new one's pruning, and `--resume` or `emapg eval --run` would then load the old
weights under the new config. It stops instead, naming `--resume` and `train.name`; a fresh
name is not made up, because then `--resume` could not find the run it continues.

A resumed run continues under the config it saved (`config.yaml`): settings changed on the
command line are listed, old -> new, and a change that would make the checkpoint's state mean
something else (another model, task, group size, seed ...) is refused.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from emapg.errors import EmapgError
from emapg.training.checkpoint import list_checkpoints

CONFIG = "config.yaml"
# Settings (a section, or section.key) a resumed run cannot change: the checkpoint's weights,
# data position and anchor were made under them.
FIXED_ON_RESUME = (
    "model",
    "task",
    "lora",
    "warmstart",
    "anchor.kind",
    "anchor.dtype",
    "train.precision",
    "rollout.group_size",
    "train.seed",
)  # not train.output_dir or train.name: a run folder may be moved or renamed, and resumed there


def claim(run_dir: Path) -> None:
    """Stop a new run whose folder holds another run's checkpoints. A run that stopped before its
    first checkpoint (a reward to fix, a crash in step 1) can neither resume nor be evaluated:
    its folder is started over, so the same command runs again once the cause is fixed."""
    held = [p.name for p in list_checkpoints(run_dir / "checkpoints")]
    if held:
        raise EmapgError(
            f"{run_dir} already holds a run (checkpoints {', '.join(held)}): `emapg train --resume` "
            "continues it, train.name=<another name> starts a new run beside it (or delete the folder)"
        )


# A run saved before train.precision had model.dtype, which set parameters and compute alike.
_PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16-true"}


def saved_config(run_dir: Path) -> dict:
    """The config a run saved when it started (section -> {key: value}), in today's keys."""
    file = run_dir / CONFIG
    if not file.is_file():
        raise EmapgError(
            f"--resume: {file} not found: is {run_dir} a run folder (train.output_dir, train.name)?"
        )
    saved = yaml.safe_load(file.read_text()) or {}
    dtype = (saved.get("model") or {}).pop("dtype", None)
    if dtype is not None:
        if dtype not in _PRECISION_OF_DTYPE:
            raise EmapgError(
                f"{file}: model.dtype={dtype} has no train.precision; emapg trains in fp32 or bfloat16"
            )
        saved.setdefault("train", {}).setdefault("precision", _PRECISION_OF_DTYPE[dtype])
    return saved


def config_changes(saved: dict, config: dict) -> list[tuple[str, object, object]]:
    """(section.key, old, new) for each setting `config` changes from a run's `saved` config. A
    setting the saved config lacks (added to emapg since) is not a change: the saved run ran with
    its default."""
    config = yaml.safe_load(yaml.safe_dump(config, sort_keys=False))  # tuples read back as lists
    return [
        (f"{section}.{key}", old, new)
        for section, values in config.items()
        for key, new in values.items()
        if (old := (saved.get(section) or {}).get(key, new)) != new
    ]


def resume_changes(saved: dict, config: dict) -> list[str]:
    """`section.key: old -> new` for each setting `config` changes from the run's `saved` config.
    Raises on a change to a setting in FIXED_ON_RESUME."""
    changes, fixed = [], []
    for name, old, new in config_changes(saved, config):
        section = name.partition(".")[0]
        (fixed if section in FIXED_ON_RESUME or name in FIXED_ON_RESUME else changes).append(
            f"{name}: {old!r} -> {new!r}"
        )
    if fixed:
        raise EmapgError(
            f"--resume: the run's checkpoints were made under other settings ({'; '.join(fixed)}); "
            "resume without changing them, or start a new run (another train.name)"
        )
    return changes
