"""docs/custom-tasks.md: its example files are the shipped ones, and its command runs and
prints and logs what the page says."""

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from emapg import cli
from emapg.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "custom-tasks.md").read_text()
EXAMPLE = ROOT / "examples" / "custom_task"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, flags=re.S)


def test_the_page_shows_the_shipped_files():
    assert blocks("yaml")[0] == (EXAMPLE / "config.yaml").read_text()
    assert blocks("python")[0].strip() in (EXAMPLE / "rewards.py").read_text()
    first = (EXAMPLE / "train.jsonl").read_text().splitlines()[:2]
    assert blocks("json")[0].splitlines() == first
    counts = [len((EXAMPLE / f).read_text().splitlines()) for f in ("train.jsonl", "eval.jsonl")]
    assert f"({counts[0]} training and {counts[1]} evaluation records)" in PAGE


@pytest.mark.slow
def test_the_example_command_runs_and_prints_and_logs_what_the_page_says(tmp_path, monkeypatch, capsys):
    (command,) = [
        line for b in blocks("bash") for line in b.splitlines() if "custom_task/config.yaml" in line
    ]
    argv = shlex.split(command)
    assert argv[:2] == ["emapg", "train"]
    expected = re.search(r"^eval/accuracy .*$", PAGE, flags=re.M)[0]  # the line the page shows
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root
    code = cli.main(
        [
            *argv[1:],
            f"train.output_dir={tmp_path}",
            f"warmstart.cache_dir={tmp_path / 'cache'}",
            "train.progress=false",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    form = re.escape(expected)
    for figure in re.findall(r"[+-]?\d+\.\d{3}", expected):  # the figures vary by machine; the form does not
        form = form.replace(re.escape(figure), r"[+-]?\d+\.\d{3}", 1)
    form = form.replace(re.escape("runs/custom_task"), re.escape(str(tmp_path / "custom_task")))
    assert re.fullmatch(form, printed), (printed, expected)
    assert "%" not in printed  # a mean of weighted rewards is not a percentage

    run = tmp_path / "custom_task"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(9))
    for r in records[1:]:
        assert {
            "reward/mean",
            "reward/exact/mean",
            "reward/digits/mean",
            "reward/errors",
            "reward/timeouts",
        } <= set(r)
    for r in (records[0], records[4], records[8]):
        assert {"eval/accuracy", "eval/reward/exact/mean", "eval/reward/digits/mean"} <= set(r)
    # Each logged reward is exact + 0.5 * digits, digits left out where it abstained.
    spec = importlib.util.spec_from_file_location("doc_rewards", EXAMPLE / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        exact = rewards.exact([s["prompt"]], [s["response"]], [s["answer"]])[0]
        digits = rewards.digits([s["prompt"]], [s["response"]], [s["answer"]])[0]
        assert abs(s["reward"] - (exact + 0.5 * (digits or 0.0))) < 1e-9


@pytest.fixture
def sums_commands(monkeypatch):
    """The page's two commands for the task with its own settings; what `--import` registers is
    gone after the test."""
    monkeypatch.chdir(ROOT)
    commands = [shlex.split(line) for b in blocks("bash") for line in b.splitlines() if "sums.py" in line]
    with TASKS.registered("sums", lambda cfg: None):
        yield commands
    sys.modules.pop("sums", None)


def test_the_page_shows_the_shipped_task_with_its_own_settings():
    assert (EXAMPLE / "sums.py").read_text() in blocks("python")


@pytest.mark.slow
def test_a_task_with_its_own_settings_is_set_from_the_command_line_and_trains(
    sums_commands, tmp_path, tiny_model_dir, capsys
):
    from helpers import FAST

    train, _ = sums_commands
    assert train[:2] == ["emapg", "train"] and "task.terms=3" in train
    fast = [f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", *FAST, "train.name=sums"]
    assert cli.main([*train[1:], *fast, "train.steps=2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"run: {tmp_path / 'sums'}")
    saved = (tmp_path / "sums" / "config.yaml").read_text()
    assert "name: sums" in saved and "terms: 3" in saved
    records = [json.loads(line) for line in (tmp_path / "sums" / "samples.jsonl").read_text().splitlines()]
    assert all(r["prompt"].count("+") == 2 for r in records)  # three terms per problem


def test_a_bad_value_of_its_own_setting_stops_with_the_line_the_page_shows(sums_commands, capsys):
    _, bad = sums_commands
    assert cli.main(bad[1:]) == 2
    shown = re.search(r"^# (emapg: error: task\.terms.*)$", PAGE, flags=re.M)[1]
    assert capsys.readouterr().err.strip() == shown
