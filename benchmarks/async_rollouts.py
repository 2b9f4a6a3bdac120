"""Sync against async rollouts on this machine: training steps per second, and held-out accuracy
after a fixed wall time, on paired seeds.

    python benchmarks/async_rollouts.py [--config quickstart] [--seconds 60] [--seeds 1 2 3]
                                        [--staleness 1] [key=value ...]

Each run is `emapg train --config CONFIG` (built-in tiny model; its warm start and caches built
first, by a run of zero steps), in its own process, killed --seconds after it started (start-up, the step-0 evaluation
and checkpoints count: they are the same in both modes but for the workers' start). The two
modes split this machine's cores between them as a user would:

- sync:  one process, train.threads=<cores>, sampling and updating in turn;
- async: the trainer with train.threads=<cores/2>, one worker with rollout.worker_threads=<cores/2>,
         rollout.max_staleness=--staleness, sampling the next batch while the trainer updates.

Per run: steps done, steps per second of training (steps over the sum of time/step_s, start-up
and evaluations excluded) and per wall second, the trainer's mean wait for its batch, and the
held-out accuracy of the last checkpoint written in the time (train.save_every=--save-every, so
it lags the last step by less than that), evaluated afterwards as the run would (`emapg eval
--run`). Modes alternate, their order swapped from seed to seed. A seed fixes the warm start's
data, the prompts and the noise alike in both modes, so runs are paired; the paired differences
are printed with their mean and standard deviation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emapg.training.checkpoint_eval import evaluate_checkpoint

HERE = Path(__file__).resolve().parent
OUT = HERE / "async_runs"  # run directories (a run replaces the last one of its name)


def modes(cores: int, staleness: int) -> dict[str, list[str]]:
    half = max(cores // 2, 1)
    return {
        "sync": [f"train.threads={cores}"],
        "async": [f"train.threads={half}", "rollout.mode=async", f"rollout.worker_threads={half}",
                  f"rollout.max_staleness={staleness}"],
    }  # fmt: skip


def run(name: str, seed: int, seconds: float, args: list[str], extra: list[str]) -> dict:
    """One run, killed after `seconds`; its figures."""
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's later checkpoints must not count
    cmd = [sys.executable, "-m", "emapg", "train", *extra, f"train.output_dir={OUT}", f"train.name={name}",
           f"train.seed={seed}", "train.steps=100000", "train.eval_every=100000", "train.progress=false",
           "train.tensorboard=false", *args]  # fmt: skip
    started = time.monotonic()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        process.wait(timeout=seconds)
        raise SystemExit(f"{name} ended before {seconds} s: {process.stderr.read().decode()[-2000:]}")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the trainer and its workers
        process.wait()
    wall = time.monotonic() - started
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    steps = [s for s in steps if "time/step_s" in s]
    result = evaluate_checkpoint(str(out), None)
    return {
        "steps": len(steps),
        "steps_per_s": len(steps) / sum(s["time/step_s"] for s in steps),
        "steps_per_wall_s": len(steps) / wall,
        "wait_s": statistics.mean(s.get("time/wait_for_rollout_s", 0.0) for s in steps),
        "checkpoint": result["checkpoint"],
        "accuracy": result["accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="quickstart", help="the runs' config (a shipped name or a file)")
    parser.add_argument("--seconds", type=float, default=60.0, help="wall time of each run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness of the async runs")
    parser.add_argument("--save-every", type=int, default=10, help="train.save_every of every run")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the two modes split")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="for every run (e.g. task.num_eval=400)"
    )
    args = parser.parse_intermixed_args()
    config = ["--config", args.config]
    extra = [*config, f"train.save_every={args.save_every}", "train.keep_checkpoints=1", *args.overrides]
    # Zero steps first: the warm start and every cache (a search index) are built outside the runs.
    with tempfile.TemporaryDirectory() as scratch:  # a zero-step run: nothing of it is kept
        warm = [sys.executable, "-m", "emapg", "train", *extra, f"train.output_dir={scratch}", "train.name=warm",
                "train.steps=0", "train.progress=false", "train.tensorboard=false"]  # fmt: skip
        subprocess.run(warm, check=True, stdout=subprocess.DEVNULL)
    print(f"load before: {os.getloadavg()[0]:.2f}; {args.cores} cores; {args.seconds:g} s per run")
    arms = modes(args.cores, args.staleness)
    results: dict[str, dict[int, dict]] = {m: {} for m in arms}
    for i, seed in enumerate(args.seeds):
        for mode in list(arms)[:: 1 if i % 2 == 0 else -1]:
            got = results[mode][seed] = run(f"{mode}-seed{seed}", seed, args.seconds, arms[mode], extra)
            print(f"seed {seed} {mode:5s}: {got['steps']} steps, {got['steps_per_s']:.2f} steps/s of training, "
                  f"{got['steps_per_wall_s']:.2f} per wall s, wait {got['wait_s']:.3f} s, "
                  f"accuracy {got['accuracy']:.4f} ({Path(got['checkpoint']).name})", flush=True)  # fmt: skip
    print(f"load after: {os.getloadavg()[0]:.2f}")
    for key, label in (("steps_per_s", "steps/s of training"), ("steps_per_wall_s", "steps per wall s"),
                       ("accuracy", "held-out accuracy")):  # fmt: skip
        diffs = [results["async"][s][key] - results["sync"][s][key] for s in args.seeds]
        ratios = [results["async"][s][key] / results["sync"][s][key] for s in args.seeds]
        spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        print(
            f"{label}: sync {statistics.mean(results['sync'][s][key] for s in args.seeds):.4f}, "
            f"async {statistics.mean(results['async'][s][key] for s in args.seeds):.4f}; "
            f"async - sync paired {statistics.mean(diffs):+.4f} ± {spread:.4f}; "
            f"async / sync {statistics.median(ratios):.3f} (median)"
        )


if __name__ == "__main__":
    main()
