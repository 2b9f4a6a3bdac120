"""examples/calculator: the tool environment, the demonstrations, the reward, and a run of the
command its README gives: the task registered by `--import`, its own settings set and checked
from the command line, multi-turn rollouts."""

import json
import sys
from pathlib import Path

import pytest

from emapg import cli
from emapg.tasks import TASKS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator"
COMMAND = ["train", "--import", str(EXAMPLE / "calculator.py"), "--config", str(EXAMPLE / "config.yaml")]


@pytest.fixture
def calculator(monkeypatch):
    """The example's module; the task its import registers is gone after the test."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    with TASKS.registered("calculator", lambda cfg: None):
        import calculator

        yield calculator
    sys.modules.pop("calculator", None)


def test_the_environment_answers_calls_and_ends_episodes(calculator):
    env = calculator.CalculatorEnvironment(max_calls=1)
    env.reset(["347*28=", "1*2=", "5*5="])
    assert env.step([0, 1, 2], ["<calc>347*28</calc>", "2", "<calc>5/5</calc>"]) == [
        "<result>9716</result>",
        None,
        None,
    ]
    assert env.step([0], ["<calc>1+1</calc>"]) == [None]  # past max_calls
    assert calculator.calculate("12-30") == "-18" and calculator.calculate("2**8") is None


def test_demonstrations_mask_the_inserted_result_and_score_the_answer_after_it(calculator):
    task = calculator.CalculatorTask(num_train=5, num_eval=3)
    recipe = calculator.demonstrations(task)
    assert recipe.task is task and recipe.extra_chars == "<>"
    demo = recipe.examples[0]
    a, b = demo.meta["a"], demo.meta["b"]
    assert demo.meta["segments"] == [
        (f"<calc>{a}*{b}</calc>", True),
        (f"<result>{a * b}</result>", False),
        (str(a * b), True),
    ]
    ex = task.train_examples()[0]
    assert task.score(demo.answer, ex) == 1.0  # the whole episode: the answer after the result
    wrong_copy = f"<calc>{a}*{b}</calc><result>{a * b}</result>7"
    assert task.score(wrong_copy, ex) == 0.0  # what the model wrote after the result counts
    assert task.score(str(a * b), ex) == 1.0 and task.score("", ex) == 0.0


def test_the_readme_command_trains_with_the_tasks_own_settings(calculator, tmp_path, tiny_model_dir, capsys):
    from helpers import FAST

    args = [f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", *FAST, "rollout.max_new_tokens=24",
            "train.steps=1", "train.name=calc", "task.num_train=32", "task.num_eval=4", "task.max_calls=1"]  # fmt: skip
    assert cli.main([*COMMAND, *args]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"run: {tmp_path / 'calc'}")
    last = json.loads((tmp_path / "calc" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"calc/calls_mean", "eval/calc/right_call"} <= set(last)
    assert last["eval/calc/calls_mean"] <= 1  # task.max_calls=1 reached the environment
    assert "max_calls: 1" in (tmp_path / "calc" / "config.yaml").read_text()


def test_a_bad_value_of_the_tasks_own_setting_is_one_line(calculator, capsys):
    assert cli.main([*COMMAND, "task.max_calls=0"]) == 2
    assert capsys.readouterr().err == (
        "emapg: error: task.max_calls: input should be greater than or equal to 1; got 0\n"
    )
