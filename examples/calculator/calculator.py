"""A multi-turn tool task: the model calls a calculator to multiply numbers it cannot multiply
in its head, and emapg's built-in tiny model learns to use it on CPU.

An episode: prompt `347*28=`, the model writes `<calc>347*28</calc>`, the environment inserts
`<result>9716</result>` (in context, but masked out of the loss and the KL), and the model
answers `9716`. The reward is 1 when the text the model wrote after the last result is the
product. Importing this module registers the task, with its own settings (`task.max_calls` ...):

    emapg train --import examples/calculator/calculator.py --config examples/calculator/config.yaml
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from emapg.settings import setting
from emapg.tasks import Example, ProblemSettings, Task, WarmStartRecipe, register_task

CALL = re.compile(r"<calc>([0-9+*\-]{1,20})</calc>\s*$")
RESULT_END = "</result>"


def calculate(expression: str) -> str | None:
    """The value of `a*b`, `a+b` or `a-b` for whole numbers; None for anything else."""
    match = re.fullmatch(r"(\d{1,6})([+*\-])(\d{1,6})", expression)
    if match is None:
        return None
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


class CalculatorEnvironment:
    """A turn ending in `<calc>expr</calc>` gets `<result>value</result>` (or `<result>error</result>`);
    any other turn ends the episode, and so does a call past `max_calls`."""

    stop = ("</calc>",)
    max_context = max_observation_tokens = None  # no caps beyond the per-turn limit

    def __init__(self, max_calls: int = 2):
        self.max_calls = max_calls
        self.calls: list[int] = []

    def reset(self, prompts: Sequence[str]) -> None:
        self.calls = [0] * len(prompts)

    def step(self, episodes: Sequence[int], turns: Sequence[str]) -> list[str | None]:
        out: list[str | None] = []
        for i, turn in zip(episodes, turns, strict=True):
            match = CALL.search(turn)
            if match is None or self.calls[i] >= self.max_calls:
                out.append(None)
                continue
            self.calls[i] += 1
            out.append(f"<result>{calculate(match[1]) or 'error'}</result>")
        return out


def final_answer(response: str) -> str:
    """The first word the model wrote after the last inserted result (the whole response without one)."""
    words = response.rpartition(RESULT_END)[2].split()
    return words[0] if words else ""


class CalculatorSettings(ProblemSettings):
    """`task.name=calculator`: products a*b the model computes with a calculator tool."""

    seed: int = setting(0, "seed of the generated problems")
    max_calls: int = setting(2, "calculator calls per episode; the turn after the last ends it", ge=1)


class CalculatorTask(Task):
    """`a*b=` with a 3-digit a and a 2-digit b; reward 1 for the exact product."""

    name = "calculator"
    score_is_safe = True  # string comparison: scored in-process

    def __init__(self, seed: int = 0, num_train: int = 2000, num_eval: int = 200, max_calls: int = 2):
        rng = random.Random(f"calculator-{seed}")
        problems = list(
            dict.fromkeys(
                (rng.randint(100, 999), rng.randint(10, 99)) for _ in range(3 * (num_train + num_eval))
            )
        )
        problems = problems[: num_train + num_eval]
        examples = [Example(f"{a}*{b}=", str(a * b), {"a": a, "b": b}) for a, b in problems]
        self._eval, self._train = examples[:num_eval], examples[num_eval:]
        self.max_calls = max_calls

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, response: str, example: Example) -> float:
        return 1.0 if final_answer(response) == example.answer else 0.0

    def environment(self) -> CalculatorEnvironment:
        return CalculatorEnvironment(self.max_calls)

    def metrics(self, responses: list[str], examples: list[Example]) -> dict[str, float]:
        calls = [r.count(RESULT_END) for r in responses]
        right_call = [f"<calc>{e.prompt[:-1]}</calc>" in r for r, e in zip(responses, examples, strict=True)]
        return {
            "calc/calls_mean": sum(calls) / len(calls),
            "calc/right_call": sum(right_call) / len(right_call),
        }


def demonstrations(task: CalculatorTask) -> WarmStartRecipe:
    """The built-in model's warm start: episodes of the call, the inserted result (not learned)
    and the answer. The tags' brackets are new to its tokenizer (their letters and "/" are not)."""
    out = []
    for e in task.train_examples():
        expression = e.prompt[:-1]
        segments = [
            (f"<calc>{expression}</calc>", True),
            (f"<result>{calculate(expression)}</result>", False),
            (e.answer, True),
        ]
        out.append(Example(e.prompt, "".join(t for t, _ in segments), {**e.meta, "segments": segments}))
    return WarmStartRecipe(task, out, extra_chars="<>")


register_task(
    "calculator",
    lambda inputs: CalculatorTask(
        inputs.task.seed, inputs.task.num_train, inputs.task.num_eval, inputs.task.max_calls
    ),
    CalculatorSettings,
    warm_start=demonstrations,
)
