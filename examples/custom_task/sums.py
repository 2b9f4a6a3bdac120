"""A task with settings of its own: sums of `task.terms` one-digit numbers, e.g. `3+5+1=` -> `9`.

emapg train --import examples/custom_task/sums.py task.name=sums task.terms=3
"""

import random

from emapg.settings import setting
from emapg.tasks import Example, ProblemSettings, Task, register_task


class SumsSettings(ProblemSettings):
    """`task.name=sums`: sums of one-digit numbers."""

    terms: int = setting(2, "numbers per sum", ge=2, le=5)
    seed: int = setting(0, "seed of the generated problems")


class Sums(Task):
    name = "sums"
    score_is_safe = True  # string comparison: cannot raise or hang, scored in-process

    def __init__(self, s: SumsSettings):
        rng = random.Random(s.seed)
        rows = [[rng.randint(0, 9) for _ in range(s.terms)] for _ in range(s.num_train + s.num_eval)]
        examples = [Example("+".join(map(str, row)) + "=", str(sum(row))) for row in rows]
        self.train, self.eval = examples[s.num_eval :], examples[: s.num_eval]

    def train_examples(self):
        return self.train

    def eval_examples(self):
        return self.eval

    def score(self, response, example):
        words = response.split()
        return float(bool(words) and words[0] == example.answer)


register_task("sums", lambda inputs: Sums(inputs.task), SumsSettings)
