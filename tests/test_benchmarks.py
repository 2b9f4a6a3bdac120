"""benchmarks/frontier.py at a smoke size: the grid, its table, and every finished run reused.
(The collapse flag it reports: tests/eval/test_report.py.)"""

import subprocess
import sys

import pytest

from helpers import ROOT

# Slow: benchmarks/frontier.py trains 9 runs in child processes (91 s measured at load 3-4).
pytestmark = pytest.mark.slow


def frontier(tmp_path, model_dir):
    command = [
        sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--seeds", "1", "--steps", "20",
        "--betas", "0.1", "--anchors", "frozen", "ema", "--estimators", "topk", "--lr-factors", "3",
        "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "RESULTS.md"), "--png", str(tmp_path / "f.png"),
        f"model.path={model_dir}", "task.num_train=64", "task.num_eval=8", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=5", "algo.micro_batch_size=16", "eval.samples=2",
        "train.threads=1", "train.tensorboard=false",
    ]  # fmt: skip
    # Time limit: the test (two runs of frontier.py) measured 91 s at load 3-4; 600 s is x6.6.
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout


def rows(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| `")
    ]


def test_frontier_smoke_grid_table_and_reuse(tmp_path, tiny_model_dir):
    first = frontier(tmp_path, tiny_model_dir)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "<!-- frontier.py writes from here" in text and (tmp_path / "f.png").stat().st_size > 0
    names = [r[0].strip("`") for r in rows(text)]
    # The grid (2 anchors x 1 beta x 1 estimator, and no KL), then the lr stress: each anchor's
    # best cell and no KL at lr x1, and the same at x3.
    grid = ["frozen-topk-beta0.1-lr1x", "ema-topk-beta0.1-lr1x", "none-beta0-lr1x"]
    stress = ["frozen-topk-beta0.1-lr3x", "ema-topk-beta0.1-lr3x", "none-beta0-lr3x"]
    assert names == grid + grid + stress
    assert all(len(r) == 9 for r in rows(text))
    ema = rows(text)[1]
    assert ema[3] != "-" and rows(text)[0][3] == "-"  # the anchor's accuracy: where the anchor moves
    assert "| topk, 0.1 | " in text  # the paired difference against the frozen anchor
    trained = [line for line in first.splitlines() if line.endswith(" s") and "-seed0:" in line]
    assert len(trained) == 6
    assert not list((tmp_path / "runs").glob("*/checkpoints"))  # the tables read the metrics only
    # Run again: every finished run is reused, nothing trains, the same table comes out.
    metrics = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    second = frontier(tmp_path, tiny_model_dir)
    assert not [line for line in second.splitlines() if "-seed0:" in line]
    assert {p: p.stat().st_mtime_ns for p in metrics} == metrics
    assert rows((tmp_path / "RESULTS.md").read_text()) == rows(text)
