"""`emapg report`: learning curves of several runs on shared axes and a table of final figures.

Runs are grouped by name: `grpo-seed0`, `grpo-seed1` ... form the group `grpo` (a trailing
`-seedN` / `_seedN` / `-sN` is dropped), so seeds of one config show as a mean with a band
(min to max over seeds). Curves are read from each run's metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from emapg.errors import EmapgError

CURVES = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "held-out accuracy"),
    ("kl/value", "KL to the anchor"),
    ("entropy", "entropy"),
    ("response_length/mean", "response length"),
    # Runs whose pi_old is recomputed (an engine other than the policy: docs/design.md, section 7)
    ("mismatch/kl", "engine/trainer KL (mu vs pi_old)"),
    ("rollout_correction/masked_frac", "tokens masked by the correction"),
)
OPTIONAL = {"mismatch/kl", "rollout_correction/masked_frac"}  # drawn only where some run logs them
ANCHOR_ACCURACY = "eval/anchor/accuracy"  # the anchor evaluated as a model (eval.anchor)
_SEED_SUFFIX = re.compile(r"[-_](seed|s)\d+$")


@dataclass
class Run:
    name: str
    group: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> step -> value
    planned: int | None = None  # train.steps of its config.yaml (None: the run has none)

    @property
    def last_step(self) -> int:
        return max((s for series in self.series.values() for s in series), default=0)

    @property
    def unfinished(self) -> bool:
        """Stopped (or still running) before its config's last step: its figures are not final."""
        return self.planned is not None and self.last_step < self.planned


def group_name(run_name: str) -> str:
    return _SEED_SUFFIX.sub("", run_name)


def load_run(run_dir: str | Path) -> Run:
    """A run's metrics by step, and the steps its config planned; a torn or unreadable line is a
    clear error, not a silent gap."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        runs = len(list(Path(run_dir).glob("*/metrics.jsonl")))
        if runs:  # the output folder, not one run in it
            raise EmapgError(
                f"{run_dir}: no metrics.jsonl; a folder of {runs} run{'s' * (runs > 1)}: give them as {run_dir}/*"
            )
        raise EmapgError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    name = Path(run_dir).resolve().name
    config = Path(run_dir) / "config.yaml"
    planned = (
        (yaml.safe_load(config.read_text()) or {}).get("train", {}).get("steps") if config.is_file() else None
    )
    run = Run(name=name, group=group_name(name), planned=planned)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise EmapgError(f"{path}:{number}: not a JSON object") from None
        step = record.get("step")
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                run.series.setdefault(key, {})[step] = float(value)
    return run


def aligned(runs: list[Run], metric: str, smooth: int = 1) -> tuple[list[int], list[list[float]]]:
    """Steps every run of the group logged `metric` at, and each run's values there.

    `smooth` > 1 replaces each value by the mean of the last `smooth` logged values (trailing
    window, so a curve never looks ahead)."""
    present = [r.series[metric] for r in runs if metric in r.series]
    if len(present) < len(runs) or not present:
        return [], []
    steps = sorted(set.intersection(*(set(s) for s in present)))
    values = []
    for series in present:
        ordered = [series[s] for s in sorted(series)]
        index = {s: i for i, s in enumerate(sorted(series))}
        window = max(smooth, 1)
        values.append(
            [statistics.fmean(ordered[max(0, index[s] - window + 1) : index[s] + 1]) for s in steps]
        )
    return steps, values


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _fmt(mean: float, std: float, digits: int, n: int) -> str:
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _last(run: Run, metric: str, window: int) -> float:
    series = run.series.get(metric, {})
    values = [series[s] for s in sorted(series)][-window:]
    return statistics.fmean(values) if values else math.nan


def _final(run: Run, metric: str) -> float:
    """The value at the last step that logged `metric` (NaN: never logged)."""
    series = run.series.get(metric, {})
    return series[max(series)] if series else math.nan


def _fmt_logged(values: list[float], digits: int) -> str:
    """mean ± std over the runs that logged a value ("-": none did)."""
    logged = [v for v in values if not math.isnan(v)]
    return _fmt(*_mean_std(logged), digits, len(logged)) if logged else "-"


def steps_to_threshold(run: Run, threshold: float) -> int | None:
    """First step whose eval/accuracy reaches `threshold` (None: never)."""
    series = run.series.get("eval/accuracy", {})
    return next((s for s in sorted(series) if series[s] >= threshold), None)


ACCURACY_FLOOR = 0.5  # collapse: held-out accuracy below this fraction of its start
ENTROPY_FLOOR = 0.01  # collapse: entropy (nats per token, trailing mean) below this


def collapse(run: Run, window: int = 10) -> str | None:
    """Why the run collapsed, or None: "accuracy" when its held-out accuracy falls below
    ACCURACY_FLOOR times its first evaluation (whether or not it rose first: a run that only
    degrades from its start has collapsed too); "entropy" when its policy entropy, a trailing mean
    over `window` steps, falls below ENTROPY_FLOOR nats per token."""
    acc = run.series.get("eval/accuracy", {})
    steps = sorted(acc)
    if steps and any(acc[s] < ACCURACY_FLOOR * acc[steps[0]] for s in steps[1:]):
        return "accuracy"
    _, entropy = aligned([run], "entropy", window)
    if entropy and min(entropy[0]) < ENTROPY_FLOOR:
        return "entropy"
    return None


def _threshold_cell(members: list[Run], threshold: float) -> str:
    """Mean ± std of the steps to `threshold` over the seeds that reached it. A seed still short
    of its config's last step has not reached it *yet*: it is counted apart, not as "never"."""
    n = len(members)
    steps = {r.name: steps_to_threshold(r, threshold) for r in members}
    reached = [s for s in steps.values() if s is not None]
    pending = sum(r.unfinished and steps[r.name] is None for r in members)
    notes = [f"{len(reached)}/{n} reached"] if reached and len(reached) < n else []
    notes += [f"{pending}/{n} unfinished"] if pending else []
    unmet = "not yet" if pending else "never"
    cell = _fmt(*_mean_std(reached), 0, len(reached)) if reached else unmet
    return f"{cell} ({', '.join(notes)})" if notes else cell


def groups(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.group, []).append(run)
    return out


def summary_table(runs: list[Run], threshold: float | None = None, window: int = 10) -> str:
    """Markdown: per group, mean ± std over seeds of the first and final held-out accuracy, of
    reward and KL (and, where runs log it, the engine/trainer mismatch KL) averaged over the last
    `window` steps, and of the steps to `threshold`. Runs that stopped before their config's
    last step (crashed, or still running) are marked and named under the table."""
    header = ["config", "seeds", "accuracy before", "accuracy after", "reward (last)", "KL (last)"]
    anchored = any(ANCHOR_ACCURACY in r.series for r in runs)
    if anchored:
        header.insert(4, "anchor accuracy after")
    mismatch = any("mismatch/kl" in r.series for r in runs)
    if mismatch:
        header.append("mismatch KL (last)")
    if threshold is not None:
        header.append(f"steps to {threshold:g}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, members in groups(runs).items():
        n = len(members)
        first = [
            r.series["eval/accuracy"][min(r.series["eval/accuracy"])]
            for r in members
            if "eval/accuracy" in r.series
        ]
        final = [
            r.series["eval/accuracy"][max(r.series["eval/accuracy"])]
            for r in members
            if "eval/accuracy" in r.series
        ]
        after = _fmt(*_mean_std(final), 3, n) if final else "-"
        unfinished = sum(r.unfinished for r in members)
        row = [
            name,
            str(n),
            _fmt(*_mean_std(first), 3, n) if first else "-",
            after + (f" ({unfinished}/{n} unfinished)" if unfinished else ""),
            *([_fmt_logged([_final(r, ANCHOR_ACCURACY) for r in members], 3)] if anchored else []),
            _fmt_logged([_last(r, "reward/mean", window) for r in members], 3),
            _fmt_logged([_last(r, "kl/value", window) for r in members], 4),
        ]
        if mismatch:
            row.append(_fmt_logged([_last(r, "mismatch/kl", window) for r in members], 6))
        if threshold is not None:
            row.append(_threshold_cell(members, threshold))
        lines.append("| " + " | ".join(row) + " |")
    stopped = [f"{r.name} (step {r.last_step} of {r.planned})" for r in runs if r.unfinished]
    if stopped:
        lines += [
            "",
            "Unfinished, so their figures are those of the step reached: " + ", ".join(stopped) + ".",
        ]
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], out: str | Path, smooth: int = 5):
    """One panel per curve, groups in shared colours, mean line with a min-max band."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    curves = [(m, t) for m, t in CURVES if m not in OPTIONAL or any(m in r.series for r in runs)]
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4), constrained_layout=True)
    for (metric, title), ax in zip(curves, axes, strict=True):
        for colour, (name, members) in enumerate(groups(runs).items()):
            # The anchor's own accuracy (eval.anchor) dashed beside the policy's, in its colour.
            beside = [(ANCHOR_ACCURACY, "--", f"{name} anchor")] if metric == "eval/accuracy" else []
            for series, style, label in [(metric, "-", f"{name} (n={len(members)})"), *beside]:
                # Evaluation is sparse and already an average: smoothing it would hide its steps.
                steps, values = aligned(members, series, 1 if series.startswith("eval/") else smooth)
                if not steps:
                    continue
                columns = list(zip(*values, strict=True))
                mean = [statistics.fmean(c) for c in columns]
                ax.plot(steps, mean, style, color=f"C{colour}", label=label)
                if len(members) > 1:
                    low, high = [min(c) for c in columns], [max(c) for c in columns]
                    ax.fill_between(steps, low, high, color=f"C{colour}", alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.savefig(out, dpi=120)
    return fig


def report(run_dirs: list[str], out: str | Path, threshold: float | None, smooth: int) -> str:
    """Write the PNG and `<out>.md`; return the markdown table."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise EmapgError("emapg report needs matplotlib: pip install 'emapg[report]'") from None
    if smooth < 1:
        raise EmapgError(f"--smooth must be >= 1, got {smooth}")
    runs = [load_run(d) for d in run_dirs]
    table = summary_table(runs, threshold)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = plot(runs, out, smooth)
    fig.clf()  # free it: pyplot keeps every figure alive until closed
    import matplotlib.pyplot as plt

    plt.close(fig)
    out.with_suffix(".md").write_text(table)
    return table


@dataclass
class FrontierPoint:
    """One config on a frontier picture: its curve (e.g. the anchor), its label (e.g. beta) and
    one (x, y) per seed."""

    curve: str
    label: str
    x: list[float]
    y: list[float]


def plot_frontier(panels: dict[str, list[FrontierPoint]], out: str | Path, xlabel: str, ylabel: str):
    """One panel per key: each curve's points joined in order of x, at their means over seeds with
    error bars of one std in x and y, each labelled; x on a log scale (KLs span decades)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(panels), figsize=(6 * len(panels), 4.5), constrained_layout=True, squeeze=False
    )
    for (title, points), ax in zip(panels.items(), axes[0], strict=True):
        curves: dict[str, list[FrontierPoint]] = {}
        for point in points:
            curves.setdefault(point.curve, []).append(point)
        for colour, (curve, members) in enumerate(curves.items()):
            stats = sorted((*_mean_std(p.x), *_mean_std(p.y), p.label) for p in members)
            xs, xerr, ys, yerr, labels = zip(*stats, strict=True)
            ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, color=f"C{colour}", marker="o", capsize=3, label=curve)
            for x, y, label in zip(xs, ys, labels, strict=True):
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(out, dpi=120)
    plt.close(fig)
