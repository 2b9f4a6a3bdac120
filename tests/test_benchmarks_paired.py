"""benchmarks/paired_study.py at a smoke size: its arms on the same seeds, each run in a fresh
process, the paired gains it prints against the runs' own metrics, and finished runs reused."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import FAST, ROOT

# Slow: two training runs, each in a child process.
pytestmark = pytest.mark.slow


def study(out, model_dir) -> str:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "paired_study.py"), "dynamic_sampling", "--seeds", "2",
        "--steps", "3", "--out", str(out), f"model.path={model_dir}", *FAST, "eval.samples=2",
        "train.eval_every=3", "train.threads=1",
    ]  # fmt: skip
    # Time limit: 4 tiny runs of 3 steps; 600 s is far beyond them on a loaded machine.
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout


def gain(run_dir) -> float:
    """Held-out accuracy at the last evaluation minus the first, from metrics.jsonl itself."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    return accuracy[max(accuracy)] - accuracy[min(accuracy)]


def test_paired_study_pairs_arms_by_seed_and_reuses_runs(tmp_path, tiny_model_dir):
    out = tmp_path / "runs"
    first = study(out, tiny_model_dir)
    # Seed-major: every arm at seed 0 before any at seed 1.
    trained = re.findall(r"^(\w+-seed\d): \d+ s$", first, flags=re.M)
    assert trained == ["default-seed0", "dynamic-seed0", "default-seed1", "dynamic-seed1"]
    for seed in (0, 1):
        configs = [
            yaml.safe_load((out / f"{arm}-seed{seed}" / "config.yaml").read_text())
            for arm in ("default", "dynamic")
        ]
        assert [c["train"]["seed"] for c in configs] == [seed, seed]
        assert [c["algo"]["dynamic_sampling"] for c in configs] == [False, True]
    line = next(
        line for line in first.splitlines() if line.strip().startswith("dynamic ") and "minus default" in line
    )
    printed = [float(d) for d in re.search(r"minus default: ([^(]+) \(", line).group(1).split(", ")]
    expected = [gain(out / f"dynamic-seed{s}") - gain(out / f"default-seed{s}") for s in (0, 1)]
    assert printed == pytest.approx(expected, abs=5e-4)  # printed to 3 decimals
    # Run again: every run is reused, nothing trains, the same table comes out.
    second = study(out, tiny_model_dir)
    assert not re.findall(r"-seed\d: \d+ s$", second, flags=re.M)
    table = [text[text.index("| config") : text.index("wall time per run")] for text in (first, second)]
    assert table[0] == table[1]


POOL_SCRIPT = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from study import run_pool

if __name__ == "__main__":
    pool = run_pool(1)
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 300)  # a run training on
    time.sleep(300)
"""


def test_a_killed_study_takes_its_runs_with_it(tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(ROOT / "benchmarks")], stdout=subprocess.PIPE, text=True
    )
    worker = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    # Hang limit: the worker is SIGKILLed as its parent dies; without that it would sleep 300 s.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{worker}").exists() and not zombie(worker):
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists() or zombie(worker)


def zombie(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False
