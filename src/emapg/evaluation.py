"""Sampling and scoring held-out examples, and `emapg eval`.

`sample_and_score` is the one evaluation path: the trainer's eval/accuracy, the warm start's
stopping test and `emapg eval` all sample through a rollout engine and score through the
guarded reward scorer with it.

`emapg eval` samples n responses per math problem, grades them, and reports accuracy and
pass@k. Accuracy is pass@1 averaged over the n samples (what the paper reports); pass@k uses
the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) for c correct of n.
Writes <out>/results.json (the figures) and <out>/responses.jsonl (every response).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from emapg.errors import EmapgError
from emapg.models import load_model_and_tokenizer
from emapg.rewards import RewardScorer, Scored
from emapg.rollout import Rollout, RolloutEngine, SamplingParams, eos_ids
from emapg.rollout.hf import HFEngine
from emapg.rollout.multiturn import sample_examples
from emapg.tasks.base import Example, Task
from emapg.tasks.math import PROMPT, MathTask
from emapg.tasks.math_data import load_problems


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


def summarize(scores: list[list[float]], lengths: list[list[int]]) -> dict:
    """Figures of one dataset from per-problem lists of n scores (1.0 = correct) and lengths."""
    n = len(scores[0])
    correct = [sum(s == 1.0 for s in row) for row in scores]
    return {
        "problems": len(scores),
        "samples_per_problem": n,
        "accuracy": sum(correct) / (n * len(scores)),
        "pass_at_k": {str(k): sum(pass_at_k(n, c, k) for c in correct) / len(scores) for k in ks(n)},
        "response_length_mean": sum(map(sum, lengths)) / (n * len(lengths)),
    }


@dataclass
class EvalSettings:
    n: int = 16
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 3072
    batch_size: int = 64
    seed: int = 0
    chat_template: bool = True
    prompt: str = PROMPT
    reward_timeout_s: float = 10.0

    def check(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise EmapgError("eval: --n, --max-new-tokens and --batch-size must be >= 1")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise EmapgError("eval: expected --temperature > 0 and 0 < --top-p <= 1")
        if "{question}" not in self.prompt:
            raise EmapgError(f"eval: --prompt must contain {{question}}, got {self.prompt!r:.80}")


def evaluate(
    model_path: str, files: list[str], out_dir: str, settings: EvalSettings, *, dtype: str = "auto"
) -> dict:
    """Evaluate a local model on each data file; returns (and writes) the results."""
    settings.check()
    datasets = {}
    for f in files:  # every file is read and checked before the model loads
        problems = load_problems(f)
        if problems[0].source in datasets:
            raise EmapgError(f"eval: two data files are named {problems[0].source!r}; rename one")
        datasets[problems[0].source] = (f, problems)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=getattr(torch, dtype))
    model.to(device).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {"model": model_path, "settings": vars(settings), "datasets": {}}
    torch.manual_seed(settings.seed)  # each data file's engine calls draw their seeds from here
    with (out / "responses.jsonl").open("w") as log:
        for name, (f, problems) in datasets.items():
            task = MathTask([], problems, prompt=settings.prompt)
            with RewardScorer(task, timeout_s=settings.reward_timeout_s) as scorer:
                scores, lengths = _sample(model, tokenizer, task, scorer, settings, log)
            results["datasets"][name] = {"file": f, **summarize(scores, lengths)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _sample(model, tokenizer, task: MathTask, scorer: RewardScorer, s: EvalSettings, log):
    """n graded responses per problem, written to `log` as they come; per-problem scores, lengths."""
    examples = task.eval_examples()
    engine, eos = HFEngine(model, tokenizer, batch_size=s.batch_size), eos_ids(model, tokenizer)
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
    per_call = max(1, s.batch_size // s.n)  # problems per engine call
    scores, lengths = [], []
    for a in tqdm(range(0, len(examples), per_call), desc=examples[0].meta["source"], dynamic_ncols=True):
        chunk = [e for e in examples[a : a + per_call] for _ in range(s.n)]
        batch, scored = sample_and_score(
            engine, tokenizer, task, chunk, scorer, params, chat_template=s.chat_template, eos=eos,
            rows=list(range(a * s.n, a * s.n + len(chunk))),
        )  # fmt: skip
        rewards, tokens = scored.rewards, batch.response_mask.sum(1).tolist()
        for i, (e, text) in enumerate(zip(chunk, batch.texts, strict=True)):
            record = {
                "dataset": e.meta["source"], "problem": e.meta["index"], "sample": i % s.n,
                "reference": e.answer, "response": text, "score": rewards[i], "length": tokens[i],
            }  # fmt: skip
            log.write(json.dumps(record) + "\n")
        for p in range(0, len(chunk), s.n):
            scores.append(rewards[p : p + s.n])
            lengths.append(tokens[p : p + s.n])
    return scores, lengths


def table(results: dict) -> str:
    """The results as a plain-text table, one row per dataset."""
    rows = results["datasets"]
    k_cols = list(next(iter(rows.values()))["pass_at_k"]) if rows else []
    header = ["dataset", "problems", "accuracy", *(f"pass@{k}" for k in k_cols), "mean length (tokens)"]
    body = [
        [
            name,
            str(r["problems"]),
            f"{r['accuracy']:.1%}",
            *(f"{r['pass_at_k'][k]:.1%}" for k in k_cols),
            f"{r['response_length_mean']:.1f}",
        ]
        for name, r in rows.items()
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *body]
    ]
    return "\n".join(lines) + "\n"
