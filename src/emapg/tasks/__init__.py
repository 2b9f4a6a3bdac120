"""Tasks: prompts, references and rewards, found by name in a registry.

    from emapg.tasks import register_task
    register_task("my_task", lambda inputs: MyTask(inputs.task.level), config=MySettings)

Then `task.name=my_task task.level=3` sets and validates the task's own settings (MySettings,
a subclass of TaskSettings or ProblemSettings). A factory takes a `TaskInputs` (the `task`
section and a cache folder) and returns an `emapg.tasks.base.Task`. `warm_start` (optional) gives the built-in tiny model's warm start for
the task (an `emapg.tasks.base.WarmStartRecipe`; default: its training examples).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from emapg.errors import EmapgError
from emapg.settings import Registry
from emapg.tasks import arithmetic, dataset, math
from emapg.tasks.base import Example, ProblemSettings, Task, TaskInputs, TaskSettings, WarmStartRecipe
from emapg.tasks.search import task as search_task

__all__ = [
    "TASKS",
    "Example",
    "ProblemSettings",
    "Task",
    "TaskInputs",
    "TaskSettings",
    "WarmStartRecipe",
    "make_task",
    "register_task",
    "task_names",
    "warm_start_recipe",
]

TASKS = Registry("task.name", TaskSettings)


def register_task(
    name: str,
    factory: Callable,
    config: type[TaskSettings] | None = None,
    *,
    warm_start: Callable | None = None,
) -> None:
    """`task.name=name` builds its task with `factory(inputs)` (a TaskInputs); `config` is its `task` section (a
    TaskSettings subclass; default: TaskSettings alone). A later call replaces the entry."""
    TASKS.register(name, factory, config, warm_start=warm_start)


def task_names() -> list[str]:
    return TASKS.names()


def make_task(settings: TaskSettings, cache_dir: str | os.PathLike[str]) -> Task:
    """The task `settings.name` names, built by its registered factory from its section."""
    name = settings.name
    task = TASKS[name].factory(TaskInputs(settings, Path(cache_dir).expanduser()))
    if not isinstance(task, Task):
        raise EmapgError(f"task {name!r}: its factory returned {type(task).__name__}, not an emapg Task")
    return task


def warm_start_recipe(name: str, task: Task) -> WarmStartRecipe:
    """How the built-in tiny model warm-starts for `task` (registered as `name`)."""
    hook = TASKS[name].hooks.get("warm_start")
    return hook(task) if hook else WarmStartRecipe(task, task.train_examples())


register_task("arithmetic", arithmetic.ArithmeticTask.from_config, arithmetic.ArithmeticSettings)
register_task("dataset", dataset.from_config, dataset.DatasetSettings, warm_start=dataset.warm_start)
register_task("math", math.from_config, math.MathSettings, warm_start=math.warm_start)
register_task(
    "search", search_task.from_config, search_task.SearchSettings, warm_start=search_task.warm_start
)
