"""The stability frontier: where the KL binds, does an anchor that follows the policy let it travel
further, or learn more, than a frozen one?

    python benchmarks/frontier.py [--seeds 3] [--steps 600] [--jobs 2] [--betas ...] [--anchors ...]
        [--estimators ...] [--lr-factors 3 10] [key=value ...]

The grid, fixed before any run (the quickstart: built-in tiny model warm-started per seed,
arithmetic, 16 prompts x 16 samples a step, held-out accuracy of 200 problems x 4 samples):

- kl.beta 1e-3, 1e-2, 1e-1, 1 x estimator k3, topk (k 32, reverse, importance-weighted) x anchor:
  frozen      the start (GRPO's reference)
  ema         eta 0.9 every 10 steps (the paper's)
  ema_fast    eta 0.5 every 10 steps
  ema_slow    eta 0.99 every 10 steps
  reset       eta 0 every steps/6 steps: a hard reset to the policy (slime's --ref-update-interval,
              ProRL, SkyRL)
  trl_sync    eta 0.4 every steps/6 steps: TRL's sync_ref_model (TR-DPO's soft update: mix-up
              alpha 0.6 = 1 - eta; its 512 steps scaled to the run, as often as the reset)
  and kl.beta 0 (no anchor) as the unregularised column;
- then the learning-rate stress: optim.lr x3 and x10 (--lr-factors) at each anchor's best cell
  (highest mean final accuracy over seeds; the smaller beta on a tie) and at kl.beta 0.

Every run evaluates every steps/12 steps with eval.kl (eval/drift_kl: KL of the policy to its
start on the evaluation's responses; eval/anchor_kl) and, where the anchor moves, eval.anchor.
Per run: final and best held-out accuracy, the anchor's final accuracy, final drift, KL to the
anchor, entropy and response length (means over the last 10 steps) and `emapg.eval.report.collapse`'s flag. Per cell:
mean ± std over seeds; beside it, each moving anchor's final accuracy minus the frozen one's,
paired by seed at the same beta and estimator. Writes its block of benchmarks/RESULTS.md and the
picture benchmarks/frontier.png (final accuracy against drift, a curve per anchor, a point per
beta). Runs go to benchmarks/frontier_runs/ (a finished run is reused, a stopped one resumes);
`--jobs 2 train.threads=1` trains two at once, one thread each.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from emapg.errors import DivergedError
from emapg.eval.report import FrontierPoint, Run, collapse, load_run, plot_frontier
from study import run_one, run_pool, write_block

HERE = Path(__file__).resolve().parent
BETAS = [1e-3, 1e-2, 1e-1, 1.0]
ESTIMATORS = ["k3", "topk"]
LR_FACTORS = [3, 10]
# (eta, update period); None: a period of steps / 6 (the reset and TRL's sync, scaled to the run).
ANCHORS = {
    "frozen": (1.0, 10),
    "ema": (0.9, 10),
    "ema_fast": (0.5, 10),
    "ema_slow": (0.99, 10),
    "reset": (0.0, None),
    "trl_sync": (0.4, None),
}
SHARED = ["kl.k=32", "kl.direction=reverse", "kl.importance_weight=true", "eval.kl=true"]
BASE_LR = 2e-4  # optim.lr's default, which the quickstart keeps


def cell_overrides(
    anchor: str, estimator: str, beta: float, lr_factor: int, steps: int, base_lr: float = BASE_LR
) -> list[str]:
    """The settings of one cell; anchor "none" is kl.beta 0."""
    lr = [f"optim.lr={base_lr * lr_factor:g}"]
    if anchor == "none":
        return ["anchor.kind=none", "kl.beta=0", *lr]
    eta, period = ANCHORS[anchor]
    kind = "frozen" if anchor == "frozen" else "ema"
    return [
        f"anchor.kind={kind}", f"anchor.eta={eta}", f"anchor.update_period={period or max(1, steps // 6)}",
        f"kl.estimator={estimator}", f"kl.beta={beta:g}", *lr,
    ]  # fmt: skip


def cell_name(anchor: str, estimator: str, beta: float, lr_factor: int) -> str:
    if anchor == "none":
        return f"none-beta0-lr{lr_factor}x"
    return f"{anchor}-{estimator}-beta{beta:g}-lr{lr_factor}x"


def train_cell(name: str, overrides: list[str], out: Path, base: str = "quickstart") -> float:
    """run_one on config `base`, with a run the trainer stops (non-finite steps in a row) recorded
    as diverged; any other error stops the grid (a full disk is not a result). The tables read
    the metrics only: a finished run's checkpoints are deleted."""
    try:
        return run_one(name, base, overrides, out, keep_checkpoints=False)
    except DivergedError as e:
        (out / name / "failed.json").write_text(json.dumps({"error": str(e)}))
        print(f"{name}: stopped: {e}", flush=True)
        return 0.0


def train_all(
    cells: dict[str, list[str]], seeds: int, out: Path, jobs: int, base: str = "quickstart"
) -> None:
    """Every cell on every seed, seed-major: a partial grid holds every cell at its first seeds."""
    with run_pool(jobs) as pool:
        futures = [
            pool.submit(train_cell, f"{name}-seed{seed}", [*overrides, f"train.seed={seed}"], out, base)
            for seed in range(seeds)
            for name, overrides in cells.items()
        ]
        for future in futures:
            future.result()


def summarize(out: Path, name: str) -> dict:
    """One run's figures (a run the trainer stopped is "diverged", at its last evaluation)."""
    run: Run = load_run(out / name)
    acc = run.series["eval/accuracy"]

    def final(metric: str) -> float:
        series = run.series.get(metric, {})
        return series[max(series)] if series else math.nan

    def last(metric: str, window: int = 10) -> float:
        series = run.series.get(metric, {})
        return statistics.fmean([series[s] for s in sorted(series)][-window:]) if series else math.nan

    failed = (out / name / "failed.json").is_file()
    return {
        "final": final("eval/accuracy"),
        "best": max(acc.values()),
        "anchor_acc": final("eval/anchor/accuracy"),
        "drift": final("eval/drift_kl"),
        # no anchor, no KL: the committed runs of such cells logged a KL of 0.0 (the trainer has logged none since)
        "kl": math.nan if name.startswith("none-") else last("kl/value"),
        "entropy": last("entropy"),
        "length": last("response_length/mean"),
        "collapse": "diverged" if failed else collapse(run),
    }


def cell_stats(runs: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in runs if not math.isnan(r[key])]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if digits < 4 else f"{mean:.2e} ± {std:.1e}"


def table(cells: dict[str, list[dict]]) -> str:
    header = ["cell", "final accuracy", "best accuracy", "anchor's accuracy", "drift KL", "KL to anchor (last)",
              "entropy (last)", "response length (last)", "collapsed"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in cells.items():
        flags = [r["collapse"] for r in runs if r["collapse"]]
        collapsed = (
            f"{len(flags)}/{len(runs)} ({', '.join(sorted(set(flags)))})" if flags else f"0/{len(runs)}"
        )
        lines.append(
            "| " + " | ".join([
                f"`{name}`", fmt(*cell_stats(runs, "final"), 3), fmt(*cell_stats(runs, "best"), 3),
                fmt(*cell_stats(runs, "anchor_acc"), 3), fmt(*cell_stats(runs, "drift"), 4),
                fmt(*cell_stats(runs, "kl"), 4), fmt(*cell_stats(runs, "entropy"), 3),
                fmt(*cell_stats(runs, "length"), 1), collapsed,
            ]) + " |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def paired_table(
    cells: dict[str, list[dict]], anchors: list[str], betas: list[float], estimators: list[str]
) -> str:
    """Each moving anchor's final accuracy minus the frozen anchor's, paired by seed (mean ± std)."""
    moving = [a for a in anchors if a != "frozen"]
    if "frozen" not in anchors or not moving:
        return ""
    lines = [
        "| estimator, beta | " + " | ".join(f"{a} - frozen" for a in moving) + " |",
        "|" + "---|" * (1 + len(moving)),
    ]
    for estimator in estimators:
        for beta in betas:
            base = cells[cell_name("frozen", estimator, beta, 1)]
            row = []
            for a in moving:
                diffs = [
                    r["final"] - b["final"]
                    for r, b in zip(cells[cell_name(a, estimator, beta, 1)], base, strict=True)
                ]
                mean, std = statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0
                row.append(f"{mean:+.3f} ± {std:.3f}")
            lines.append(f"| {estimator}, {beta:g} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def best_cells(
    cells: dict[str, list[dict]], anchors: list[str], betas: list[float], estimators: list[str]
) -> dict[str, tuple]:
    """Each anchor's (estimator, beta) of highest mean final accuracy; the smaller beta on a tie."""
    best = {}
    for a in anchors:
        candidates = [(e, b) for b in betas for e in estimators]
        best[a] = max(
            candidates, key=lambda eb: (cell_stats(cells[cell_name(a, *eb, 1)], "final")[0], -eb[1])
        )
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--betas", type=float, nargs="+", default=BETAS)
    parser.add_argument("--anchors", nargs="+", default=list(ANCHORS), choices=list(ANCHORS))
    parser.add_argument("--estimators", nargs="+", default=ESTIMATORS, choices=ESTIMATORS)
    parser.add_argument(
        "--lr-factors",
        type=int,
        nargs="*",
        default=LR_FACTORS,
        help="learning-rate multiples (none: no stress runs)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    parser.add_argument("--out", type=Path, default=HERE / "frontier_runs")
    parser.add_argument(
        "--results", type=Path, default=HERE / "RESULTS.md", help="the file whose block this writes"
    )
    parser.add_argument("--png", type=Path, default=HERE / "frontier.png")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_intermixed_args()
    t0 = time.perf_counter()
    steps = args.steps
    every = [
        f"train.steps={steps}",
        f"train.eval_every={max(1, steps // 12)}",
        f"train.save_every={max(1, steps // 6)}",
    ]
    shared = [*SHARED, *every, *args.overrides]

    grid = {cell_name(a, e, b, 1): [*shared, *cell_overrides(a, e, b, 1, steps)]
            for a in args.anchors for e in args.estimators for b in args.betas}  # fmt: skip
    grid[cell_name("none", "", 0, 1)] = [*shared, *cell_overrides("none", "", 0, 1, steps)]
    train_all(grid, args.seeds, args.out, args.jobs)
    results = {name: [summarize(args.out, f"{name}-seed{s}") for s in range(args.seeds)] for name in grid}

    best = best_cells(results, args.anchors, args.betas, args.estimators)
    stress = {}
    for factor in args.lr_factors:
        for a, (e, b) in [*best.items(), ("none", ("", 0))]:
            stress[cell_name(a, e, b, factor)] = [*shared, *cell_overrides(a, e, b, factor, steps)]
    train_all(stress, args.seeds, args.out, args.jobs)
    results |= {name: [summarize(args.out, f"{name}-seed{s}") for s in range(args.seeds)] for name in stress}

    panels = {
        f"estimator {e}": [
            FrontierPoint(a, f"{b:g}", [r["drift"] for r in results[cell_name(a, e, b, 1)]],
                          [r["final"] for r in results[cell_name(a, e, b, 1)]])
            for a in args.anchors for b in args.betas
        ]
        for e in args.estimators
    }  # fmt: skip
    plot_frontier(panels, args.png, "drift: KL(policy || start) at the end", "final held-out accuracy")
    lr_rows = [cell_name(a, *best[a], 1) for a in args.anchors] + [cell_name("none", "", 0, 1)] + list(stress)
    command = " ".join(
        # overrides first: after a list option (--betas, --lr-factors) argparse would take them as its values
        ["python benchmarks/frontier.py", *args.overrides, f"--seeds {args.seeds}", f"--steps {steps}"]
        + ([f"--jobs {args.jobs}"] if args.jobs > 1 else [])
        + ([f"--betas {' '.join(f'{b:g}' for b in args.betas)}"] if args.betas != BETAS else [])
        + ([f"--anchors {' '.join(args.anchors)}"] if args.anchors != list(ANCHORS) else [])
        + ([f"--estimators {' '.join(args.estimators)}"] if args.estimators != ESTIMATORS else [])
        + ([f"--lr-factors {' '.join(map(str, args.lr_factors))}"] if args.lr_factors != LR_FACTORS else [])
    )
    text = (
        "## The stability frontier: the grid\n\n"
        f"Regenerate with `{command}` ({time.perf_counter() - t0:.0f} s of wall time for this\n"
        f"invocation; finished runs are reused). {args.seeds} seeds, {steps} steps a run; mean ± std over seeds.\n"
        "Final accuracy: the last evaluation; anchor's accuracy: the anchor's weights evaluated there\n"
        "(eval.anchor); drift KL: KL(policy || start) per token on the evaluation's responses at the end;\n"
        "collapsed: runs flagged by `emapg.eval.report.collapse` (or stopped: diverged). Picture:\n"
        f"`benchmarks/{args.png.name}`.\n\n"
        + table({name: results[name] for name in grid})
        + "\n### Each moving anchor against the frozen one, paired by seed (final accuracy)\n\n"
        + (
            paired_table(results, args.anchors, args.betas, args.estimators)
            or "(no frozen anchor in this grid)\n"
        )
        + (
            "\n### Learning-rate stress at each anchor's best cell (and without a KL)\n\n"
            if args.lr_factors
            else "\n### Each anchor's best cell (and without a KL); no learning-rate stress was run\n\n"
        )
        + table({name: results[name] for name in lr_rows})
    )
    write_block(args.results, text, owner="frontier.py")
    print(text)


if __name__ == "__main__":
    main()
