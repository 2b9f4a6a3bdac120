"""`emapg eval`: math accuracy (avg@n) and pass@k of a model on problem files.

Samples n responses per math problem, grades them, and reports per dataset avg@n (the mean of
the n samples' correctness, pass@1 averaged: what the paper reports as accuracy) and pass@k for
k = 1, 2, 4, ..., n by the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) for
c correct of n, and their mean over the datasets. `--protocol paper-math` is the paper's protocol
(PROTOCOLS); the engine is hf or vllm. Writes <out>/eval.json (what is evaluated),
<out>/responses.jsonl (every response, as its chunk finishes: a killed evaluation resumes) and
<out>/results.json (the figures).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from emapg import distributed
from emapg.errors import EmapgError
from emapg.eval import files as eval_files
from emapg.eval.evaluate import HeldOut
from emapg.eval.files import Dataset, FileEvalSettings
from emapg.settings import setting
from emapg.tasks.base import Example
from emapg.tasks.math import PROMPT, MathTask, PromptTemplate
from emapg.tasks.math_data import Problem, load_problems
from emapg.tasks.rewards import RewardScorer


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of the n samples, drawn without replacement, include a correct one.

    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), equal to 1 - C(n-c, k) / C(n, k) but
    without huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    out = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return out if out[-1] == n else [*out, n]


def pass_at_ks(scores: list[list[float]]) -> dict[str, float]:
    """pass@k for k in ks(n), averaged over problems, from per-problem lists of n scores (1.0 = correct)."""
    n = len(scores[0])
    correct = [sum(s == 1.0 for s in row) for row in scores]
    return {str(k): sum(pass_at_k(n, c, k) for c in correct) / len(scores) for k in ks(n)}


def summarize(scores: list[list[float]], lengths: list[list[int]]) -> dict:
    """Figures of one dataset from per-problem lists of n scores (1.0 = correct) and lengths."""
    n = len(scores[0])
    return {
        "problems": len(scores),
        "samples_per_problem": n,
        "accuracy": sum(s == 1.0 for row in scores for s in row) / (n * len(scores)),
        "pass_at_k": pass_at_ks(scores),
        "response_length_mean": sum(map(sum, lengths)) / (n * len(lengths)),
    }


# The paper's math protocol (arXiv 2602.04417, as its evaluation scripts run): avg@32 and
# unbiased pass@k of 32 samples per problem at temperature 0.8, top-p 0.9, up to 28,000 tokens.
PROTOCOLS = {
    "paper-math": {"n": 32, "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 28000, "seed": 429},
}
# Problems in the usual files of the benchmarks the paper reports, by their names (lower case,
# letters and digits only): a file of another size is truncated or another dataset.
KNOWN_SIZES = {"aime24": 30, "aime2024": 30, "aime25": 30, "aime2025": 30, "amc23": 40, "amc2023": 40,
               "math500": 500, "minerva": 272, "minervamath": 272, "olympiadbench": 675}  # fmt: skip


class MathEvalSettings(FileEvalSettings):
    """`emapg eval` of math files (each field is the command's option of the same name)."""

    prompt: PromptTemplate = setting(PROMPT, "prompt template with {question}")


def check_size(name: str, problems: list[Problem], file: str) -> None:
    """A benchmark named as one the paper reports must have its number of problems."""
    known = KNOWN_SIZES.get("".join(c for c in name.lower() if c.isalnum()))
    if known is not None and len(problems) != known:
        raise EmapgError(
            f"eval: {file} has {len(problems)} problems; {name} has {known} (a truncated or different file?)"
        )


def load_datasets(files: list[str], prompt: str = PROMPT) -> dict[str, Dataset]:
    """Every file read and checked before any model loads, by name (the file's, or its folder's)."""
    datasets = {}
    for f in files:
        problems = load_problems(f)
        name = problems[0].source
        if name in datasets:
            raise EmapgError(f"eval: two data files are named {name!r}; rename one")
        check_size(name, problems, f)
        task = MathTask([], problems, prompt=prompt)
        datasets[name] = Dataset(f, task, task.eval_examples())
    return datasets


def evaluate(
    model_path: str, files: list[str], out_dir: str, settings: MathEvalSettings, *, progress: bool = True
) -> dict:
    """Evaluate a local model on each math file (resumable, data-parallel: eval_files.run);
    rank 0 returns (and writes to results.json) the figures, the other ranks {}."""
    datasets = load_datasets(files, settings.prompt)
    records = eval_files.run(model_path, datasets, out_dir, settings, progress=progress)
    if records is None:
        return {}
    results = {"model": model_path, "settings": settings.model_dump(), "datasets": {}}
    scores = {name: [[] for _ in data.examples] for name, data in datasets.items()}
    lengths = {name: [[] for _ in data.examples] for name, data in datasets.items()}
    for r in records:  # in row order: each problem's samples in order
        scores[r["dataset"]][r["example"]].append(r["score"])
        lengths[r["dataset"]][r["example"]].append(r["length"])
    for name, data in datasets.items():
        results["datasets"][name] = {"file": data.file, **summarize(scores[name], lengths[name])}
    if len(datasets) > 1:  # the mean over datasets (each weighs alike), as the paper's tables give it
        figures = list(results["datasets"].values())
        results["mean"] = {
            "problems": sum(d["problems"] for d in figures),
            "samples_per_problem": settings.n,
            "accuracy": statistics.fmean(d["accuracy"] for d in figures),
            "pass_at_k": {
                k: statistics.fmean(d["pass_at_k"][k] for d in figures) for k in figures[0]["pass_at_k"]
            },
            "response_length_mean": statistics.fmean(d["response_length_mean"] for d in figures),
        }
    (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


@dataclass
class ValidationSets:
    """`eval.datasets`: math files a training run evaluates at each evaluation besides its task's
    held-out set, graded by the math grader (`validation_metrics`)."""

    task: MathTask
    scorer: RewardScorer
    examples: dict[str, list[Example]]  # by dataset name

    @classmethod
    def load(cls, files: list[str], prompt: str | None, timeout_s: float) -> ValidationSets | None:
        """eval.datasets' sets, their prompts written with `prompt` (None: the math task's default)."""
        if not files:
            return None
        datasets = load_datasets(files, prompt or PROMPT)
        task = next(iter(datasets.values())).task  # grading reads the example alone: any will do
        return cls(
            task, RewardScorer(task, timeout_s=timeout_s), {n: d.examples for n, d in datasets.items()}
        )

    def close(self) -> None:
        self.scorer.close()


def validation_metrics(got: HeldOut, samples: int, prefix: str) -> dict:
    """<prefix>accuracy (avg@samples) and <prefix>pass@k for k = 1, 2, 4, ... samples, over every
    rank's rows of one validation set (`samples` consecutive rows per problem)."""
    rewards = [r for part in distributed.all_gather(got.scored.rewards[: got.real]) for r in part]
    per_problem = [rewards[i : i + samples] for i in range(0, len(rewards), samples)]
    return {
        f"{prefix}accuracy": statistics.fmean(rewards),
        **{f"{prefix}pass@{k}": v for k, v in pass_at_ks(per_problem).items()},
    }


def table(results: dict) -> str:
    """The results as a plain-text table, one row per dataset."""
    rows = results["datasets"]
    k_cols = list(next(iter(rows.values()))["pass_at_k"]) if rows else []
    n = next(iter(rows.values()))["samples_per_problem"] if rows else 1
    header = ["dataset", "problems", f"avg@{n}", *(f"pass@{k}" for k in k_cols), "mean length (tokens)"]
    body = [
        [
            name,
            str(r["problems"]),
            f"{r['accuracy']:.1%}",
            *(f"{r['pass_at_k'][k]:.1%}" for k in k_cols),
            f"{r['response_length_mean']:.1f}",
        ]
        for name, r in [*rows.items(), *([("mean", results["mean"])] if "mean" in results else [])]
    ]
    return eval_files.text_table(header, body)
