"""Sampling and scoring held-out examples: the one evaluation path, for any task.

The trainer's eval/accuracy, the warm start's stopping test and `emapg eval` (math:
emapg.math_eval) all sample through a rollout engine and score through the guarded
reward scorer with `sample_and_score`.
"""

from __future__ import annotations

from typing import ClassVar

from emapg.rewards import RewardScorer, Scored
from emapg.rollout import Rollout, RolloutEngine, SamplingParams
from emapg.rollout.multiturn import sample_examples
from emapg.settings import Float, Section, setting
from emapg.tasks.base import Example, Task


class EvalSettings(Section):
    """The `eval` section: held-out evaluation during training (eval/accuracy)."""

    key: ClassVar[str] = "eval"
    greedy: bool = setting(False, "greedy decoding for eval/accuracy (default: sampled at eval.temperature)")
    samples: int = setting(
        4, "sampled responses per held-out problem; eval/accuracy is their mean (pass@1)", ge=1
    )
    temperature: Float = setting(1.0, "sampling temperature of evaluation (its own, not the rollout's)", gt=0)
    top_p: Float = setting(1.0, "nucleus sampling of evaluation", gt=0, le=1)


def sample_and_score(
    engine: RolloutEngine,
    tokenizer,
    task: Task,
    examples: list[Example],
    scorer: RewardScorer,
    params: SamplingParams,
    *,
    chat_template: bool,
    eos: list[int],
    rows: list[int] | None = None,
) -> tuple[Rollout, Scored]:
    """One response per example (through the task's environment when it has one), scored."""
    batch = sample_examples(
        engine, tokenizer, task, examples, params, chat_template=chat_template, eos=eos, rows=rows
    )
    return batch, scorer(batch.texts, examples)
