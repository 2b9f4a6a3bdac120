"""benchmarks/frontier.py at a smoke size, and the collapse flag on made-up curves."""

import subprocess
import sys
from pathlib import Path

import pytest

from emapg.eval.report import Run, collapse

ROOT = Path(__file__).resolve().parents[1]


def made_up(accuracy: list[float], entropy: float = 0.3) -> Run:
    steps = range(0, 10 * len(accuracy), 10)
    return Run(
        "r",
        "r",
        {
            "eval/accuracy": dict(zip(steps, accuracy, strict=True)),
            "entropy": {s: entropy for s in range(100)},
        },
    )


@pytest.mark.parametrize(
    "accuracy,entropy,want",
    [
        ([0.3, 0.5, 0.6, 0.14], 0.3, "accuracy"),  # rose, then fell below half its start (0.15)
        ([0.3, 0.5, 0.6, 0.16], 0.3, None),  # fell, but not below the floor
        ([0.3, 0.2, 0.1, 0.05], 0.3, "accuracy"),  # never rose, only degraded: collapsed too
        ([0.3, 0.2, 0.25, 0.2], 0.3, None),  # did not learn, and stayed above the floor
        ([0.3, 0.5, 0.6, 0.7], 0.005, "entropy"),
        ([0.3, 0.5, 0.6, 0.7], 0.3, None),
    ],
)
def test_collapse_flag(accuracy, entropy, want):
    assert collapse(made_up(accuracy, entropy)) == want


def test_entropy_collapse_is_a_trailing_mean():
    run = made_up([0.3, 0.5])
    run.series["entropy"] = {s: 0.3 for s in range(100)} | {50: 0.0}  # one low step is not a collapse
    assert collapse(run) is None


def frontier(tmp_path, model_dir):
    command = [
        sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--seeds", "1", "--steps", "20",
        "--betas", "0.1", "--anchors", "frozen", "ema", "--estimators", "topk", "--lr-factors", "3",
        "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "RESULTS.md"), "--png", str(tmp_path / "f.png"),
        f"model.path={model_dir}", "task.num_train=64", "task.num_eval=8", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=5", "algo.micro_batch_size=16", "eval.samples=2",
        "train.threads=1", "train.tensorboard=false",
    ]  # fmt: skip
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
    # Run again: every finished run is reused, nothing trains, the same table comes out.
    metrics = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    second = frontier(tmp_path, tiny_model_dir)
    assert not [line for line in second.splitlines() if "-seed0:" in line]
    assert {p: p.stat().st_mtime_ns for p in metrics} == metrics
    assert rows((tmp_path / "RESULTS.md").read_text()) == rows(text)
