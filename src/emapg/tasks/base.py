"""The task interface: prompts with references, a verifiable reward, and optional hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from emapg.rollout.multiturn import Environment


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
    sampled response, and its value in [0, 1] is the reward. It runs in a worker process with a
    time limit (emapg.rewards) unless the task sets `score_is_safe = True`.
    """

    name: str = "task"
    score_is_safe: bool = False  # True: score cannot raise or hang, so it runs in-process
    tiny_extra_chars: str = ""  # characters the built-in character tokenizer must add for this task

    def train_examples(self) -> list[Example]:
        raise NotImplementedError

    def eval_examples(self) -> list[Example]:
        raise NotImplementedError

    def score(self, response: str, example: Example) -> float:
        raise NotImplementedError

    def metrics(self, responses: list[str], examples: list[Example]) -> dict[str, float]:
        """Figures to log beside the reward, each a mean over the responses (e.g. calls per episode)."""
        return {}

    def sft_examples(self) -> list[Example]:
        """Supervised targets of the built-in model's warm start (default: the training examples;
        an example may carry meta["segments"], (text, learn) pairs, for multi-turn episodes)."""
        return self.train_examples()

    def environment(self) -> Environment | None:
        """A fresh environment for one batch of multi-turn episodes, or None (single turn)."""
        return None
