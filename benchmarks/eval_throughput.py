"""Tokens per second of `emapg eval` on this machine, hf and vLLM engines side by side.

    python benchmarks/eval_throughput.py [--problems 40] [--n 8] [--max-new-tokens 48]
    .venv-vllm/bin/python benchmarks/eval_throughput.py --engines hf vllm

The built-in tiny model (0.3 M parameters, width 96) taught briefly to answer math problems in
`\\boxed{}` (tests/test_vllm_eval.py's recipe), evaluated on `--problems` copies of three
problems at the paper's math protocol except n and the token limit. Each engine runs the same
command in a fresh output directory; printed: generated tokens, wall time (model load and
grading included), tokens per second, avg@n, and each engine's time relative to the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.math import TINY_EXTRA_CHARS, MathTask, warm_start
from emapg.tasks.math_data import load_problems
from emapg.training.sft import sft

PROBLEMS = [
    {"problem": "What is 2 + 3 * 4?", "answer": "14"},
    {"problem": "Solve for x: 2x = 3.", "answer": "\\frac{3}{2}"},
    {"problem": "Ana has 7 pens and gets 5 more. How many pens does Ana have now?", "answer": "12"},
]


def build(where: Path, problems: int) -> tuple[Path, Path]:
    data = where / "problems.jsonl"
    data.write_text("".join(json.dumps(PROBLEMS[i % 3]) + "\n" for i in range(problems)))
    tokenizer = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = build_tiny_model(tokenizer, max_position_embeddings=192, seed=0)
    task = MathTask(load_problems(data)[:3], [])
    sft(model, tokenizer, warm_start(task).examples, steps=30, batch_size=3, lr=3e-3, progress=False)
    model.save_pretrained(where / "model")
    tokenizer.save_pretrained(where / "model")
    return where / "model", data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build(Path(tmp), args.problems)
        first = None
        print(f"{args.problems} problems x {args.n} samples, up to {args.max_new_tokens} new tokens")
        for engine in args.engines:
            out = Path(tmp) / f"out-{engine}"
            command = [sys.executable, "-m", "emapg", "eval", "--model", str(model), "--data", str(data),
                       "--engine", engine, "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
                       "--no-progress", "--out", str(out), "--enforce-eager", "--gpu-memory-utilization", "0.1"]  # fmt: skip
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            wall = time.perf_counter() - start
            rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
            tokens = sum(r["length"] for r in rows)
            accuracy = json.loads((out / "results.json").read_text())["datasets"]["problems"]["accuracy"]
            first = first or wall
            print(f"{engine:5s} {tokens} tokens in {wall:.1f} s: {tokens / wall:.0f} tokens/s, "
                  f"avg@{args.n} {accuracy:.3f}, time x{wall / first:.2f} of {args.engines[0]}")  # fmt: skip


if __name__ == "__main__":
    main()
