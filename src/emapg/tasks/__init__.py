"""Tasks: prompts, references and rewards, found by name in a registry.

    from emapg.tasks import register_task
    register_task("my_task", lambda cfg: MyTask(...))   # then task.name=my_task

A factory takes the run's Config and returns a `emapg.tasks.base.Task`. The built-in tasks
are registered here; their modules load only when their task is made.
"""

from __future__ import annotations

from collections.abc import Callable

from emapg.errors import EmapgError
from emapg.tasks.base import Example, Task

__all__ = ["Example", "Task", "make_task", "register_task", "task_names"]

_FACTORIES: dict[str, Callable] = {}


def register_task(name: str, factory: Callable) -> None:
    """Make `task.name=<name>` build its task with `factory(cfg)`; a later call replaces it."""
    if not name or not isinstance(name, str):
        raise EmapgError(f"register_task: expected a non-empty name, got {name!r}")
    _FACTORIES[name] = factory


def task_names() -> list[str]:
    return sorted(_FACTORIES)


def make_task(cfg) -> Task:
    """The task `cfg.task.name` names, built by its registered factory."""
    name = cfg.task.name
    if name not in _FACTORIES:
        raise EmapgError(f"task.name: unknown {name!r}; registered: {', '.join(task_names())}")
    task = _FACTORIES[name](cfg)
    if not isinstance(task, Task):
        raise EmapgError(f"task {name!r}: its factory returned {type(task).__name__}, not an emapg Task")
    return task


def _arithmetic(cfg) -> Task:
    from emapg.tasks.arithmetic import ArithmeticTask

    t = cfg.task
    return ArithmeticTask(
        seed=t.seed,
        num_train=t.num_train,
        num_eval=t.num_eval,
        min_digits=t.min_digits,
        max_digits=t.max_digits,
    )


def _math(cfg) -> Task:
    from emapg.tasks import math

    return math.from_config(cfg)


def _search(cfg) -> Task:
    from emapg.tasks import search

    return search.from_config(cfg)


def _dataset(cfg) -> Task:
    from emapg.tasks import dataset

    return dataset.from_config(cfg)


register_task("arithmetic", _arithmetic)
register_task("dataset", _dataset)
register_task("math", _math)
register_task("search", _search)
