"""benchmarks/frontier_smollm2.py's own figures, on runs made up here: the pilot's rule, the
accuracy curves and the paired differences. (The grid's training, tables and reuse are
benchmarks/frontier.py's, smoke-tested in tests/test_benchmarks.py.)"""

import statistics
import sys

import pytest

from emapg.errors import DivergedError, EmapgError
from emapg.eval.report import Run
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import frontier  # noqa: E402
import frontier_smollm2 as fs  # noqa: E402


def test_pilot_rule_picks_the_smallest_beta_that_halves_the_kl():
    # The pilot's own figures: 0.0690 is 0.83x the paper's beta's, 0.0247 is 0.30x.
    assert fs.binding_beta({1e-3: 0.0829, 1e-2: 0.0826, 1e-1: 0.0690, 1.0: 0.0247}) == 1.0
    assert fs.binding_beta({1e-3: 0.08, 1e-2: 0.04, 1e-1: 0.01, 1.0: 0.001}) == 1e-2  # exactly half binds
    assert fs.binding_beta({1e-3: 0.08, 1e-2: 0.07, 1e-1: 0.06, 1.0: 0.05}) == 1.0  # none: the largest


def run(accuracy: dict[int, float], anchor: dict[int, float] | None = None) -> Run:
    series = {"eval/accuracy": accuracy}
    if anchor is not None:
        series["eval/anchor/accuracy"] = anchor
    return Run(name="r", group="r", series=series)


def test_curve_table_shows_mean_and_std_over_seeds_and_the_anchor_where_it_has_one():
    runs = {
        "frozen": [run({0: 0.1, 10: 0.3}), run({0: 0.2, 10: 0.5})],
        "ema": [run({0: 0.1, 10: 0.4}, {0: 0.1, 10: 0.2}), run({0: 0.3, 10: 0.6}, {0: 0.3, 10: 0.4})],
    }
    lines = fs.curve_table(runs).splitlines()
    assert lines[0] == "| cell | step 0 | step 10 |"
    std = statistics.stdev([0.3, 0.5])
    assert lines[2] == f"| `frozen` | 0.150 ± {statistics.stdev([0.1, 0.2]):.3f} | 0.400 ± {std:.3f} |"
    assert lines[3].startswith("| `ema` | 0.200 ± ") and lines[4].startswith("| `ema` (anchor) | 0.200 ± ")
    assert len(lines) == 5  # no anchor row for the frozen cell


def test_paired_differences_are_per_seed_with_their_spread_and_count():
    results = {
        "a": [{"final": 0.5}, {"final": 0.4}, {"final": 0.7}],
        "b": [{"final": 0.3}, {"final": 0.5}, {"final": 0.6}],
    }
    line = fs.paired(results, [("a - b", "a", "b", "final", "final")]).splitlines()[2]
    diffs = [0.2, -0.1, 0.1]
    mean, std = statistics.fmean(diffs), statistics.stdev(diffs)
    assert line == f"| a - b | +0.200, -0.100, +0.100 | {mean:+.3f} ± {std:.3f} | 2/3 |"
    with pytest.raises(ValueError):  # seeds must pair one to one
        fs.paired({"a": results["a"], "b": results["b"][:2]}, [("a - b", "a", "b", "final", "final")])


def test_grid_time_sums_the_runs_own_wall_times_and_says_what_it_leaves_out(tmp_path):
    for name, timing in [("a", '{"seconds": 1800.0, "resumed": false, "steps": 30}'),
                         ("b", '{"seconds": 1800.0, "resumed": true, "steps": 30}')]:  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "wall_time.json").write_text(timing)
    (tmp_path / "c").mkdir()  # diverged: failed.json, no wall time
    assert fs.grid_time(tmp_path, ["a"]) == "the 1 runs that finished took 1800 s, 0.5 h, in all"
    assert fs.grid_time(tmp_path, ["a", "b", "c"]) == (
        "the 2 runs that finished took 3600 s, 1.0 h, in all; 1 resumed, their earlier parts not"
        " counted; 1 stopped (diverged), not timed"
    )


def test_load_summary_states_the_median_spread_and_peak_of_the_logged_load(tmp_path):
    log = tmp_path / "load.log"
    assert fs.load_summary(log) == "no load log beside the runs"
    loads = [1.0 + i / 100 for i in range(101)]  # 1.00 ... 2.00: the 5% and 95% points are 1.05, 1.95
    log.write_text("".join(f"2026-12-07T01:{i:02d}:02Z {x:.2f} 0.50 0.20\n" for i, x in enumerate(loads)))
    assert fs.load_summary(log) == (
        "the 1-minute load, logged each minute (load.log, 101 minutes): median 1.50, 5-95% 1.05-1.95, at most 2.00"
    )


@pytest.mark.parametrize("error", ["diverged", "disk"])
def test_only_a_diverged_run_is_recorded_as_one(tmp_path, monkeypatch, error):
    def stops(name, base, overrides, out, **options):
        (out / name).mkdir(parents=True)
        raise DivergedError("5 optimiser steps in a row") if error == "diverged" else EmapgError("disk full")

    monkeypatch.setattr(frontier, "run_one", stops)
    if error == "diverged":
        assert frontier.train_cell("c-seed0", [], tmp_path) == 0.0
        assert "5 optimiser steps" in (tmp_path / "c-seed0" / "failed.json").read_text()
    else:  # not a result of the settings: the grid stops, nothing recorded
        with pytest.raises(EmapgError, match="disk full"):
            frontier.train_cell("c-seed0", [], tmp_path)
        assert not (tmp_path / "c-seed0" / "failed.json").exists()
