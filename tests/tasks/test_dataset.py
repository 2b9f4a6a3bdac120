"""The dataset task: your data and TRL-style reward functions by import path, guarded."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import emapg
from emapg.errors import EmapgError
from emapg.model.models import build_tiny_tokenizer
from emapg.prompts import ChatPrompt, encode_prompts
from emapg.tasks import make_task
from emapg.tasks.dataset import load_rows
from emapg.tasks.math import PROMPT
from emapg.tasks.reward_fns import CHAT_HINT
from emapg.tasks.rewards import RewardScorer
from emapg.training import loop as trainer
from helpers import DATA, FAST, config

MODULE = DATA / "reward_module.py"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sums(n, start=0):
    return [
        {"prompt": f"{a}+{a % 7}=", "answer": str(a + a % 7), "level": a % 3} for a in range(start, start + n)
    ]


def dataset_config(tmp_path, model_dir, *extra, train=None, evals=None, fns=f"{MODULE}:first_char"):
    train = train or write_jsonl(tmp_path / "train.jsonl", sums(40))
    evals = evals or write_jsonl(tmp_path / "eval.jsonl", sums(8, start=100))
    return config(
        tmp_path, model_dir, "task.name=dataset", f"task.train_files=[{train}]", f"task.eval_files=[{evals}]",
        f"task.reward_fns=[{fns}]", "task.num_eval=8", *extra,
    )  # fmt: skip


def records(tmp_path, name="metrics.jsonl"):
    return [json.loads(line) for line in (tmp_path / "quickstart" / name).read_text().splitlines()]


@pytest.mark.slow
def test_jsonl_and_a_reward_module_by_import_path_train_and_log_that_functions_rewards(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.syspath_prepend(str(DATA))
    cfg = dataset_config(
        tmp_path,
        tiny_model_dir,
        "train.steps=5",
        "train.eval_every=5",
        "task.answer_field=answer",
        fns="reward_module:first_char",
    )
    trainer.train(cfg)
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 4, 5]
    for r in logged[1:]:  # one function, weight 1: the reward is that function's
        assert r["reward/first_char/mean"] == pytest.approx(r["reward/mean"])
        assert r["reward/errors"] == 0 and r["reward/timeouts"] == 0
    assert logged[0]["eval/reward/first_char/mean"] == pytest.approx(logged[0]["eval/accuracy"])
    samples = records(tmp_path, "samples.jsonl")
    assert len(samples) == 8 and all(s["answer"] for s in samples)
    for s in samples:  # each response's reward is the function's value
        assert s["reward"] == float(s["response"][:1] == s["answer"][:1])


def _task(tmp_path, model_dir, fns, weights="[]", isolation="process"):
    cfg = dataset_config(
        tmp_path,
        model_dir,
        f"task.reward_weights={weights}",
        f"task.reward_isolation={isolation}",
        "task.reward_timeout_s=2",
        fns=fns,
    )
    return make_task(cfg.task, cfg.warmstart.cache_dir)


@pytest.mark.slow
def test_raising_hanging_and_abstaining_functions_are_guarded(tmp_path, tiny_model_dir):
    task = _task(tmp_path, tiny_model_dir, f"{MODULE}:hostile,{MODULE}:half", weights="[1, 3]")
    ex = task.train_examples()[0]
    with RewardScorer(task, timeout_s=2.0, isolation="process") as scorer:
        out = scorer(["ok", "raise", "sleep", "none", "half", "ok"], [ex] * 6)
    # raise: 0 and an error; sleep: 0 and a timeout (the worker is replaced); none: every
    # function abstained, 0 and an error; half: hostile abstains, half gives 0.5 * weight 3.
    assert out.rewards == [1.0, 0.0, 0.0, 0.0, 1.5, 1.0]
    assert (out.errors, out.timeouts) == (2, 1)
    assert out.part_sums(task.reward_parts) == [(2.0, 2), (0.5, 1)]  # means over the non-None values


def test_a_messages_column_is_templated_like_the_math_prompts(tmp_path, tiny_model_dir):
    user = PROMPT.replace("{question}", "1+2")
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4"}]
    rows = [{"prompt": [{"role": "user", "content": user}], "answer": "3"}, {"prompt": chat, "answer": "7"}]
    train = write_jsonl(tmp_path / "chat.jsonl", rows * 3)
    cfg = dataset_config(tmp_path, tiny_model_dir, train=train, evals=train, fns=f"{MODULE}:chat_kind")
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    single, multi = (e.prompt for e in task.train_examples()[:2])
    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert encode_prompts(tok, [single]) == encode_prompts(tok, [user])  # the math task's path
    assert isinstance(multi, ChatPrompt) and multi == "be brief\n3+4"
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert encode_prompts(tok, [multi]) == [tok(text, add_special_tokens=False)["input_ids"]]
    assert encode_prompts(tok, [multi], chat_template=False) == [tok("be brief\n3+4")["input_ids"]]
    # Conversational data: completions reach the function as assistant messages, as in TRL.
    assert task.score("3", task.train_examples()[0]).value == 1.0


def test_a_save_to_disk_directory_and_csv_and_parquet_load(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = sums(6)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    ).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "one"), "train") == rows
    assert load_rows(str(tmp_path / "dict"), "test", field="task.eval_files") == rows[:2]
    with pytest.raises(EmapgError, match=r"has no split 'dev' \(splits: train, test\); set task.eval_split"):
        load_rows(str(tmp_path / "dict"), "dev", field="task.eval_files")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(str(tmp_path / "d.parquet"), "train") == rows
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    assert load_rows(str(tmp_path / "d.csv"), "train") == [{k: str(v) for k, v in r.items()} for r in rows]


BAD = [
    (
        ["task.prompt_field=question"],
        f"{MODULE}:first_char",
        r"task.prompt_field: .*train.jsonl has no column 'question' \(columns: prompt, answer, level\)",
    ),
    (
        [],
        "no_such_module_xyz:f",
        r"task.reward_fns: 'no_such_module_xyz:f': cannot import 'no_such_module_xyz'",
    ),
    ([], f"{MODULE}:missing", r"reward_module.py has no function 'missing'"),
    ([], f"{MODULE}:wrong_signature", r"wrong_signature'\(response, example\) does not take `completions`"),
    ([], f"{MODULE}:needs_solution", r"needs solution, which is not a column of .*train.jsonl"),
    ([], f"{MODULE}:not_a_number", r"task.reward_fns: reward function .*not_a_number returned \['yes'\]"),
    (["task.reward_weights=[1, 2]"], f"{MODULE}:first_char", r"task.reward_weights: 2 weights for 1 reward"),
    (
        ["task.answer_field=answer"],
        f"{MODULE}:broken",
        r"task.reward_fns: reward function .*reward_module.py:broken raised ZeroDivisionError: division by "
        r"zero \(called on the first training record with its task.answer_field 'answer'\)$",
    ),
]


@pytest.mark.parametrize("extra,fns,message", BAD, ids=lambda x: str(x)[:30])
def test_bad_input_stops_with_one_line_before_any_step(tmp_path, tiny_model_dir, extra, fns, message, caplog):
    cfg = dataset_config(tmp_path, tiny_model_dir, *extra, fns=fns)
    with caplog.at_level(logging.WARNING, logger="emapg"), pytest.raises(EmapgError, match=message) as e:
        trainer.train(cfg)
    assert "\n" not in str(e.value)
    assert not caplog.records  # no warning that the run goes on
    assert not (tmp_path / "quickstart").exists()  # nothing ran, nothing written


def test_a_text_reward_on_chat_data_stops_before_any_step_saying_what_to_change(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)} for a in range(12)]
    train = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = dataset_config(tmp_path, tiny_model_dir, train=train, evals=train, fns=f"{MODULE}:text_only")
    with pytest.raises(EmapgError) as e:
        make_task(cfg.task, cfg.warmstart.cache_dir)
    assert str(e.value) == (
        f"task.reward_fns: reward function {MODULE}:text_only raised AttributeError: 'list' object has no "
        f"attribute 'strip'{CHAT_HINT} (called on the first training record with an empty completion)"
    )


@pytest.mark.slow
def test_a_run_whose_every_reward_fails_stops_at_its_first_step_with_one_line(tmp_path, tiny_model_dir):
    """The function passes the check before any step (it scores the reference answer) and
    raises on every response. stderr is the error alone: no warning that the run goes on, no
    RuntimeWarning from starting the reward worker."""
    train = write_jsonl(tmp_path / "train.jsonl", sums(40))
    evals = write_jsonl(tmp_path / "eval.jsonl", sums(8, start=100))
    args = [f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", *FAST, "task.name=dataset",
            f"task.train_files=[{train}]", f"task.eval_files=[{evals}]", "task.num_eval=8",
            "task.answer_field=answer", f"task.reward_fns=[{MODULE}:only_the_answer]", "train.steps=2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    # Time limit: the test measured 13 s at load 3-4; 300 s is over x20.
    done = subprocess.run(
        [sys.executable, "-m", "emapg", "train", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    line = (
        f"emapg: error: task 'dataset': reward function {re.escape(str(MODULE))}:only_the_answer raised "
        r"ValueError: not a number: .*, on every one of the 16 responses of step 1; with every reward 0 "
        r"the run would learn nothing: fix the reward\n"
    )
    assert re.fullmatch(line, done.stderr), done.stderr


@pytest.mark.slow
def test_some_reward_errors_are_logged_once_after_the_first_step_and_the_run_goes_on(
    tmp_path, tiny_model_dir, caplog
):
    cfg = dataset_config(tmp_path, tiny_model_dir, "train.steps=2", fns=f"{MODULE}:every_other")
    with caplog.at_level(logging.WARNING, logger="emapg"):
        trainer.train(cfg)
    assert all(0 < r["reward/errors"] < 16 for r in records(tmp_path)[1:])
    (warning,) = [r.getMessage() for r in caplog.records if "reward/errors" in r.getMessage()]
    assert (
        f"reward function {MODULE}:every_other raised ValueError: every other call on a response" in warning
    )


def test_eval_data_defaults_to_held_out_training_records(tmp_path, tiny_model_dir):
    train = write_jsonl(tmp_path / "all.jsonl", sums(20))
    cfg = dataset_config(tmp_path, tiny_model_dir, train=train)
    cfg.task.eval_files = []
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    assert len(task.train_examples()) == 12
    assert [e.meta["columns"]["answer"] for e in task.eval_examples()] == [r["answer"] for r in sums(20)[12:]]


@pytest.mark.slow
def test_the_python_api_trains_a_task_instance_for_one_run(tmp_path, tiny_model_dir):
    import emapg
    from emapg.tasks import task_names
    from helpers import EchoTask

    cfg = config(tmp_path, tiny_model_dir, "train.steps=1")
    result = emapg.train(cfg, ["train.eval_every=1"], task=EchoTask())
    assert result["run_dir"] == str(tmp_path / "quickstart") and 0 <= result["accuracy_after"] <= 1
    assert [r["step"] for r in records(tmp_path)] == [0, 1] and "echo/length" in records(tmp_path)[1]
    assert "echo" not in task_names() and cfg.task.name == "arithmetic"  # registered for that run only
