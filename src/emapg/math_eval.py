"""`emapg eval`: math accuracy and pass@k of a model on problem files.

Samples n responses per math problem, grades them, and reports accuracy and pass@k. Accuracy
is pass@1 averaged over the n samples (what the paper reports); pass@k uses the unbiased
estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) for c correct of n. Writes
<out>/results.json (the figures) and <out>/responses.jsonl (every response).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from emapg.errors import EmapgError
from emapg.evaluation import sample_and_score
from emapg.models import load_model_and_tokenizer
from emapg.rewards import RewardScorer
from emapg.rollout import SamplingParams, eos_ids
from emapg.rollout.hf import HFEngine
from emapg.settings import Float, Section, setting
from emapg.tasks.math import PROMPT, MathTask, PromptTemplate
from emapg.tasks.math_data import load_problems


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


class MathEvalSettings(Section):
    """`emapg eval`'s sampling (each field is the command's option of the same name)."""

    n: int = setting(16, "responses per problem", ge=1)
    temperature: Float = setting(0.6, "sampling temperature", gt=0)
    top_p: Float = setting(0.95, "nucleus sampling", gt=0, le=1)
    max_new_tokens: int = setting(3072, "response length limit", ge=1)
    batch_size: int = setting(64, "sequences per generate call", ge=1)
    seed: int = setting(0, "seed of the sampling")
    chat_template: bool = setting(True, "wrap prompts in the tokenizer's chat template")
    prompt: PromptTemplate = setting(PROMPT, "prompt template with {question}")
    reward_timeout_s: Float = setting(10.0, "time limit of one grading call", gt=0)


def evaluate(
    model_path: str, files: list[str], out_dir: str, settings: MathEvalSettings, *, dtype: str = "auto"
) -> dict:
    """Evaluate a local model on each data file; returns (and writes) the results."""
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
    results = {"model": model_path, "settings": settings.model_dump(), "datasets": {}}
    torch.manual_seed(settings.seed)  # each data file's engine calls draw their seeds from here
    with (out / "responses.jsonl").open("w") as log:
        for name, (f, problems) in datasets.items():
            task = MathTask([], problems, prompt=settings.prompt)
            with RewardScorer(task, timeout_s=settings.reward_timeout_s) as scorer:
                scores, lengths = _sample(model, tokenizer, task, scorer, settings, log)
            results["datasets"][name] = {"file": f, **summarize(scores, lengths)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _sample(model, tokenizer, task: MathTask, scorer: RewardScorer, s: MathEvalSettings, log):
    """n graded responses per problem, written to `log` as they come; per-problem scores, lengths."""
    examples = task.eval_examples()
    engine, eos = HFEngine(model, tokenizer, batch_size=s.batch_size), eos_ids(model, tokenizer)
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
    per_call = max(1, s.batch_size // s.n)  # problems per engine call
    scores, lengths = [], []
    for a in tqdm(range(0, len(examples), per_call), desc=examples[0].meta["source"], dynamic_ncols=True):
        chunk = [e for e in examples[a : a + per_call] for _ in range(s.n)]
        batch, scored = sample_and_score(
            engine,
            tokenizer,
            task,
            chunk,
            scorer,
            params,
            chat_template=s.chat_template,
            eos=eos,
            rows=list(range(a * s.n, a * s.n + len(chunk))),
        )
        rewards, tokens = scored.rewards, batch.response_mask.sum(1).tolist()
        for i, (e, text) in enumerate(zip(chunk, batch.texts, strict=True)):
            record = {
                "dataset": e.meta["source"],
                "problem": e.meta["index"],
                "sample": i % s.n,
                "reference": e.answer,
                "response": text,
                "score": rewards[i],
                "length": tokens[i],
            }
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
