"""emapg: EMA Policy Gradient — GRPO with an EMA anchor and the Top-k KL estimator.

From Python:

    import emapg
    emapg.train("quickstart", ["train.steps=50"])           # a config name or path, overrides
    emapg.train(cfg, task=MyTask())                          # a Config and your own Task
    emapg.register_task("my_task", lambda inputs: MyTask(inputs.task.level), config=MySettings)
    emapg.train("quickstart", ["task.name=my_task", "task.level=3"])
"""

from __future__ import annotations

from collections.abc import Sequence

from emapg import moved
from emapg.tasks import register_task

__version__ = "0.1.0"
__all__ = ["register_task", "train"]
moved.install()


def __getattr__(name: str):
    if name == "kl":  # `from emapg import kl`: the estimators' public entry point, at its old name
        from emapg.algo import kl

        return kl
    raise AttributeError(f"module 'emapg' has no attribute {name!r}")


def train(config=None, overrides: Sequence[str] = (), *, task=None, resume: bool = False) -> dict:
    """Train (or resume) one run; returns the final record (run_dir, accuracy before and after,
    and the task's reward_range, the scale of that accuracy: a mean reward).

    `config`: a `emapg.training.config.Config`, a YAML path or shipped config name (None: quickstart);
    `overrides`: dotted `key=value` strings applied on top; `task`: a `emapg.tasks.Task` instance
    to train on, registered under its `name` for this run only. The instance brings its data, so
    of the config's task section only the settings every task has (reward_timeout_s,
    reward_isolation) carry over.
    """
    from emapg.errors import EmapgError
    from emapg.tasks import TASKS, Task
    from emapg.training.config import run_config
    from emapg.training.loop import train as run

    if task is None:
        return run(run_config(config, list(overrides), resume=resume), resume=resume)
    if not isinstance(task, Task):
        raise EmapgError(f"emapg.train: task must be an emapg Task, got {type(task).__name__}")
    with TASKS.registered(task.name, lambda inputs: task):
        cfg = run_config(config, list(overrides), resume=resume, task_name=task.name)
        return run(cfg, resume=resume)
