"""The task interface: prompts with references, and a verifiable reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Example:
    """One prompt and what a correct response must contain."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


class Task(Protocol):
    """What the trainer needs from a task.

    `score` must be a pure function of the response text and the example: it is called for
    every sampled response, and its value in [0, 1] is the reward. It runs in a worker process
    with a time limit (emapg.rewards) unless the task sets `score_is_safe = True`.
    """

    name: str

    def train_examples(self) -> list[Example]: ...

    def eval_examples(self) -> list[Example]: ...

    def score(self, response: str, example: Example) -> float: ...
