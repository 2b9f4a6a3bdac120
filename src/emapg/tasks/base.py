"""The task interface: prompts with references, a verifiable reward, and optional hooks; and
the settings every task's config section starts from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from emapg.settings import setting
from emapg.tasks.rewards import ScoringSettings


class TaskSettings(ScoringSettings):
    """The `task` section every task has. A task with settings of its own subclasses this (or
    ProblemSettings) and registers it: `register_task(name, factory, config=MySettings)`; then
    `task.name=NAME task.my_field=3` sets them."""

    name: str = setting("arithmetic", "a registered task (emapg.tasks.register_task); its own settings below")


class ProblemSettings(TaskSettings):
    """A task drawn from a set of problems: how many train on and how many evaluate."""

    num_train: int = setting(4000, "training problems (at most)", ge=0)
    num_eval: int = setting(200, "held-out problems for eval/accuracy (at most)", ge=0)


@dataclass(frozen=True)
class TaskInputs:
    """What a task's factory is given: its `task` section (`inputs.task.my_field`) and a folder
    it may cache files in (the run's warmstart.cache_dir)."""

    task: TaskSettings
    cache_dir: Path


@runtime_checkable
class Environment(Protocol):
    """What answers the model in multi-turn episodes; one instance serves one batch of episodes.
    Turn counting is the environment's: it ends an episode by returning None."""

    stop: tuple[str, ...]  # strings that end a model turn (e.g. "</search>"), besides EOS
    max_context: int | None  # prompt + episode tokens an episode may reach (None: no cap)
    max_observation_tokens: int | None  # inserted text is cut to this many tokens (None: no cut)

    def reset(self, prompts: Sequence[str]) -> None:
        """Begin one episode per prompt (the task's prompt text, before any chat template)."""
        ...

    def step(self, episodes: Sequence[int], turns: Sequence[str]) -> list[str | None]:
        """The model's latest turn of each listed episode -> text to insert, or None: done."""
        ...


@dataclass(frozen=True)
class Example:
    """One prompt and what a correct response must contain."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


class Task:
    """What the trainer needs from a task. Subclass it and override the three required methods;
    every optional hook below has a working default.

    `score` must be a pure function of the response text and the example: it is called for every
    sampled response, and its value in `reward_range` ([0, 1] by default) is the reward. It runs in
    a worker process with a time limit (emapg.tasks.rewards) unless the task sets `score_is_safe = True`.
    It may instead return an `emapg.tasks.rewards.Reward`, the value with named parts; the mean of
    each part named in `reward_parts` is logged as reward/<name>/mean.
    """

    name: str = "task"
    score_is_safe: bool = False  # True: score cannot raise or hang, so it runs in-process
    reward_range: tuple[float, float] = (0.0, 1.0)  # a score outside it is an error (reward 0, counted)
    reward_parts: tuple[str, ...] = ()  # names of the parts of a Reward that score returns

    def train_examples(self) -> list[Example]:
        raise NotImplementedError

    def eval_examples(self) -> list[Example]:
        raise NotImplementedError

    def score(self, response: str, example: Example) -> float:
        raise NotImplementedError

    def metrics(self, responses: list[str], examples: list[Example]) -> dict[str, float]:
        """Figures to log beside the reward, each a mean over the responses (e.g. calls per episode)."""
        return {}

    def environment(self) -> Environment | None:
        """A fresh environment for one batch of multi-turn episodes, or None (single turn)."""
        return None


@dataclass
class WarmStartRecipe:
    """How the built-in tiny model is warm-started for a task (builtin:tiny only): supervised
    targets, the characters its tokenizer must add, and the task that scores its stopping test.
    A task registers a function task -> recipe (`register_task(..., warm_start=)`); by default
    the recipe is the task's training examples."""

    task: Task  # names the cached warm start and scores its held-out samples
    examples: list[Example]  # prompt -> answer; meta["segments"]: (text, learn) pairs of an episode
    extra_chars: str = ""  # characters the built-in character tokenizer must add
