"""The 0.1 layout's module names, importable for one release with a DeprecationWarning.

0.2 put the modules into packages by layer (docs/design.md#layout): `import emapg.kl` still
works, warns, and gives the module now at `emapg.algo.kl` (the same object, not a copy).
`from emapg import kl`, the estimators' documented entry point, stays without a warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "emapg.kl": "emapg.algo.kl", "emapg.topk": "emapg.algo.topk", "emapg.advantages": "emapg.algo.advantages",
    "emapg.policy_loss": "emapg.algo.policy_loss", "emapg.rollout_correction": "emapg.algo.rollout_correction",
    "emapg.guards": "emapg.algo.guards",
    "emapg.models": "emapg.model.models", "emapg.gguf_models": "emapg.model.gguf",
    "emapg.lm_head": "emapg.model.lm_head", "emapg.lora": "emapg.model.lora", "emapg.anchor": "emapg.model.anchor",
    "emapg.rewards": "emapg.tasks.rewards", "emapg.reward_fns": "emapg.tasks.reward_fns",
    "emapg.search": "emapg.tasks.search", "emapg.async_rollout": "emapg.rollout.remote",
    "emapg.evaluation": "emapg.eval.evaluate", "emapg.eval_files": "emapg.eval.files",
    "emapg.math_eval": "emapg.eval.math", "emapg.search_eval": "emapg.eval.search", "emapg.report": "emapg.eval.report",
    "emapg.config": "emapg.training.config", "emapg.config_reference": "emapg.training.config_reference",
    "emapg.trainer": "emapg.training.loop", "emapg.update": "emapg.training.update",
    "emapg.checkpoint": "emapg.training.checkpoint", "emapg.checkpoint_eval": "emapg.training.checkpoint_eval",
    "emapg.export": "emapg.training.export", "emapg.metrics": "emapg.training.metrics",
    "emapg.optim": "emapg.training.optim", "emapg.sft": "emapg.training.sft",
    "emapg.dynamic_sampling": "emapg.training.dynamic_sampling", "emapg.run_folder": "emapg.training.run_folder",
}  # fmt: skip


def new_name(old: str) -> str | None:
    """Where the module `old` lives now (a moved package's submodules move with it), or None."""
    for prefix, new in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return new + old[len(prefix) :]
    return None


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on sys.meta_path, so that a moved package's submodule is never loaded a second time
    from the package's new folder; it answers only for names no file holds any more."""

    def __init__(self):
        self.specs = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        new = new_name(spec.name)
        warnings.warn(
            f"{spec.name} has moved to {new}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__  # importlib sets __spec__ to the old name's next
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.specs.pop(module.__spec__.name)  # executed already, under its new name


def install() -> None:
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
