"""Arms of the quickstart on paired seeds, fixed before any run: does a setting change what a run
learns?

    python benchmarks/paired_study.py dynamic_sampling [--seeds 3] [--steps N] [key=value ...]
    .venv-vllm/bin/python benchmarks/paired_study.py rollout_correction   # needs vLLM
    .venv-vllm/bin/python benchmarks/paired_study.py rollout_correction --config smollm2_math

Each study runs a config (`--config`: the quickstart by default, the built-in tiny model on
arithmetic for 300 steps; smollm2_math is SmolLM2-135M-Instruct on sums) in its arms on the
same seeds (a seed fixes the warm start, the data order and the sampling noise alike, so the arms
are paired), sequentially (wall times are comparable on a quiet machine). Prints `emapg report`'s
table (held-out accuracy before and after, mean ± std over seeds), each arm's wall time, its gain
paired by seed against the first arm, and the study's metrics averaged over the first 10 steps,
the last 10 and all. Runs go to benchmarks/paired_runs/<study>/, or <study>-<config> for
another config (a finished run is reused).

- rollout_correction: through vLLM in bfloat16 beside the float32 policy: `corrected` (the
  defaults: pi_old recomputed, token_tis at C = 2), `recompute` (no correction), `engine` (the
  engine's pi_old, no correction).
- dynamic_sampling: `default` (every group trains), `dynamic` (algo.dynamic_sampling: groups
  whose rewards are all equal dropped and replaced, at most 10 rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from emapg.eval.report import load_run, summary_table
from study import run_one, run_pool

HERE = Path(__file__).resolve().parent
STUDIES = {
    "rollout_correction": {
        "shared": ["rollout.engine=vllm", "rollout.dtype=bfloat16", "rollout.vllm_enforce_eager=true",
                   "rollout.vllm_gpu_memory_utilization=0.1"],
        "arms": {"corrected": [], "recompute": ["algo.rollout_correction=none"],
                 "engine": ["algo.old_logp=engine", "algo.rollout_correction=none"]},
        "metrics": ["mismatch/kl", "clip_frac/first_minibatch", "rollout_correction/weight_max"],
    },
    "dynamic_sampling": {
        "shared": [],
        "arms": {"default": [], "dynamic": ["algo.dynamic_sampling=true"]},
        "metrics": ["sampling/uniform_frac", "sampling/filtered_frac", "sampling/rounds", "time/step_s"],
    },
}  # fmt: skip


def gain(run) -> float:
    acc = run.series["eval/accuracy"]
    return acc[max(acc)] - acc[min(acc)]


def window(run, metric: str, which: slice) -> list[float]:
    series = run.series.get(metric, {})
    return [series[s] for s in sorted(series)][which]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("study", choices=list(STUDIES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--config", default="quickstart", help="the base config of every arm")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the config's)")
    parser.add_argument("--out", type=Path, help="where runs go (default: benchmarks/paired_runs/<study>)")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_intermixed_args()
    folder = args.study if args.config == "quickstart" else f"{args.study}-{args.config}"
    study, out = STUDIES[args.study], args.out or HERE / "paired_runs" / folder
    budget = [f"train.steps={args.steps}"] if args.steps else []
    runs, walls = {}, {}
    # Seed-major: a study stopped part-way holds every arm at its first seeds, paired. Each run in
    # a fresh process: vLLM on CPU sizes its cache from the memory the process already holds.
    for seed in range(args.seeds):
        for arm, extra in study["arms"].items():
            name = f"{arm}-seed{seed}"
            settings = [*study["shared"], *extra, f"train.seed={seed}", *budget, *args.overrides]
            with run_pool(1) as fresh:
                fresh.submit(run_one, name, args.config, settings, out).result()
            runs[arm, seed] = load_run(out / name)
            walls[arm, seed] = json.loads((out / name / "wall_time.json").read_text())["seconds"]
    print(summary_table(list(runs.values())))
    arms, first = list(study["arms"]), next(iter(study["arms"]))
    print(f"wall time per run (s), gain paired by seed against `{first}`:")
    for arm in arms:
        seeds = range(args.seeds)
        diffs = [gain(runs[arm, s]) - gain(runs[first, s]) for s in seeds]
        spread = f" ± {statistics.stdev(diffs):.3f}" if len(diffs) > 1 else ""
        print(
            f"  {arm:<10} wall {', '.join(f'{walls[arm, s]:.0f}' for s in seeds)}; gains "
            f"{', '.join(f'{gain(runs[arm, s]):+.3f}' for s in seeds)}; minus {first}: "
            f"{', '.join(f'{d:+.3f}' for d in diffs)} (mean {statistics.fmean(diffs):+.3f}{spread})"
        )
    print("metrics, mean over seeds of the first 10 steps / the last 10 / all steps:")
    for arm in arms:
        for metric in study["metrics"]:
            cells = []
            for which in (slice(0, 10), slice(-10, None), slice(None)):
                values = [v for s in range(args.seeds) for v in window(runs[arm, s], metric, which)]
                cells.append(f"{statistics.fmean(values):.4g}" if values else "-")
            print(f"  {arm:<10} {metric:<28} {' / '.join(cells)}")


if __name__ == "__main__":
    main()
