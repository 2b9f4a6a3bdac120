"""Math reasoning: the policy reasons and puts its final answer in `\\boxed{}`; reward 1 when
that answer is equivalent to the reference (graded by math-verify, see math_grader).

Data: local files in the common schemas (math_data), or the shipped sample set of generated
arithmetic and algebra word problems (emapg/data, made by emapg.data.math_samples).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

from emapg.errors import EmapgError
from emapg.tasks.base import Example, Task
from emapg.tasks.math_data import Problem, load_problems
from emapg.tasks.math_grader import BOXED, has_boxed_answer, score

__all__ = ["PROMPT", "MathTask", "from_config", "score"]

# Qwen2.5-Math's instruction, the one the paper's models were trained and evaluated with.
PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SAMPLE_TRAIN, SAMPLE_EVAL = DATA_DIR / "math_train.jsonl", DATA_DIR / "math_eval.jsonl"


def example(problem: Problem, prompt: str = PROMPT) -> Example:
    meta = {"source": problem.source, "index": problem.index}
    return Example(prompt.replace("{question}", problem.question), problem.reference, meta)


class MathTask(Task):
    """Problems with references; `score` is 1.0 for an equivalent last boxed answer, else
    `format_reward` for a response that has a closed `\\boxed{...}`, else 0.0.

    Not declared `score_is_safe`: the grader bounds its own work, and training still runs it in
    a worker process with a hard time limit (emapg.rewards).
    """

    name = "math"
    # The built-in character tokenizer needs these for the instruction and for "\boxed{...}".
    tiny_extra_chars = "\\{}%" + string.ascii_uppercase

    def __init__(
        self,
        train: Sequence[Problem],
        eval: Sequence[Problem],
        *,
        format_reward: float = 0.0,
        prompt: str = PROMPT,
    ):
        if "{question}" not in prompt:
            raise EmapgError(f"math task: the prompt template must contain {{question}}, got {prompt!r:.80}")
        self.format_reward = format_reward
        self._train = [example(p, prompt) for p in train]
        self._eval = [example(p, prompt) for p in eval]

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, response: str, example: Example) -> float:
        if score(response, example.answer) == 1.0:
            return 1.0
        return self.format_reward if self.format_reward and has_boxed_answer(response) else 0.0

    def sft_examples(self) -> list[Example]:
        """Warm-start targets: the boxed answer, or the whole solution when the data has one."""
        return [
            Example(e.prompt, e.answer if BOXED in e.answer else f"{BOXED}{{{e.answer}}}", e.meta)
            for e in self._train
        ]


def from_config(cfg) -> MathTask:
    """The task of a Config: its data files read with task.schema (default: the shipped sample
    set), at most task.num_train / task.num_eval problems of each split."""
    t = cfg.task

    def problems(files: list[str], default: Path, limit: int) -> list[Problem]:
        loaded = [p for f in files for p in load_problems(f, t.schema)] if files else load_problems(default)
        return loaded[:limit]

    return MathTask(
        problems(t.train_files, SAMPLE_TRAIN, t.num_train),
        problems(t.eval_files, SAMPLE_EVAL, t.num_eval),
        format_reward=t.format_reward,
        prompt=t.prompt or PROMPT,
    )
