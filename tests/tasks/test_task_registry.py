"""The task registry (emapg.tasks): a user's task registered, trained, logged and sampled; an unknown
name or a factory returning no task stops with one line."""

import json

import pytest

from emapg.errors import EmapgError
from emapg.tasks import TASKS, ProblemSettings, make_task, task_names
from emapg.training import loop as trainer
from helpers import EchoTask, config


@pytest.mark.slow
def test_the_registry_trains_a_users_task(tmp_path, tiny_model_dir):
    with TASKS.registered("echo", lambda cfg: EchoTask(), ProblemSettings):  # FAST sets task.num_*
        assert "echo" in task_names()
        cfg = config(tmp_path, tiny_model_dir, "task.name=echo", "train.steps=2", "train.eval_every=1")
        assert isinstance(make_task(cfg.task, cfg.warmstart.cache_dir), EchoTask)
        trainer.train(cfg)
    assert "echo" not in task_names()  # registered for the block only
    records = [
        json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("echo/length" in r for r in records[1:]) and all("eval/echo/length" in r for r in records)
    samples = [
        json.loads(line) for line in (tmp_path / "quickstart" / "samples.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4
    for s in samples:  # what the policy wrote, with the reward the task gave it
        assert s["reward"] == float(s["response"].startswith(s["answer"])) and s["prompt"].endswith("=")


def test_an_unknown_task_or_a_factory_returning_no_task_stops_with_one_line(tmp_path, tiny_model_dir):
    with (
        TASKS.registered("echo", lambda cfg: EchoTask(), ProblemSettings),
        pytest.raises(EmapgError, match=r"task.name: unknown 'ecko' \(did you mean 'echo'\?\); registered: "),
    ):
        config(tmp_path, tiny_model_dir, "task.name=ecko")
    with (
        TASKS.registered("not_a_task", lambda cfg: object(), ProblemSettings),
        pytest.raises(EmapgError, match="task 'not_a_task': its factory returned object, not an emapg Task"),
    ):
        cfg = config(tmp_path, tiny_model_dir, "task.name=not_a_task")
        make_task(cfg.task, cfg.warmstart.cache_dir)
