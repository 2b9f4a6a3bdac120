"""The anchor evaluated as a model (eval/anchor/accuracy) and the evaluation's KLs (eval.kl)."""

import hashlib
import json

import pytest

from emapg import cli
from emapg.errors import EmapgError
from emapg.tasks import TASKS
from emapg.tasks.arithmetic import ArithmeticTask
from emapg.training import loop as trainer
from emapg.training.checkpoint_eval import evaluate_checkpoint
from emapg.training.config import load_config


class Fingerprint(ArithmeticTask):
    """Arithmetic prompts whose reward is a hash of the response in [0, 1): the mean reward over
    the held-out set changes when any one response does, so equal figures mean equal samples."""

    score_is_safe = True

    def score(self, response, example):
        return int(hashlib.sha256(response.encode()).hexdigest()[:8], 16) / 2**32


def fingerprint_task(cfg):
    return Fingerprint(seed=0, num_train=64, num_eval=12, min_digits=1, max_digits=2)


@pytest.fixture
def fingerprint():
    with TASKS.registered("fingerprint", fingerprint_task):
        yield


def run_config(tmp_path, model_dir, *extra):
    return load_config(
        None,
        [f"model.path={model_dir}", f"train.output_dir={tmp_path}", "train.name=run", "task.name=fingerprint",
         "task.reward_isolation=inline", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=5", "algo.micro_batch_size=8", "train.progress=false",
         "train.tensorboard=false", "train.steps=4", "train.eval_every=2", "train.save_every=2",
         "eval.samples=2", *extra],
    )  # fmt: skip


def records(tmp_path) -> dict[int, dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "eval/accuracy" in r}


@pytest.mark.slow
def test_anchor_accuracy_equals_an_eval_of_the_saved_anchor(tmp_path, tiny_model_dir, fingerprint, capsys):
    # eta 0.5 every step: the anchor is neither the start nor the policy.
    trainer.train(
        run_config(tmp_path, tiny_model_dir, "anchor.eta=0.5", "anchor.update_period=1", "optim.lr=0.01")
    )
    logged = records(tmp_path)
    assert sorted(logged) == [0, 2, 4] and all("eval/anchor/accuracy" in r for r in logged.values())
    for step in (2, 4):
        anchor = evaluate_checkpoint(tmp_path / "run", step, anchor=True)["accuracy"]
        policy = evaluate_checkpoint(tmp_path / "run", step)["accuracy"]
        assert anchor == logged[step]["eval/anchor/accuracy"]
        assert policy == logged[step]["eval/accuracy"]
        assert anchor != policy  # two models: the comparison above can tell them apart
    # The command prints the same figure (default: the last checkpoint).
    assert (
        cli.main(["eval", "--run", str(tmp_path / "run"), "--anchor", "--out", str(tmp_path / "eval")]) == 0
    )
    assert f"eval/anchor/accuracy {logged[4]['eval/anchor/accuracy']:.4f}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["accuracy"] == logged[4]["eval/anchor/accuracy"] and saved["weights"] == "anchor"


@pytest.mark.slow
def test_drift_of_a_run_that_never_updates_is_zero(tmp_path, tiny_model_dir, fingerprint):
    trainer.train(run_config(tmp_path, tiny_model_dir, "optim.lr=0", "eval.kl=true"))
    logged = records(tmp_path)
    assert [logged[s]["eval/drift_kl"] for s in (0, 2, 4)] == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_frozen_anchor_kl_is_zero_at_the_start_and_is_the_drift(tmp_path, tiny_model_dir, fingerprint):
    trainer.train(run_config(tmp_path, tiny_model_dir, "anchor.kind=frozen", "optim.lr=0.01", "eval.kl=true"))
    logged = records(tmp_path)
    assert logged[0]["eval/anchor_kl"] == 0.0 and logged[0]["eval/drift_kl"] == 0.0
    assert logged[4]["eval/drift_kl"] > 0  # the policy moved
    assert all(r["eval/anchor_kl"] == r["eval/drift_kl"] for r in logged.values())  # one reference
    assert all("eval/anchor/accuracy" not in r for r in logged.values())  # auto: EMA anchors only


@pytest.mark.slow
def test_ema_anchor_kl_is_zero_at_the_start_and_below_the_drift(tmp_path, tiny_model_dir, fingerprint):
    trainer.train(
        run_config(tmp_path, tiny_model_dir, "anchor.eta=0.5", "anchor.update_period=1", "optim.lr=0.01",
                   "eval.kl=true")
    )  # fmt: skip
    logged = records(tmp_path)
    assert logged[0]["eval/anchor_kl"] == 0.0 and logged[0]["eval/drift_kl"] == 0.0
    # The anchor followed the policy halfway every step: it is nearer than the start.
    assert 0 < logged[4]["eval/anchor_kl"] < logged[4]["eval/drift_kl"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["eval.kl=true", "eval.greedy=true"], "eval.kl estimates KL"),
        (["eval.kl=true", "eval.top_p=0.9"], "eval.kl estimates KL"),
        (["eval.anchor=true", "anchor.kind=none", "kl.beta=0"], "anchor.kind=none has none"),
    ],
)
def test_bad_evaluation_settings_stop_with_one_line(overrides, message):
    with pytest.raises(EmapgError, match=message):
        load_config(None, overrides)


def test_eval_run_names_what_is_missing(tmp_path, capsys):
    with pytest.raises(EmapgError, match="no config.yaml"):
        evaluate_checkpoint(tmp_path)
    assert cli.main(["eval", "--data", "x.jsonl"]) == 2
    assert "give --run RUN_DIR" in capsys.readouterr().err
