"""Math reasoning: the policy reasons and puts its final answer in `\\boxed{}`; reward 1 when
that answer is equivalent to the reference (graded by math-verify, see math_grader).

Data: local files in the common schemas (math_data), or the shipped sample set of generated
arithmetic and algebra word problems (emapg/data, made by emapg.data.math_samples).
"""

from __future__ import annotations

import string
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, model_validator

from emapg.settings import Float, check, existing_paths, setting, validated
from emapg.tasks.base import Example, ProblemSettings, Task, TaskInputs, WarmStartRecipe
from emapg.tasks.math_data import BOXED, SCHEMA_NAMES, Problem, load_problems

__all__ = ["PROMPT", "MathSettings", "MathTask", "from_config"]

# Qwen2.5-Math's instruction, the one the paper's models were trained and evaluated with.
PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SAMPLE_TRAIN, SAMPLE_EVAL = DATA_DIR / "math_train.jsonl", DATA_DIR / "math_eval.jsonl"
# task.samples -> the shipped files' stem (emapg.data.math_samples makes both sets)
SAMPLE_SETS = {"word_problems": "math", "sums": "sums"}
# The built-in character tokenizer needs these for the instruction and for "\boxed{...}".
TINY_EXTRA_CHARS = "\\{}%" + string.ascii_uppercase


def _has_question(template: str) -> str:
    check(
        not template or "{question}" in template,
        f"the prompt template must contain {{question}}; got {template!r:.80}",
    )
    return template


PromptTemplate = Annotated[str, AfterValidator(_has_question)]  # empty: PROMPT


# `task.schema` is the setting's name; pydantic warns that it hides BaseModel.schema, a
# deprecated classmethod of pydantic v1 that nothing here calls.
warnings.filterwarnings("ignore", 'Field name "schema" in "MathSettings"', UserWarning)


class MathSettings(ProblemSettings):
    """`task.name=math`: problems with references in `\\boxed{}`, graded by math-verify."""

    train_files: list[str] = setting(
        [], "training data (.jsonl/.json/.parquet, schema told by its fields); empty: the shipped samples"
    )
    eval_files: list[str] = setting([], "held-out data (same formats); empty: the shipped samples")
    samples: Literal[tuple(SAMPLE_SETS)] = setting(
        "word_problems",
        "the shipped sample set used where no files are given: word_problems (arithmetic and "
        "algebra) or sums (two-digit additions)",
    )
    schema: Literal[SCHEMA_NAMES] = setting(
        "auto",
        "schema of the data files; auto tells it by the fields, and question+answer by the answer "
        "(a '#### n' line: gsm8k, else qwen_math)",
    )
    format_reward: Float = setting(
        0.0, "reward of a wrong answer given in a closed \\boxed{} (0: none)", ge=0, lt=1
    )
    prompt: PromptTemplate = setting(
        "", "prompt template with {question}; empty: Qwen2.5-Math's step-by-step \\boxed{} one"
    )

    @model_validator(mode="after")
    def _files_exist(self):
        existing_paths(self.train_files, "task.train_files")
        existing_paths(self.eval_files, "task.eval_files")
        return self


def example(problem: Problem, prompt: str = PROMPT) -> Example:
    meta = {"source": problem.source, "index": problem.index}
    return Example(prompt.replace("{question}", problem.question), problem.reference, meta)


class MathTask(Task):
    """Problems with references; `score` is 1.0 for an equivalent last boxed answer, else
    `format_reward` for a response that has a closed `\\boxed{...}`, else 0.0.

    Not declared `score_is_safe`: the grader bounds its own work, and training still runs it in
    a worker process with a hard time limit (emapg.tasks.rewards).
    """

    name = "math"

    def __init__(
        self,
        train: Sequence[Problem],
        eval: Sequence[Problem],
        *,
        format_reward: float = 0.0,
        prompt: str = PROMPT,
    ):
        validated(MathSettings, {"name": "math", "format_reward": format_reward, "prompt": prompt}, "task")
        self.format_reward = format_reward
        self._train = [example(p, prompt) for p in train]
        self._eval = [example(p, prompt) for p in eval]

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, response: str, example: Example) -> float:
        from emapg.tasks.math_grader import has_boxed_answer, score  # late: SymPy, math-verify

        if score(response, example.answer) == 1.0:
            return 1.0
        return self.format_reward if self.format_reward and has_boxed_answer(response) else 0.0


def warm_start(task: MathTask):
    """The built-in model's warm start: the boxed answer, or the whole solution when the data has one."""
    examples = [
        Example(e.prompt, e.answer if BOXED in e.answer else f"{BOXED}{{{e.answer}}}", e.meta)
        for e in task.train_examples()
    ]
    return WarmStartRecipe(task, examples, extra_chars=TINY_EXTRA_CHARS)


def from_config(inputs: TaskInputs) -> MathTask:
    """The task of a `task` section: its data files read with task.schema (default: the shipped sample
    set), at most task.num_train / task.num_eval problems of each split."""
    t = inputs.task

    def problems(files: list[str], default: Path, limit: int) -> list[Problem]:
        loaded = [p for f in files for p in load_problems(f, t.schema)] if files else load_problems(default)
        return loaded[:limit]

    stem = SAMPLE_SETS[t.samples]
    return MathTask(
        problems(t.train_files, DATA_DIR / f"{stem}_train.jsonl", t.num_train),
        problems(t.eval_files, DATA_DIR / f"{stem}_eval.jsonl", t.num_eval),
        format_reward=t.format_reward,
        prompt=t.prompt or PROMPT,
    )
