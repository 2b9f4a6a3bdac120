"""Sampling and scoring held-out examples: the one evaluation path, for any task.

The trainer's eval/accuracy, the warm start's stopping test and `emapg eval` (of a run's
checkpoint: `held_out`; of math files: emapg.eval.math) all sample through a rollout engine and
score through the guarded reward scorer with `sample_and_score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import model_validator

from emapg import distributed
from emapg.batch import Rollout
from emapg.rollout import RolloutEngine, SamplingParams
from emapg.rollout.multiturn import sample_examples
from emapg.settings import Float, Section, check, existing_paths, setting
from emapg.tasks.base import Example, Task
from emapg.tasks.rewards import RewardScorer, Scored


class EvalSettings(Section):
    """The `eval` section: held-out evaluation during training (eval/accuracy)."""

    key: ClassVar[str] = "eval"
    greedy: bool = setting(False, "greedy decoding for eval/accuracy (default: sampled at eval.temperature)")
    samples: int = setting(
        4, "sampled responses per held-out problem; eval/accuracy is their mean (pass@1)", ge=1
    )
    temperature: Float = setting(1.0, "sampling temperature of evaluation (its own, not the rollout's)", gt=0)
    top_p: Float = setting(1.0, "nucleus sampling of evaluation", gt=0, le=1)
    anchor: Literal["auto"] | bool = setting(
        "auto", "also evaluate the anchor's weights (eval/anchor/accuracy); auto: with an EMA anchor"
    )
    datasets: list[str] = setting(
        [],
        "math problem files (emapg eval's formats) also evaluated at each evaluation, with the engine and "
        "sampling above: eval/<name>/accuracy and eval/<name>/pass@k (and the anchor's, with eval.anchor)",
    )
    kl: bool = setting(
        False,
        "also log eval/drift_kl (to the initial weights, kept as a frozen copy) and eval/anchor_kl: "
        "k3 per token on the evaluation's responses at eval.temperature",
    )

    @property
    def samples_per_problem(self) -> int:
        """Responses evaluated per problem: eval.samples, or one greedy response."""
        return 1 if self.greedy else self.samples

    @model_validator(mode="after")
    def _kl_needs_samples(self):
        existing_paths(self.datasets, "eval.datasets")
        check(
            not self.kl or (not self.greedy and self.top_p == 1),
            "eval.kl estimates KL(policy || reference) on the evaluation's own samples: it needs "
            "sampled evaluation (eval.greedy=false) at eval.top_p=1",
        )
        return self


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


@dataclass
class HeldOut:
    """One evaluation: the mean reward (pass@1) over every rank's real rows, and this rank's part."""

    accuracy: float
    examples: list[Example]  # this rank's slice, padding rows included
    batch: Rollout
    scored: Scored
    real: int  # rows of the slice that are not padding


def held_out(
    engine: RolloutEngine,
    tokenizer,
    task: Task,
    examples: list[Example],
    scorer: RewardScorer,
    params: SamplingParams,
    *,
    samples: int,
    chat_template: bool,
    eos: list[int],
) -> HeldOut:
    """Every example `samples` times, sampled and scored. With several processes each rank takes
    its slice, the last one padded with repeats (so all run the same forwards), and the accuracy
    is reduced over the real rows. Each response's noise is seeded by its row
    (`RolloutEngine.sample`), so one process and several draw the same noise for a row."""
    examples = [e for e in examples for _ in range(samples)]
    per = -(-len(examples) // distributed.world())
    first = distributed.rank() * per
    real = max(0, min(per, len(examples) - first))
    mine = (examples + examples[-1:] * (per * distributed.world() - len(examples)))[first : first + per]
    batch, scored = sample_and_score(
        engine, tokenizer, task, mine, scorer, params, chat_template=chat_template, eos=eos,
        rows=list(range(first, first + per)),
    )  # fmt: skip
    correct, total = distributed.sum_all(sum(scored.rewards[:real]), real)
    return HeldOut(correct / total, mine, batch, scored, real)
