"""The task interface: prompts with references, a verifiable reward, and optional hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from emapg.rollout.multiturn import Environment


class ChatPrompt(str):
    """A prompt of several chat messages: the text is their contents, one per line (what a
    tokenizer without a chat template sees); `messages` is what the chat template gets."""

    messages: tuple

    def __new__(cls, messages):
        self = super().__new__(cls, "\n".join(m["content"] for m in messages))
        self.messages = tuple(dict(m) for m in messages)
        return self

    def __reduce__(self):
        return ChatPrompt, (list(self.messages),)


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
    a worker process with a time limit (emapg.rewards) unless the task sets `score_is_safe = True`.
    It may instead return an `emapg.rewards.Reward`, the value with named parts; the mean of
    each part named in `reward_parts` is logged as reward/<name>/mean.
    """

    name: str = "task"
    score_is_safe: bool = False  # True: score cannot raise or hang, so it runs in-process
    tiny_extra_chars: str = ""  # characters the built-in character tokenizer must add for this task
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

    def sft_examples(self) -> list[Example]:
        """Supervised targets of the built-in model's warm start (default: the training examples;
        an example may carry meta["segments"], (text, learn) pairs, for multi-turn episodes)."""
        return self.train_examples()

    def warm_start_task(self) -> Task:
        """The task whose `sft_examples` warm-start the built-in tiny model (default: this one)."""
        return self

    def environment(self) -> Environment | None:
        """A fresh environment for one batch of multi-turn episodes, or None (single turn)."""
        return None
