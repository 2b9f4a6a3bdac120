"""The GRPO vs EMA-PG study: four configs x several seeds on the built-in tasks, equal budgets.

    python benchmarks/study.py [--tasks arithmetic search] [--seeds 3] [--steps N] [--jobs J] [key=value ...]

Configs (the ablation of EMA-PG's two parts, everything else equal):
  grpo       frozen anchor + k3           ema_only   EMA anchor + k3
  topk_only  frozen anchor + top-k KL     ema_pg     EMA anchor + top-k KL
with beta 1e-3, k 32, eta 0.9 every 10 steps. Runs go to benchmarks/study_runs/<task>-<config>-seedN
(a finished run is reused, so an interrupted study picks up where it stopped; one trained under
other settings than the study now asks for stops the study, named, instead). Writes its block of
benchmarks/RESULTS.md (per task: `emapg report`'s table, wall time per run; the rest of that file
is left alone) and benchmarks/study_<task>.png. `--jobs 2 train.threads=1` trains two
runs at once, one thread each (on 2 cores that finishes the study in about half the time; wall
times per run are then those of a run sharing the machine).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from emapg.eval.report import load_run, plot, summary_table
from emapg.training import run_folder
from emapg.training.checkpoint import list_checkpoints
from emapg.training.config import load_config
from emapg.training.loop import train

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "grpo": ["anchor.kind=frozen", "kl.estimator=k3"],
    "ema_only": ["anchor.kind=ema", "kl.estimator=k3"],
    "topk_only": ["anchor.kind=frozen", "kl.estimator=topk"],
    "ema_pg": ["anchor.kind=ema", "kl.estimator=topk"],
}
SHARED = ["kl.beta=0.001", "kl.k=32", "kl.direction=reverse", "kl.importance_weight=true",
          "anchor.eta=0.9", "anchor.update_period=10"]  # fmt: skip
# benchmarks/RESULTS.md holds other measurements too: each script rewrites only its own block.
OWNER = "study.py"
# Per task: base config, and the held-out accuracy whose first crossing is reported.
TASKS = {"arithmetic": ("quickstart", 0.4), "search": ("search_tiny", 0.5)}  # search: warm start ~0.44


def run_one(name: str, base: str, overrides: list[str], out: Path, keep_checkpoints: bool = True) -> float:
    """Train run `name` (config `base` with `overrides`) under `out` unless it already finished;
    a run stopped part-way resumes from its last checkpoint (either only under the settings it was
    trained with: check_same_settings). Returns its wall time in seconds (0: reused; a resumed
    run's is that of its last part, marked in wall_time.json).
    keep_checkpoints=False deletes a finished run's checkpoints (a real model's take GBs each):
    wall_time.json's `steps` then says it finished."""
    cfg = load_config(
        base, [*overrides, f"train.name={name}", f"train.output_dir={out}", "train.progress=false"]
    )
    check_same_settings(out / name, cfg.model_dump())
    done = list_checkpoints(out / name / "checkpoints")
    timing = out / name / "wall_time.json"
    finished = timing.is_file() and json.loads(timing.read_text()).get("steps") == cfg.train.steps
    if finished or (done and done[-1].name == f"step_{cfg.train.steps}"):
        return 0.0
    t0 = time.perf_counter()
    train(cfg, resume=bool(done))
    seconds = time.perf_counter() - t0
    timing.write_text(
        json.dumps({"seconds": round(seconds, 1), "resumed": bool(done), "steps": cfg.train.steps})
    )
    if not keep_checkpoints:
        shutil.rmtree(out / name / "checkpoints")
    print(f"{name}: {seconds:.0f} s", flush=True)
    return seconds


def timings(out: Path, names: list[str]) -> list[dict]:
    """The wall_time.json of each named run that has one (as run_one wrote it; a run stopped
    before it finished has none)."""
    files = (out / name / "wall_time.json" for name in names)
    return [json.loads(f.read_text()) for f in files if f.is_file()]


# Where a run's folder is and how it reports: a grid's folder may be moved and still reused.
PLACE = {"train.output_dir", "train.progress"}


def check_same_settings(run_dir: Path, config: dict) -> None:
    """Stop before reusing or resuming a run made under other settings than the study now asks for
    (a grid or base config edited since): its figures would be reported under the new ones."""
    if not (run_dir / run_folder.CONFIG).is_file():
        return  # not started (or stopped before its first file): it trains from the start
    changed = [
        f"{key}: {old!r} -> {new!r}"
        for key, old, new in run_folder.config_changes(run_folder.saved_config(run_dir), config)
        if key not in PLACE
    ]
    if changed:
        raise SystemExit(
            f"{run_dir} was trained under other settings than asked for now ({'; '.join(changed)}): "
            "delete it (or pass another --out) to train it afresh"
        )


def run_pool(jobs: int) -> ProcessPoolExecutor:
    """`jobs` spawned worker processes that die with this one: a study stopped by a signal leaves no
    run training on (and writing into its run folder) behind it. Create it from the main thread:
    Linux's parent-death signal follows the thread that started the worker."""
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(jobs, mp_context=spawn, initializer=_die_with, initargs=(os.getpid(),))


def _die_with(parent: int) -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)


def write_block(path: Path, block: str, owner: str = OWNER) -> str:
    """Replace `owner`'s block of `path` (between its two markers), or append it; returns the text."""
    begin, end = (
        f"<!-- {owner} writes from here: do not edit by hand -->",
        f"<!-- {owner} writes up to here -->",
    )
    marked = f"{begin}\n{block.rstrip()}\n{end}"
    old = path.read_text() if path.is_file() else "# Results\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        text = head + marked + rest.split(end, 1)[1]
    else:
        text = old.rstrip("\n") + "\n\n" + marked + "\n"
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps per run (default: the base config's)")
    parser.add_argument("--out", type=Path, default=HERE / "study_runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_intermixed_args()

    sections = []
    for task in args.tasks:
        base, threshold = TASKS[task]
        grid = [(variant, seed) for variant in VARIANTS for seed in range(args.seeds)]
        names = [f"{task}-{variant}-seed{seed}" for variant, seed in grid]
        budget = [f"train.steps={args.steps}"] if args.steps else []
        with run_pool(args.jobs) as pool:
            futures = [
                pool.submit(
                    run_one,
                    name,
                    base,
                    [*SHARED, *VARIANTS[v], f"train.seed={s}", *budget, *args.overrides],
                    args.out,
                )  # fmt: skip
                for name, (v, s) in zip(names, grid, strict=True)
            ]
            for future in futures:
                future.result()  # re-raises a run's error
        runs = [load_run(args.out / n) for n in names]
        walls = [t["seconds"] for t in timings(args.out, names)] or [0.0]
        png = HERE / f"study_{task}.png"
        plot(runs, png)
        steps = max(runs[0].series["eval/accuracy"])
        sections.append(
            f"### {task} (base config `{base}`, {steps} steps, {args.seeds} seeds)\n\n"
            f"{summary_table(runs, threshold)}\n"
            f"Wall time per run, warm start included: {min(walls):.0f}-{max(walls):.0f} s on this machine. "
            f"Curves: `benchmarks/{png.name}`.\n"
        )
    command = "python benchmarks/study.py " + " ".join(
        [f"--tasks {' '.join(args.tasks)}", f"--seeds {args.seeds}"]
        + ([f"--steps {args.steps}"] if args.steps else [])
        + ([f"--jobs {args.jobs}"] if args.jobs > 1 else [])
        + args.overrides
    )
    text = (
        "## GRPO vs EMA-PG: the study\n\n"
        f"Regenerate with `{command}`. Mean ± std over seeds of held-out accuracy (pass@1) at the\n"
        "first and last evaluation, reward and KL averaged over the last 10 steps, and the first\n"
        "evaluation step reaching the threshold.\n\n" + "\n".join(sections)
    )
    write_block(HERE / "RESULTS.md", text)
    print(text)


if __name__ == "__main__":
    main()
