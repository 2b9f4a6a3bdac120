"""What the EMA anchor does to a real model: GRPO's frozen reference against the paper's EMA anchor
on SmolLM2-135M-Instruct learning two-digit sums (configs/smollm2_math.yaml), seeds paired.

    python benchmarks/frontier_smollm2.py --pilot     # the KL-share pilot that fixed BINDING_BETA
    python benchmarks/frontier_smollm2.py [--jobs 1]  # the grid, then its block of RESULTS.md

The pilot (seed 0, the EMA anchor, PILOT_STEPS steps at each of PILOT_BETAS): per beta, the KL to
the anchor (kl/value) and the KL term's share of the loss, beta * KL / (beta * KL + |policy loss|),
means over the pilot's last 5 steps. The rule, fixed before the pilot ran: the KL binds at the
smallest beta whose KL to the anchor is at most half of that at the paper's beta (the penalty
holds the policy measurably nearer its anchor); BINDING_BETA below is that beta, written in after
the pilot and before the grid's first run.

The grid, fixed before its first run (3 seeds, paired; each run the config's 30 steps,
evaluated at steps 0, 10, 20, 30 on 200 held-out sums x 2 samples, with eval.kl, and the
anchor's own weights evaluated where the anchor moves), top-k KL (k 32, reverse,
importance-weighted):
  none       kl.beta 0: no anchor
  frozen     the warm start (GRPO's reference)       at PAPER_BETA and at BINDING_BETA
  ema        eta 0.9 every 10 steps (the paper's)    at PAPER_BETA and at BINDING_BETA
  and the learning-rate stress, optim.lr x LR_STRESS, for frozen and ema at BINDING_BETA
  (where the two anchors can differ at all).
Cells run seed-major (a partial grid holds every cell at its first seeds); runs go to
benchmarks/frontier_smollm2_runs/, a finished run is reused, a stopped one resumes, so the grid
spans sessions. A finished run's folder (config, metrics, samples, wall time: its checkpoints
are deleted) is committed, since a new checkout holds only what git does. Every run of the
grid trains on commit 1c8434e (from a worktree there, `PYTHONPATH=src:benchmarks`): the hf
engine's shared prefill, added after it, samples the same tokens only up to float rounding.
The load the block states is read from the runs folder's load.log, which a logger started beside
the grid writes (that commit's script has none of its own), committed with the runs:
    while true; do echo "$(date -u +%FT%TZ) $(cut -d' ' -f1-3 /proc/loadavg)" >> RUNS/load.log; sleep 60; done
Per run: the held-out accuracy curve (the policy's and the anchor's), drift KL to
the start, KL to the anchor, entropy, response length and the collapse flag; per cell mean ± std
over seeds; ema minus frozen paired by seed; the EMA anchor's own accuracy minus its policy's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from emapg.eval.report import load_run, plot
from emapg.training.config import load_config
from frontier import SHARED, cell_name, cell_overrides, summarize, table, train_all
from study import timings, write_block

HERE = Path(__file__).resolve().parent
CONFIG = "smollm2_math"
ESTIMATOR = "topk"
PAPER_BETA = 1e-3
PILOT_BETAS = [1e-3, 1e-2, 1e-1, 1.0]
PILOT_STEPS = 10
# The pilot's answer, written in before the grid's first run. `--pilot` printed (seed 0, EMA
# anchor, 10 steps; means over steps 6-10):
#   kl.beta   KL to the anchor   |policy loss|   KL's share of the loss
#   0.001     0.0829             0.0088          0.009
#   0.01      0.0826             0.0086          0.088
#   0.1       0.0690             0.0051          0.577
#   1         0.0247             0.0060          0.806
# so the KL binds at beta 1 (KL to the anchor 0.30x the paper's beta's; 0.1 only 0.83x).
BINDING_BETA = 1.0
LR_STRESS = 10
SEEDS = 3
# The pilot and the grid ran before smollm2_math moved to bf16-mixed and one micro-batch of 64
# rows: their settings then, so that the committed runs are reused as what they are.
RAN_AS = ["train.precision=fp32", "algo.micro_batch_size=16"]


def grid_cells(binding: float) -> list[tuple[str, float, int]]:
    """(anchor, beta, learning-rate factor) of each cell, in the order the tables show them."""
    return [
        ("none", 0.0, 1),
        ("frozen", PAPER_BETA, 1), ("ema", PAPER_BETA, 1),
        ("frozen", binding, 1), ("ema", binding, 1),
        ("frozen", binding, LR_STRESS), ("ema", binding, LR_STRESS),
    ]  # fmt: skip


def overrides(anchor: str, beta: float, factor: int, steps: int, base_lr: float) -> list[str]:
    return cell_overrides(anchor, ESTIMATOR, beta, factor, steps, base_lr)


def pilot(args: argparse.Namespace, base_lr: float) -> str:
    """Train the pilot's runs and return its table (and the beta its rule picks)."""
    every = [f"train.steps={PILOT_STEPS}", f"train.eval_every={PILOT_STEPS}", "task.num_eval=20", *RAN_AS]
    cells = {f"pilot-beta{b:g}": [*SHARED, *every, *overrides("ema", b, 1, PILOT_STEPS, base_lr), *args.overrides]
             for b in PILOT_BETAS}  # fmt: skip
    out = args.out
    train_all(cells, 1, out, 1, args.config)
    rows, kls = [], {}
    for beta in PILOT_BETAS:
        run = load_run(out / f"pilot-beta{beta:g}-seed0")
        last = [s for s in sorted(run.series["kl/value"]) if s > PILOT_STEPS - 5]
        kl = statistics.fmean(run.series["kl/value"][s] for s in last)
        policy = statistics.fmean(abs(run.series["loss/policy"][s]) for s in last)
        kls[beta] = kl
        rows.append(f"| {beta:g} | {kl:.4f} | {policy:.4f} | {beta * kl / (beta * kl + policy):.3f} |")
    binding = binding_beta(kls)
    return (
        "| kl.beta | KL to the anchor | abs(policy loss) | KL's share of the loss |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\nThe KL binds at beta {binding:g}: the smallest whose KL to the anchor is at most half"
        f" of that at {PAPER_BETA:g}.\n"
    )


def binding_beta(kls: dict[float, float]) -> float:
    """The pilot's rule: the smallest beta whose KL to the anchor is at most half of that at
    PAPER_BETA (the largest beta tried when none is)."""
    return next((b for b in sorted(kls) if kls[b] <= 0.5 * kls[PAPER_BETA]), max(kls))


def curve_table(runs: dict[str, list]) -> str:
    """Held-out accuracy at every evaluation, mean ± std over seeds (the anchor's beside it)."""
    steps = sorted(next(iter(runs.values()))[0].series["eval/accuracy"])
    lines = ["| cell | " + " | ".join(f"step {s}" for s in steps) + " |", "|" + "---|" * (1 + len(steps))]
    for name, members in runs.items():
        for metric, label in [("eval/accuracy", ""), ("eval/anchor/accuracy", " (anchor)")]:
            if metric not in members[0].series:
                continue
            cols = [[r.series[metric].get(s) for r in members] for s in steps]
            cells = [
                f"{statistics.fmean(c):.3f} ± {statistics.stdev(c):.3f}" if None not in c else "-"
                for c in cols
            ]
            lines.append(f"| `{name}`{label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired(results: dict[str, list[dict]], pairs: list[tuple[str, str, str]]) -> str:
    """For each (label, cell a, cell b, figure of a, figure of b): the per-seed difference, its
    mean ± std and the number of seeds where a is ahead."""
    lines = ["| comparison | per seed | mean ± std | ahead |", "|---|---|---|---|"]
    for label, a, b, key_a, key_b in pairs:
        diffs = [x[key_a] - y[key_b] for x, y in zip(results[a], results[b], strict=True)]
        mean, std = statistics.fmean(diffs), statistics.stdev(diffs)
        per_seed = ", ".join(f"{d:+.3f}" for d in diffs)
        lines.append(
            f"| {label} | {per_seed} | {mean:+.3f} ± {std:.3f} | {sum(d > 0 for d in diffs)}/{len(diffs)} |"
        )
    return "\n".join(lines) + "\n"


def grid_time(out: Path, names: list[str]) -> str:
    """What the grid cost, in words: the sum of the runs' own wall times (wall_time.json), and
    which parts of it that sum leaves out (a resumed run records its last part; a diverged run
    records none)."""
    timed = timings(out, names)
    seconds = sum(t["seconds"] for t in timed)
    text = f"the {len(timed)} runs that finished took {seconds:.0f} s, {seconds / 3600:.1f} h, in all"
    resumed, untimed = sum(t["resumed"] for t in timed), len(names) - len(timed)
    text += f"; {resumed} resumed, their earlier parts not counted" if resumed else ""
    return text + (f"; {untimed} stopped (diverged), not timed" if untimed else "")


def load_summary(log: Path) -> str:
    """The machine's load while the grid ran, in words, from the log its runs were started beside
    (a line a minute: the time, then /proc/loadavg's 1-, 5- and 15-minute averages)."""
    if not log.is_file():
        return "no load log beside the runs"
    loads = sorted(float(line.split()[1]) for line in log.read_text().splitlines() if line.strip())
    low, *_, high = statistics.quantiles(loads, n=20, method="inclusive")
    return (
        f"the 1-minute load, logged each minute ({log.name}, {len(loads)} minutes): median"
        f" {statistics.median(loads):.2f}, 5-95% {low:.2f}-{high:.2f}, at most {loads[-1]:.2f}"
    )


def grid(args: argparse.Namespace, base_lr: float, steps: int) -> str:
    if BINDING_BETA is None:
        raise SystemExit("BINDING_BETA is not fixed yet: run --pilot and write its answer in first")
    every = ["train.eval_every=10", "train.save_every=10", *RAN_AS]
    cells = {cell_name(a, ESTIMATOR, b, f) if a != "none" else cell_name(a, "", 0, f):
             [*SHARED, *every, *overrides(a, b, f, steps, base_lr), *args.overrides]
             for a, b, f in grid_cells(BINDING_BETA)}  # fmt: skip
    t0 = time.perf_counter()
    train_all(cells, SEEDS, args.out, args.jobs, args.config)
    names = {name: [f"{name}-seed{s}" for s in range(SEEDS)] for name in cells}
    cost = grid_time(args.out, [r for members in names.values() for r in members])
    results = {name: [summarize(args.out, r) for r in runs] for name, runs in names.items()}
    runs = {name: [load_run(args.out / r) for r in members] for name, members in names.items()}
    for run in runs[cell_name("none", "", 0, 1)]:  # logged a KL of 0.0 (see frontier.summarize): none to draw
        run.series.pop("kl/value", None)
    plot([r for members in runs.values() for r in members], args.png, smooth=5).clf()
    name = {(a, b, f): cell_name(a, ESTIMATOR, b, f) for a, b, f in grid_cells(BINDING_BETA)}
    pairs = [
        (f"ema - frozen, beta {b:g}, lr x{f}", name["ema", b, f], name["frozen", b, f], "final", "final")
        for b, f in [(PAPER_BETA, 1), (BINDING_BETA, 1), (BINDING_BETA, LR_STRESS)]
    ] + [
        (f"frozen beta {BINDING_BETA:g} - no KL", name["frozen", BINDING_BETA, 1], "none-beta0-lr1x", "final", "final"),
        (f"ema beta {BINDING_BETA:g} - no KL", name["ema", BINDING_BETA, 1], "none-beta0-lr1x", "final", "final"),
    ] + [
        (f"ema's anchor - its policy, beta {b:g}, lr x{f}", name["ema", b, f], name["ema", b, f], "anchor_acc", "final")
        for b, f in [(PAPER_BETA, 1), (BINDING_BETA, 1), (BINDING_BETA, LR_STRESS)]
    ]  # fmt: skip
    return (
        "## What the EMA anchor does to a real model (SmolLM2-135M-Instruct, sums)\n\n"
        f"Regenerate with `python benchmarks/frontier_smollm2.py` ({time.perf_counter() - t0:.0f} s of wall"
        f" time for this invocation; finished runs are reused; {cost};"
        f" {load_summary(args.out / 'load.log')}). The pilot's table (`--pilot`) fixed"
        f" kl.beta {BINDING_BETA:g} as the beta where the KL binds. {SEEDS} seeds, {steps} steps a run,"
        " mean ± std over seeds. Columns as in the tiny model's grid above. Picture:"
        f" `benchmarks/{args.png.name}`.\n\n"
        + table(results)
        + "\n### Held-out accuracy at each evaluation\n\n"
        + curve_table(runs)
        + "\n### Paired by seed (final accuracy)\n\n"
        + paired(results, pairs)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pilot", action="store_true", help="run the KL-share pilot and print its table")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    parser.add_argument("--out", type=Path, default=HERE / "frontier_smollm2_runs")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--png", type=Path, default=HERE / "frontier_smollm2.png")
    parser.add_argument("--config", default=CONFIG, help="the base config (another only for a smoke test)")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run (a smoke test's sizes)")
    args = parser.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    if args.pilot:
        print(pilot(args, cfg.optim.lr))
        return
    text = grid(args, cfg.optim.lr, cfg.train.steps)
    write_block(args.results, text, owner="frontier_smollm2.py")
    print(text)


if __name__ == "__main__":
    main()
