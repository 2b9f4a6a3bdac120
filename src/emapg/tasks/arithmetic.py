"""The built-in default task: multi-digit arithmetic, e.g. prompt "347+85=" and answer "432".

The response is the text the model generates after the prompt, up to EOS. The reward is exact
match of its first whitespace-separated word with the answer, so it is cheap and unambiguous.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import model_validator

from emapg.errors import EmapgError
from emapg.settings import check, setting, validated
from emapg.tasks.base import Example, ProblemSettings, Task, TaskInputs, TaskSettings

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticSettings(ProblemSettings):
    """`task.name=arithmetic` (the default): generated problems `a op b =`."""

    seed: int = setting(1234, "seed of the generated problems (independent of train.seed)")
    min_digits: int = setting(1, "fewest digits of an operand", ge=1)
    max_digits: int = setting(2, "most digits of an operand", ge=1)
    ops: list[Literal["+", "-", "*"]] = setting(["+"], "operators drawn from", min_length=1)

    @model_validator(mode="after")
    def _digits(self):
        check(self.min_digits <= self.max_digits, "task.min_digits must be <= task.max_digits")
        return self


class ArithmeticTask(Task):
    """Random problems `a op b =`, each operand with `min_digits..max_digits` digits.

    The digit count of each operand is drawn uniformly first, then the operand uniformly among
    numbers of that many digits, so short and long operands are equally common. Generation is
    a pure function of the settings; train and eval sets never share a problem. Keyword
    arguments are ArithmeticSettings' fields.
    """

    name = "arithmetic"
    score_is_safe = True  # exact_match is string matching that cannot raise or hang: scored in-process

    def __init__(self, **settings) -> None:
        s = validated(ArithmeticSettings, {"name": "arithmetic", **settings}, "task")
        self.seed, self.num_train, self.num_eval = s.seed, s.num_train, s.num_eval
        self.min_digits, self.max_digits, self.ops = s.min_digits, s.max_digits, tuple(s.ops)
        self._train, self._eval = self._generate()

    @classmethod
    def from_config(cls, inputs: TaskInputs) -> ArithmeticTask:
        return cls(**inputs.task.model_dump(exclude=set(TaskSettings.model_fields)))

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, response: str, example: Example) -> float:
        return exact_match(response, example.answer)

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(seed={self.seed}, num_train={self.num_train}, num_eval={self.num_eval}, "
            f"min_digits={self.min_digits}, max_digits={self.max_digits}, ops={self.ops})"
        )

    def _generate(self) -> tuple[list[Example], list[Example]]:
        # Distinct problems: operands range over every number with min..max digits.
        per_operand = 10**self.max_digits - (10 ** (self.min_digits - 1) if self.min_digits > 1 else 0)
        capacity = len(self.ops) * per_operand**2
        wanted = self.num_train + self.num_eval
        if wanted > capacity // 2:  # leave room so rejection sampling stays fast
            raise EmapgError(
                f"arithmetic task: {wanted} examples requested but only {capacity} distinct problems "
                f"exist for {self.min_digits}-{self.max_digits} digits and ops {list(self.ops)}; "
                "expected at most half of them"
            )
        rng = random.Random(f"arithmetic-{self.seed}")  # string seeds are stable across runs
        seen: set[str] = set()
        examples: list[Example] = []
        # Eval first, then train: growing num_train never changes the eval set.
        while len(examples) < wanted:
            a, b = self._operand(rng), self._operand(rng)
            op = rng.choice(self.ops)
            prompt = f"{a}{op}{b}="
            if prompt in seen:
                continue
            seen.add(prompt)
            examples.append(Example(prompt, str(OPS[op](a, b)), {"a": a, "b": b, "op": op}))
        return examples[self.num_eval :], examples[: self.num_eval]

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response's first word is exactly `answer`, else 0.0; never raises.

    The response ends at the first whitespace, and at the first "<" so that special tokens left
    in by a decoder ("<eos>", "</s>", "<|im_end|>") end it too. Answers never contain "<".
    """
    if not isinstance(response, str):
        return 0.0
    words = response.split("<", 1)[0].split()
    return 1.0 if words and words[0] == answer else 0.0
