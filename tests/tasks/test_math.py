"""The math task: reward with a format reward, warm-start targets, the shipped samples, configs."""

import json
import re
from fractions import Fraction

import pytest

from emapg.data import math_samples
from emapg.errors import EmapgError
from emapg.model.models import ALPHABET, build_tiny_model, build_tiny_tokenizer
from emapg.tasks import make_task
from emapg.tasks.base import Example
from emapg.tasks.math import (
    DATA_DIR,
    PROMPT,
    SAMPLE_EVAL,
    SAMPLE_TRAIN,
    TINY_EXTRA_CHARS,
    MathTask,
    warm_start,
)
from emapg.tasks.math_data import Problem, load_problems
from emapg.tasks.math_grader import score
from emapg.training import loop as trainer
from emapg.training.config import load_config

PROBLEMS = [Problem("What is 1/2?", "\\frac{1}{2}", "d", 0), Problem("Add.", "So \\boxed{7}.", "d", 1)]


def test_score_with_and_without_format_reward():
    plain, shaped = MathTask(PROBLEMS, PROBLEMS), MathTask(PROBLEMS, PROBLEMS, format_reward=0.1)
    half = plain.eval_examples()[0]
    assert half == Example("What is 1/2?\n" + PROMPT[len("{question}\n") :], "\\frac{1}{2}")
    for task, wrong_but_boxed in [(plain, 0.0), (shaped, 0.1)]:
        assert task.score("so \\boxed{0.5}", half) == 1.0
        assert task.score("so \\boxed{0.4}", half) == wrong_but_boxed
        assert task.score("so \\boxed{0.4", half) == 0.0  # never closed: no format reward
        assert task.score("0.5", half) == 0.0


def test_warm_start_targets_are_boxed_answers_or_the_solution():
    task = MathTask(PROBLEMS, [], prompt="Q: {question} A:")
    assert [(e.prompt, e.answer) for e in warm_start(task).examples] == [
        ("Q: What is 1/2? A:", "\\boxed{\\frac{1}{2}}"),
        ("Q: Add. A:", "So \\boxed{7}."),
    ]
    # what the warm start's accuracy check does: score a target against its own example
    assert all(task.score(e.answer, e) == 1.0 for e in warm_start(task).examples)
    with pytest.raises(EmapgError, match=r"prompt template must contain \{question\}"):
        MathTask(PROBLEMS, [], prompt="no slot")


def _solve(question: str) -> Fraction:
    """Each shipped problem solved from its text alone, independently of the generator."""
    n = [int(x) for x in re.findall(r"-?\d+", question.replace("- ", "-"))]
    if question.startswith("Solve for x"):
        if "=" in question and len(n) == 3:  # a x + b = c
            return Fraction(n[2] - n[1], n[0])
        return Fraction(n[1], n[0])
    if question.startswith("What is") and "%" in question:
        return Fraction(n[0] * n[1], 100)
    if question.startswith("What is"):
        return Fraction(n[0] + n[1] * n[2])
    if "gets" in question:
        return Fraction(n[0] + n[1])
    if "gave away" in question:
        return Fraction(n[0] - n[1])
    if "in each box" in question:
        return Fraction(n[0] * n[1])
    return Fraction(n[0], n[1])  # shared equally


def test_shipped_sums_are_the_generators_output_and_correct(tmp_path):
    make, sizes = math_samples.SETS["sums"]
    train, eval = make(**sizes)
    math_samples.write(tmp_path / "t.jsonl", train)
    math_samples.write(tmp_path / "e.jsonl", eval)
    assert (tmp_path / "t.jsonl").read_bytes() == (DATA_DIR / "sums_train.jsonl").read_bytes()
    assert (tmp_path / "e.jsonl").read_bytes() == (DATA_DIR / "sums_eval.jsonl").read_bytes()
    problems = load_problems(DATA_DIR / "sums_train.jsonl") + load_problems(DATA_DIR / "sums_eval.jsonl")
    assert len({p.question for p in problems}) == len(problems) == 2200
    for p in problems:
        a, b = map(int, p.question.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and p.reference == str(a + b)


def test_shipped_samples_are_the_generators_output_and_correct(tmp_path):
    make, sizes = math_samples.SETS["math"]
    train, eval = make(**sizes)
    math_samples.write(tmp_path / "t.jsonl", train)
    math_samples.write(tmp_path / "e.jsonl", eval)
    assert (tmp_path / "t.jsonl").read_bytes() == SAMPLE_TRAIN.read_bytes()
    assert (tmp_path / "e.jsonl").read_bytes() == SAMPLE_EVAL.read_bytes()
    problems = load_problems(SAMPLE_TRAIN) + load_problems(SAMPLE_EVAL)
    assert len({p.question for p in problems}) == len(problems) == 1100
    for p in problems:
        assert score(f"\\boxed{{{math_samples.latex(_solve(p.question))}}}", p.reference) == 1.0, p
    # every character of prompts and boxed answers is in the built-in tokenizer's alphabet
    known = set(ALPHABET + TINY_EXTRA_CHARS)
    task = MathTask(problems, [])
    assert {c for e in warm_start(task).examples for c in e.prompt + e.answer} <= known


def test_config_selects_math_with_shipped_data_and_caps():
    cfg = load_config("math_tiny", ["task.num_train=10", "task.num_eval=3"])
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    assert isinstance(task, MathTask)
    assert len(task.train_examples()) == 10 and len(task.eval_examples()) == 3
    assert task.eval_examples()[0].prompt.endswith("\nGive the answer in \\boxed{}.")


def test_config_data_files_and_validation(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q?", "answer": "so\n#### 5"}) + "\n")
    cfg = load_config(None, ["task.name=math", f"task.train_files=[{data}]", f"task.eval_files=[{data}]"])
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    assert [e.answer for e in task.train_examples() + task.eval_examples()] == ["5", "5"]
    forced = load_config(
        None,
        [
            "task.name=math",
            f"task.train_files=[{data}]",
            f"task.eval_files=[{data}]",
            "task.schema=qwen_math",
        ],
    )
    assert make_task(forced.task, forced.warmstart.cache_dir).eval_examples()[0].answer == "so\n#### 5"
    bad = {
        "task.train_files=[nope.jsonl]": "task.train_files: 'nope.jsonl' does not exist",
        "task.format_reward=1": "task.format_reward: input should be less than 1; got 1",
        "task.schema=aime": "task.schema: unknown 'aime'; expected one of auto, olympiadbench, gsm8k, qwen_math, math500, math",
        "task.prompt=x": "task.prompt: the prompt template must contain {question}; got 'x'",
        "task.name=maths": "task.name: unknown 'maths' (did you mean 'math'?); registered: arithmetic, dataset, math, search",
    }
    for override, message in bad.items():
        with pytest.raises(EmapgError) as e:
            load_config(None, ["task.name=math", override])
        assert str(e.value) == message


def test_math_qwen_needs_its_model_path_and_has_the_papers_settings(tmp_path):
    with pytest.raises(EmapgError) as e:
        load_config("math_qwen")
    assert str(e.value) == (
        "model.path: '/path/to/Qwen2.5-Math-1.5B' does not exist; set model.path=DIR to a local model directory"
    )
    cfg = load_config("math_qwen", [f"model.path={tmp_path}"])
    assert (cfg.optim.lr, cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.rollout.temperature) == (
        1e-6, 8, 3072, 1.0,
    )  # fmt: skip
    assert (cfg.anchor.kind, cfg.anchor.eta, cfg.anchor.update_period) == ("ema", 0.9, 10)
    assert (cfg.kl.estimator, cfg.kl.direction, cfg.kl.k, cfg.kl.beta) == ("topk", "reverse", 32, 1e-3)
    assert cfg.task.name == "math"


@pytest.mark.slow
def test_training_on_math_runs_and_grades_in_the_worker(tmp_path):
    # Math prompts are longer than the shared tiny model's 64 positions (training refuses them).
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=512
    ).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    cfg = load_config(
        "math_tiny",
        [
            f"model.path={tmp_path / 'm'}", f"train.output_dir={tmp_path}", "train.steps=2",
            "train.progress=false", "train.tensorboard=false", "task.num_train=16", "task.num_eval=4",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "eval.samples=1",
        ],
    )  # fmt: skip
    result = trainer.train(cfg)
    records = [
        json.loads(line) for line in (tmp_path / "math_tiny" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2]
    # a random model never writes "\boxed{...}": every reward is 0, and none came from an error
    assert [(r["reward/mean"], r["reward/errors"], r["reward/timeouts"]) for r in records[1:]] == [
        (0.0, 0, 0)
    ] * 2
    assert result["accuracy_before"] == result["accuracy_after"] == 0.0
