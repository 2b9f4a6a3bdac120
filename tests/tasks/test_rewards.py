"""Hostile rewards: raising, non-numbers, out of range, hanging in Python or C, killing the worker."""

import logging
import os
import time

import pytest

from emapg.errors import EmapgError
from emapg.tasks.arithmetic import ArithmeticTask
from emapg.tasks.base import Example
from emapg.tasks.rewards import ABSTAINED, RewardScorer, ScoreError, score_detail


class HostileTask:
    """Scores "ok" 1 and anything unknown 0; the other responses each misbehave in one way."""

    name = "hostile"

    def score(self, response, example):
        if response == "raise":
            raise ValueError("bad response")
        if response == "abc":
            return "abc"
        if response == "nan":
            return float("nan")
        if response == "big":
            return 7
        if response == "sleep":
            time.sleep(10)
        if response == "spin-in-c":
            import re

            re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking inside C code
        if response == "exit":
            os._exit(3)
        if response == "abstain":
            raise ScoreError(ABSTAINED)
        return 1.0 if response == "ok" else 0.5


EX = Example("1+1=", "2")


def score_one(score, response, example):
    """(reward, None), or (0.0, what went wrong)."""
    return score_detail(score, response, example, (0.0, 1.0))[:2]


def test_score_one_checks_value_and_exceptions():
    task = HostileTask()
    assert score_one(task.score, "ok", EX) == (1.0, None)
    assert score_one(task.score, "x", EX) == (0.5, None)
    assert score_one(task.score, "raise", EX) == (0.0, "score raised ValueError: bad response")
    assert score_one(task.score, "abc", EX) == (0.0, "score returned 'abc', expected a number in [0, 1]")
    assert score_one(task.score, "nan", EX)[0] == 0.0 and "nan" in score_one(task.score, "nan", EX)[1]
    assert score_one(task.score, "big", EX) == (0.0, "score returned 7, expected a number in [0, 1]")


def test_inline_scoring_counts_errors_and_warns_once(caplog):
    scorer = RewardScorer(HostileTask(), timeout_s=1.0, isolation="inline")
    with caplog.at_level(logging.WARNING, logger="emapg"):
        out = scorer(["ok", "raise", "abc", "x", "nan", "big"], [EX] * 6)
    assert out.rewards == [1.0, 0.0, 0.0, 0.5, 0.0, 0.0]
    assert (out.errors, out.timeouts) == (4, 0)
    assert len(caplog.records) == 1 and "raised ValueError: bad response" in caplog.text


def test_a_held_warning_waits_for_the_first_step_which_stops_a_run_whose_every_score_failed(caplog):
    with caplog.at_level(logging.WARNING, logger="emapg"):
        broken = RewardScorer(HostileTask(), timeout_s=1.0, isolation="inline", hold_warning=True)
        out = broken(["raise", "raise"], [EX, EX])
        with pytest.raises(EmapgError) as err:
            broken.check_first_step(out.problems, out.failures, responses=2, step=1)
        assert str(err.value) == (
            "task 'hostile': score raised ValueError: bad response, on every one of the 2 responses of "
            "step 1; with every reward 0 the run would learn nothing: fix the reward"
        )
        assert not caplog.records  # the run stops with its error alone

        # Abstaining on every response is no failure: the run goes on, and warns from here on.
        scorer = RewardScorer(HostileTask(), timeout_s=1.0, isolation="inline", hold_warning=True)
        out = scorer(["abstain", "abstain"], [EX, EX])
        assert (out.errors, out.failures) == (2, 0) and not caplog.records
        scorer.check_first_step(out.problems, out.failures, responses=2, step=1)
        scorer(["raise"], [EX])
    assert len(caplog.records) == 1 and f"task 'hostile': {ABSTAINED} on a response" in caplog.text


@pytest.mark.slow
def test_the_worker_starts_without_a_runtime_warning(capfd):
    with RewardScorer(HostileTask(), timeout_s=5.0, isolation="process") as scorer:
        assert scorer(["ok"], [EX]).rewards == [1.0]
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.slow
def test_worker_cuts_off_hangs_in_python_and_c_and_survives_its_own_death():
    responses = ["ok", "sleep", "raise", "x", "spin-in-c", "ok", "exit", "abc", "ok"]
    with RewardScorer(HostileTask(), timeout_s=0.5) as scorer:
        assert not scorer.inline
        t = time.perf_counter()
        out = scorer(responses, [EX] * len(responses))
        elapsed = time.perf_counter() - t
        assert out.rewards == [1.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0]
        assert (out.errors, out.timeouts) == (3, 2)  # raise, exit, abc; sleep, spin-in-c
        # Not a speed bound: less than the 10 s sleep alone, so the hangs were cut, not waited out
        # (two 0.5 s limits plus three worker restarts, each a few seconds on a loaded machine).
        assert elapsed < 10.0, elapsed
        again = scorer(["ok", "x"], [EX, EX])  # the restarted worker keeps serving
        assert again.rewards == [1.0, 0.5] and again.errors == again.timeouts == 0


def test_safe_task_is_scored_inline_unless_isolation_is_forced():
    task = ArithmeticTask(num_train=4, num_eval=4)
    assert RewardScorer(task, timeout_s=1.0).inline
    ex = task.eval_examples()[0]
    with RewardScorer(task, timeout_s=1.0, isolation="process") as scorer:
        assert not scorer.inline
        out = scorer([ex.answer, ex.answer + "1", f" {ex.answer}<eos>"], [ex] * 3)
    assert out.rewards == [1.0, 0.0, 1.0] and out.errors == 0


class Unpicklable(HostileTask):
    def __init__(self):
        self.handle = lambda: None  # lambdas do not pickle


def test_task_that_cannot_go_to_a_worker_is_scored_inline_or_refused(caplog):
    with caplog.at_level(logging.WARNING, logger="emapg"):
        scorer = RewardScorer(Unpicklable(), timeout_s=1.0)
    assert scorer.inline and "scoring in-process, without a time limit" in caplog.text
    assert scorer(["ok", "raise"], [EX, EX]).rewards == [1.0, 0.0]
    with pytest.raises(EmapgError, match="cannot be sent to a reward worker process") as err:
        RewardScorer(Unpicklable(), timeout_s=1.0, isolation="process")
    assert "task.reward_isolation=inline" in str(err.value) and "\n" not in str(err.value)


class RaisingArithmetic(ArithmeticTask):
    """Scores 1 everywhere, or raises on every response."""

    def __init__(self, raises: bool):
        super().__init__(seed=0, num_train=4, num_eval=4, min_digits=1, max_digits=1)
        self.raises = raises

    def score(self, response, example):
        if self.raises:
            raise RuntimeError("hostile")
        return 1.0


@pytest.mark.parametrize("raises,want", [(False, 1.0), (True, 0.0)])
def test_evaluation_goes_through_the_guarded_scorer(tmp_path, tiny_model_dir, raises, want):
    import torch

    from emapg.tasks import TASKS
    from emapg.training import loop as trainer
    from emapg.training.config import load_config

    with TASKS.registered("raising", lambda cfg: RaisingArithmetic(raises)):
        cfg = load_config(
            None,
            [f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", "task.name=raising",
             "task.reward_isolation=inline", "rollout.max_new_tokens=3", "eval.greedy=true", "train.tensorboard=false"],
        )  # fmt: skip
        run = trainer.setup(cfg, False, torch.device("cpu"))
    try:
        accuracy, _ = trainer.evaluate(run, 0)
    finally:
        run.close()
    assert accuracy == want
