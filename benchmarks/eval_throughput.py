"""Tokens per second of `emapg eval` on this machine, hf and vLLM engines side by side.

    python benchmarks/eval_throughput.py [--model tiny|smollm2] [--problems 40] [--n 8]
        [--max-new-tokens 48]
    .venv-vllm/bin/python benchmarks/eval_throughput.py --engines hf vllm
    .venv-vllm/bin/python benchmarks/eval_throughput.py --model smollm2 --engines hf vllm

`--model tiny` (the default): the built-in tiny model (0.3 M parameters, width 96) taught
briefly to answer math problems in `\\boxed{}` (tests/rollout/test_vllm_eval.py's recipe),
evaluated on `--problems` copies of three problems. `--model smollm2`: SmolLM2-135M-Instruct,
the Hugging Face folder emapg converts its GGUF into (`model.path=smollm2`; bash
scripts/install-smollm2.sh; converted once and cached, before any timing), evaluated on the
first `--problems` (at most 100) of emapg's shipped held-out word problems
(src/emapg/data/math_eval.jsonl).

Either model at the paper's math protocol except n and the token limit, with the prompts `emapg
eval` gives it: the protocol's step-by-step `\\boxed{}` instruction, as one user turn of the
model's chat template where it has one (SmolLM2's; the first prompt is printed as the model sees
it). Each engine runs the same command in a fresh output directory; printed: generated tokens,
wall time (model load and grading included), tokens per second, avg@n, and each engine's time
relative to the first, between the load averages (1, 5, 15 minutes) before and after: other
jobs on the machine change the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emapg.eval.math import load_datasets
from emapg.model.models import build_tiny_model, build_tiny_tokenizer, load_tokenizer, model_folder
from emapg.prompts import encode_prompts
from emapg.tasks.math import SAMPLE_EVAL, TINY_EXTRA_CHARS, MathTask, warm_start
from emapg.tasks.math_data import load_problems
from emapg.training.sft import sft
from rollout_engines import load_average

PROBLEMS = [
    {"problem": "What is 2 + 3 * 4?", "answer": "14"},
    {"problem": "Solve for x: 2x = 3.", "answer": "\\frac{3}{2}"},
    {"problem": "Ana has 7 pens and gets 5 more. How many pens does Ana have now?", "answer": "12"},
]


def build(where: Path, problems: int) -> tuple[Path, Path]:
    """The tiny model taught the `\\boxed{}` format, and `problems` copies of PROBLEMS."""
    data = where / "problems.jsonl"
    data.write_text("".join(json.dumps(PROBLEMS[i % 3]) + "\n" for i in range(problems)))
    tokenizer = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = build_tiny_model(tokenizer, max_position_embeddings=192, seed=0)
    task = MathTask(load_problems(data)[:3], [])
    sft(model, tokenizer, warm_start(task).examples, steps=30, batch_size=3, lr=3e-3, progress=False)
    model.save_pretrained(where / "model")
    tokenizer.save_pretrained(where / "model")
    return where / "model", data


def shipped_problems(where: Path, problems: int) -> Path:
    """The first `problems` of emapg's shipped held-out word problems, in a file named as the tiny
    model's is (the file's stem names the dataset in results.json)."""
    lines = SAMPLE_EVAL.read_text().splitlines()[:problems]
    data = where / "problems.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    return data


def inputs(model: str, where: Path, problems: int) -> tuple[Path, Path]:
    """The model folder and the problem file that `--model` names."""
    if model == "tiny":
        return build(where, problems)
    return Path(model_folder("smollm2")), shipped_problems(where, problems)


def first_prompt(model: Path, data: Path) -> str:
    """The first problem as `emapg eval` feeds it to the model: its dataset read with the protocol's
    prompt, through the tokenizer's chat template where it has one (eval/files.py's encode_prompts)."""
    tokenizer = load_tokenizer(str(model))
    example = load_datasets([str(data)])[data.stem].examples[0]
    return tokenizer.decode(encode_prompts(tokenizer, [example.prompt])[0])


def eval_command(model: Path, data: Path, engine: str, args: argparse.Namespace, out: Path) -> list[str]:
    """`emapg eval` as a user runs it: --protocol paper-math (the default) but n and the token
    limit, no --no-chat-template; vLLM eager and at a tenth of the memory, to start fast."""
    return [sys.executable, "-m", "emapg", "eval", "--model", str(model), "--data", str(data),
            "--engine", engine, "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
            "--no-progress", "--out", str(out), "--enforce-eager", "--gpu-memory-utilization", "0.1"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.model == "smollm2" and not 1 <= args.problems <= 100:
        parser.error("--model smollm2: --problems must be 1..100 (the shipped held-out set's size)")
    with tempfile.TemporaryDirectory() as tmp:
        model, data = inputs(args.model, Path(tmp), args.problems)
        print(f"{args.model} model; first prompt as the model sees it: {first_prompt(model, data)!r}")
        print(f"{args.problems} problems x {args.n} samples, up to {args.max_new_tokens} new tokens")
        print(f"load average before: {load_average()}")
        first = None
        for engine in args.engines:
            out = Path(tmp) / f"out-{engine}"
            start = time.perf_counter()
            subprocess.run(eval_command(model, data, engine, args, out), check=True, capture_output=True)
            wall = time.perf_counter() - start
            rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
            tokens = sum(r["length"] for r in rows)
            accuracy = json.loads((out / "results.json").read_text())["datasets"]["problems"]["accuracy"]
            first = first or wall
            print(f"{engine:5s} {tokens} tokens in {wall:.1f} s: {tokens / wall:.0f} tokens/s, "
                  f"avg@{args.n} {accuracy:.3f}, time x{wall / first:.2f} of {args.engines[0]}")  # fmt: skip
        print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
