"""emapg: EMA Policy Gradient — GRPO with an EMA anchor and the Top-k KL estimator.

From Python:

    import emapg
    emapg.train("quickstart", ["train.steps=50"])           # a config name or path, overrides
    emapg.train(cfg, task=MyTask())                          # a Config and your own Task
    emapg.register_task("my_task", lambda cfg: MyTask(cfg))  # then task.name=my_task anywhere
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from emapg.tasks import register_task

__version__ = "0.1.0"
__all__ = ["register_task", "train"]


def train(config=None, overrides: Sequence[str] = (), *, task=None, resume: bool = False) -> dict:
    """Train (or resume) one run; returns the final record (run_dir, accuracy before and after,
    and the task's reward_range, the scale of that accuracy: a mean reward).

    `config`: a `emapg.config.Config`, a YAML path or shipped config name (None: quickstart);
    `overrides`: dotted `key=value` strings applied on top; `task`: a `emapg.tasks.Task` instance
    to train on, registered under its `name` for this run (task.name is set to it).
    """
    from emapg import tasks
    from emapg.config import Config, apply_overrides, load_config, validate
    from emapg.errors import EmapgError
    from emapg.trainer import train as run

    overrides = list(overrides)
    saved = None
    if task is not None:
        if not isinstance(task, tasks.Task):
            raise EmapgError(f"emapg.train: task must be an emapg Task, got {type(task).__name__}")
        saved = tasks._FACTORIES.get(task.name)
        register_task(task.name, lambda cfg: task)
        overrides.append(f"task.name={task.name}")
    try:
        if isinstance(config, Config):
            cfg = copy.deepcopy(config)
            apply_overrides(cfg, overrides)
            validate(cfg)
        else:
            cfg = load_config(config, overrides)
        return run(cfg, resume=resume)
    finally:
        if task is not None:  # the registry as it was before this run
            if saved is None:
                tasks._FACTORIES.pop(task.name, None)
            else:
                tasks._FACTORIES[task.name] = saved
