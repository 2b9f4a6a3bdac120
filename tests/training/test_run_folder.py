"""One run per folder, and --resume under the run's own saved config (issue 40, points 1, 3, 6).

A new run into a folder that holds another run is refused before anything is written; a resumed
run takes its saved config.yaml, the command line's overrides on top, each change printed, and a
change that would make its checkpoint mean something else refused."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from emapg import cli
from emapg.errors import EmapgError
from emapg.training.config import build, load_config
from emapg.training.run_folder import resume_changes, saved_config

RUN = ["task.num_train=16", "task.num_eval=4", "eval.samples=1", "rollout.prompts_per_step=2",
       "rollout.group_size=2", "rollout.max_new_tokens=4", "algo.micro_batch_size=4", "train.progress=false",
       "train.tensorboard=false", "train.eval_every=2", "train.save_every=2", "kl.k=4"]  # fmt: skip


def _args(model_dir, out, *extra):
    return [f"model.path={model_dir}", f"train.output_dir={out}", "train.name=run", *RUN, *extra]


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_second_run_under_the_same_name_is_refused_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=2")]) == 0
    run = tmp_path / "run"
    before = _files(run)
    assert "checkpoints/step_2/state.json" in before

    capsys.readouterr()
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=1", "optim.lr=0.5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0]
    assert "--resume" in err[0] and "train.name" in err[0]
    assert _files(run) == before  # the first run's checkpoints, metrics and config, byte for byte


@pytest.mark.slow
def test_resume_continues_under_the_saved_config_and_lists_each_change(tiny_model_dir, tmp_path, capsys):
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=2", "optim.lr=0.0123")]) == 0
    capsys.readouterr()
    # optim.lr left out: the resumed run keeps the saved 0.0123, not the quickstart's value
    resumed = [f"train.output_dir={tmp_path}", "train.name=run", "train.steps=4", "train.save_every=4"]
    assert cli.main(["train", "--resume", *resumed]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["--resume: train.steps: 2 -> 4", "--resume: train.save_every: 2 -> 4"]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 0.0123 and saved["train"]["steps"] == 4
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize(
    "change", ["train.seed=7", "rollout.group_size=4", "kl.k=8"], ids=["seed", "group", "kl-allowed"]
)
def test_resume_refuses_a_change_that_makes_the_checkpoint_mean_something_else(
    tiny_model_dir, tmp_path, capsys, change
):
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=2")]) == 0
    before = _files(tmp_path / "run")
    capsys.readouterr()
    code = cli.main(
        ["train", "--resume", f"train.output_dir={tmp_path}", "train.name=run", "train.steps=3", change]
    )
    if change == "kl.k=8":  # a KL setting may change mid-run (a schedule by hand): listed, not refused
        assert code == 0 and "--resume: kl.k: 4 -> 8" in capsys.readouterr().out
        return
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and change.split("=")[0] in err[0] and "other settings" in err[0]
    assert _files(tmp_path / "run") == before


def test_resume_of_a_missing_run_names_the_folder(tmp_path, capsys):
    assert cli.main(["train", "--resume", f"train.output_dir={tmp_path}", "train.name=nothing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "nothing" / "config.yaml") in err[0]


def test_resume_changes_ignores_settings_added_since_and_reads_tuples_as_lists():
    saved = {"kl": {"k": 4}, "train": {"steps": 2}}
    config = {"kl": {"k": 4, "new_field": 1}, "train": {"steps": 2}, "eval": {"datasets": ()}}
    assert resume_changes(saved, config) == []
    assert resume_changes({"eval": {"datasets": []}}, {"eval": {"datasets": ("a",)}}) == [
        "eval.datasets: [] -> ['a']"
    ]


@pytest.mark.parametrize("dtype, precision", [("float32", "fp32"), ("bfloat16", "bf16-true")])
def test_a_run_saved_with_model_dtype_reads_as_its_precision(tmp_path, dtype, precision):
    """Before train.precision, model.dtype set weights and compute alike: a saved run is read in
    today's keys, so it resumes (and is evaluated) in the precision it ran in."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"dtype": dtype}, "train": {"steps": 2}}))
    saved = saved_config(tmp_path)
    assert saved == {"model": {}, "train": {"steps": 2, "precision": precision}}
    assert build(saved).train.precision == precision
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"dtype": "float16"}}))
    with pytest.raises(EmapgError, match="model.dtype=float16 has no train.precision"):
        saved_config(tmp_path)


def test_resume_refuses_another_precision(tmp_path):
    with pytest.raises(EmapgError, match="train.precision: 'fp32' -> 'bf16-mixed'"):
        resume_changes({"train": {"precision": "fp32"}}, {"train": {"precision": "bf16-mixed"}})


def test_a_run_is_named_after_its_config_file(tmp_path):
    config = tmp_path / "my_data.yaml"
    config.write_text("train: {steps: 3}\n")
    assert load_config(str(config)).train.name == "my_data"
    assert load_config(None).train.name == "quickstart"
    named = tmp_path / "named.yaml"
    named.write_text("train: {name: mine}\n")
    assert load_config(str(named)).train.name == "mine"


def test_print_config_prints_the_resolved_config(capsys):
    assert cli.main(["train", "--print-config", "train.steps=7", "kl.k=5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 7 and printed["kl"]["k"] == 5
    assert printed == json.loads(json.dumps(load_config(None, ["train.steps=7", "kl.k=5"]).model_dump()))


def test_overrides_may_come_before_and_after_options(capsys):
    assert cli.main(["train", "train.steps=7", "--print-config", "kl.k=5", "train.steps=8"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 8 and printed["kl"]["k"] == 5  # in the order given
    with pytest.raises(SystemExit):
        cli.main(["train", "train.steps=7", "--print-config", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_train_help_shows_what_the_quickstart_runs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    steps = load_config(None).train.steps
    assert f"train.steps = 40 (quickstart: {steps})" in capsys.readouterr().out


@pytest.mark.slow
def test_two_evaluations_of_a_run_do_not_overwrite_each_other(tiny_model_dir, tmp_path, capsys):
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=2")]) == 0
    run = tmp_path / "run"
    assert cli.main(["eval", "--run", str(run), "--step", "2"]) == 0
    assert cli.main(["eval", "--run", str(run), "--step", "2", "--anchor"]) == 0
    policy = json.loads((run / "eval" / "step_2" / "results.json").read_text())
    anchor = json.loads((run / "eval" / "step_2-anchor" / "results.json").read_text())
    assert (policy["weights"], anchor["weights"]) == ("policy", "anchor")


@pytest.mark.slow
def test_a_run_that_stopped_before_its_first_checkpoint_is_started_over(tiny_model_dir, tmp_path):
    """Nothing to resume or evaluate there: the same command runs again once the cause is fixed."""
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=1")]) == 0
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # as a run killed in its first step leaves it
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert cli.main(["train", *_args(tiny_model_dir, tmp_path, "train.steps=2")]) == 0
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2]
