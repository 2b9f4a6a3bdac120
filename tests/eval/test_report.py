"""emapg report (emapg.eval.report): grouping by name, seed alignment, smoothing, the final-figures
table, and the collapse flag on made-up curves."""

from __future__ import annotations

import json

import pytest

from emapg.cli import main
from emapg.errors import EmapgError
from emapg.eval.report import Run, aligned, collapse, group_name, load_run, plot, summary_table


def write_run(root, name, rows):
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def rows(accuracies, rewards, kl=0.01):
    """Eval at steps 0 and 2, a train record at steps 1..len(rewards)."""
    out = [{"step": 0, "eval/accuracy": accuracies[0]}]
    for step, reward in enumerate(rewards, 1):
        record = {"step": step, "reward/mean": reward, "kl/value": kl * step, "entropy": 1.0}
        if step == 2:
            record["eval/accuracy"] = accuracies[1]
        out.append(record)
    return out


def test_group_names_drop_the_seed_suffix_only():
    assert group_name("grpo-seed3") == group_name("grpo_seed12") == group_name("grpo-s0") == "grpo"
    assert group_name("ema_pg") == "ema_pg"
    assert group_name("seeds-seedling") == "seeds-seedling"


def test_table_means_and_stds_over_seeds(tmp_path):
    a = load_run(write_run(tmp_path, "grpo-seed0", rows([0.2, 0.5], [0.1, 0.3])))
    b = load_run(write_run(tmp_path, "grpo-seed1", rows([0.4, 0.7], [0.3, 0.5])))
    c = load_run(write_run(tmp_path, "ema", rows([0.2, 0.3], [0.2, 0.2])))
    table = summary_table([a, b, c], threshold=0.5, window=2).splitlines()
    # grpo: before (0.2, 0.4) -> 0.300 ± 0.141; after (0.5, 0.7) -> 0.600 ± 0.141;
    # reward mean of the last 2 steps: 0.2 and 0.4 -> 0.300 ± 0.141; KL 0.015 both; both reach 0.5 at step 2.
    assert (
        table[2] == "| grpo | 2 | 0.300 ± 0.141 | 0.600 ± 0.141 | 0.300 ± 0.141 | 0.0150 ± 0.0000 | 2 ± 0 |"
    )
    assert table[3] == "| ema | 1 | 0.200 | 0.300 | 0.200 | 0.0150 | never |"


def test_partial_threshold_says_how_many_reached(tmp_path):
    a = load_run(write_run(tmp_path, "x-s0", rows([0.2, 0.6], [0.1, 0.3])))
    b = load_run(write_run(tmp_path, "x-s1", rows([0.2, 0.4], [0.1, 0.3])))
    assert summary_table([a, b], threshold=0.5).splitlines()[2].endswith("| 2 (1/2 reached) |")


def test_a_run_short_of_its_configs_steps_is_marked_unfinished(tmp_path):
    """A crashed or still-running run's last evaluation is not its final accuracy: the table says
    so in its group's row and names it, with the step it reached, under the table."""
    done = write_run(tmp_path, "x-s0", rows([0.2, 0.6], [0.1, 0.3]))
    running = write_run(tmp_path, "x-s1", rows([0.2, 0.4], [0.1, 0.3]))
    for run, steps in [(done, 2), (running, 30)]:
        (run / "config.yaml").write_text(f"train:\n  steps: {steps}\n")
    table = summary_table([load_run(done), load_run(running)]).splitlines()
    assert table[2].startswith("| x | 2 | 0.200 ± 0.000 | 0.500 ± 0.141 (1/2 unfinished) |")
    assert table[-1] == "Unfinished, so their figures are those of the step reached: x-s1 (step 2 of 30)."
    assert "nfinished" not in summary_table([load_run(done)])


def test_a_run_still_short_of_its_steps_has_not_reached_the_threshold_yet(tmp_path):
    """Below the threshold at its last evaluation, a finished run never reached it; an unfinished
    one has not reached it yet, and the steps-to column says which (it read "never" for both)."""
    reached = write_run(tmp_path, "x-s0", rows([0.2, 0.6], [0.1, 0.3]))
    running = write_run(tmp_path, "x-s1", rows([0.2, 0.4], [0.1, 0.3]))
    done_below = write_run(tmp_path, "y-s0", rows([0.2, 0.4], [0.1, 0.3]))
    for run, steps in [(reached, 2), (running, 30), (done_below, 2)]:
        (run / "config.yaml").write_text(f"train:\n  steps: {steps}\n")
    both = summary_table([load_run(reached), load_run(running)], threshold=0.5).splitlines()[2]
    assert both.endswith("| 2 (1/2 reached, 1/2 unfinished) |")
    alone = summary_table([load_run(running), load_run(done_below)], threshold=0.5).splitlines()
    assert alone[2].endswith("| not yet (1/1 unfinished) |")
    assert alone[3].endswith("| never |")


def test_a_run_that_logged_no_step_yet_shows_a_dash_not_nan(tmp_path):
    """Just started (only its step-0 evaluation): no reward or KL yet, so "-", as in the other
    columns (it read "nan"); beside a seed that has logged, the figure is that seed's alone."""
    started = write_run(tmp_path, "x-s0", [{"step": 0, "eval/accuracy": 0.2}])
    assert summary_table([load_run(started)]).splitlines()[2] == "| x | 1 | 0.200 | 0.200 | - | - |"
    logged = write_run(tmp_path, "x-s1", rows([0.2, 0.4], [0.1, 0.3]))
    both = summary_table([load_run(started), load_run(logged)]).splitlines()[2]
    assert both.endswith("| 0.200 | 0.0150 |")


def test_alignment_keeps_common_steps_and_smooths_backwards(tmp_path):
    a = load_run(write_run(tmp_path, "g-s0", rows([0, 0], [1.0, 2.0, 3.0])))
    b = load_run(write_run(tmp_path, "g-s1", rows([0, 0], [5.0, 7.0])))
    steps, values = aligned([a, b], "reward/mean", smooth=2)
    assert steps == [1, 2]
    assert values == [[1.0, 1.5], [5.0, 6.0]]


@pytest.mark.slow
def test_plot_draws_the_mean_of_each_group(tmp_path):
    a = load_run(write_run(tmp_path, "g-s0", rows([0.2, 0.4], [1.0, 2.0])))
    b = load_run(write_run(tmp_path, "g-s1", rows([0.4, 0.8], [3.0, 4.0])))
    fig = plot([a, b], tmp_path / "r.png", smooth=1)
    reward_ax, accuracy_ax = fig.axes[0], fig.axes[1]
    assert list(reward_ax.get_lines()[0].get_ydata()) == [2.0, 3.0]
    assert list(accuracy_ax.get_lines()[0].get_xdata()) == [0, 2]
    assert list(accuracy_ax.get_lines()[0].get_ydata()) == pytest.approx([0.3, 0.6])
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_cli_writes_png_and_table(tmp_path, capsys):
    run = write_run(tmp_path, "only", rows([0.1, 0.2], [0.5, 0.5]))
    out = tmp_path / "out" / "report.png"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert out.is_file()
    assert (tmp_path / "out" / "report.md").read_text() in capsys.readouterr().out


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().endswith("no metrics.jsonl (is this a run directory?)")
    run = write_run(tmp_path, "torn", [{"step": 0}])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "rew')
    with pytest.raises(EmapgError, match=r"metrics.jsonl:2: not a JSON object"):
        load_run(run)
    write_run(tmp_path, "other", [{"step": 0}])
    assert main(["report", str(tmp_path)]) == 2  # the output folder given for its runs
    assert capsys.readouterr().err.strip().endswith(f"a folder of 2 runs: give them as {tmp_path}/*")


@pytest.mark.slow
def test_off_policy_figures_show_only_where_runs_log_them(tmp_path):
    """Runs with a recomputed pi_old log mismatch/kl and the correction's masked share: the table
    gains a column (mean of the last steps; "-" for a group without it) and the plot two panels."""
    plain = load_run(write_run(tmp_path, "hf", rows([0.2, 0.5], [0.1, 0.3])))
    logged = rows([0.2, 0.5], [0.1, 0.3])
    for r, value in zip(logged[1:], (2e-4, 4e-4), strict=True):
        r |= {"mismatch/kl": value, "rollout_correction/masked_frac": 0.0}
    vllm = load_run(write_run(tmp_path, "vllm", logged))
    assert "mismatch" not in summary_table([plain])
    table = summary_table([plain, vllm], window=2).splitlines()
    assert table[0].endswith("| mismatch KL (last) |")
    assert table[2].endswith("| - |") and table[3].endswith("| 0.000300 |")
    assert len(plot([plain], tmp_path / "a.png").axes) == 5
    fig = plot([plain, vllm], tmp_path / "b.png", smooth=1)
    assert [ax.get_title() for ax in fig.axes][5:] == [
        "engine/trainer KL (mu vs pi_old)",
        "tokens masked by the correction",
    ]
    assert list(fig.axes[5].get_lines()[0].get_ydata()) == pytest.approx([2e-4, 4e-4])


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
