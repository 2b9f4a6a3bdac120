"""`emapg eval`: the pass@k estimator, and the command end to end on a tiny model."""

import json
import math

import pytest

from emapg.cli import main
from emapg.math_eval import ks, pass_at_k, summarize
from emapg.models import build_tiny_model, build_tiny_tokenizer
from emapg.sft import sft
from emapg.tasks.math import TINY_EXTRA_CHARS, MathTask, warm_start
from emapg.tasks.math_data import load_problems


def closed_form(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_equals_the_closed_form():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12)
    # by hand: 1 of 4 right, 2 drawn: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 1) == 0.75
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5)  # no overflow at large n


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_ks_and_summary_by_hand():
    assert ks(1) == [1] and ks(2) == [1, 2] and ks(16) == [1, 2, 4, 8, 16] and ks(6) == [1, 2, 4, 6]
    got = summarize([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]], [[1, 2, 3, 4], [5, 6, 7, 8]])
    # a score of 0.5 (a format reward) is not correct: counts c = 1 and 2
    assert got.pop("pass_at_k") == pytest.approx({"1": 3 / 8, "2": (0.5 + 5 / 6) / 2, "4": 1.0})
    assert got == {"problems": 2, "samples_per_problem": 4, "accuracy": 3 / 8, "response_length_mean": 4.5}


PROBLEMS = [
    {"problem": "What is 2 + 3 * 4?", "answer": "14"},
    {"problem": "Solve for x: 2x = 3.", "answer": "\\frac{3}{2}"},
    {"problem": "Ana has 7 pens and gets 5 more. How many pens does Ana have now?", "answer": "12"},
]


@pytest.fixture(scope="module")
def boxed_model_dir(tmp_path_factory):
    """A tiny model taught to answer the three problems with "\\boxed{...}", often but not always right."""
    path = tmp_path_factory.mktemp("boxed-model")
    data = path / "three.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    task = MathTask(load_problems(data), [])
    tokenizer = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = build_tiny_model(tokenizer, max_position_embeddings=192, seed=0)
    sft(model, tokenizer, warm_start(task).examples, steps=40, batch_size=3, lr=3e-3, progress=False)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path, data


def test_eval_end_to_end_figures_match_the_responses(boxed_model_dir, tmp_path, capsys):
    model_dir, data = boxed_model_dir
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(model_dir), "--data", str(data), "--n", "2"]
    argv += ["--max-new-tokens", "16", "--temperature", "1.0", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert [(r["problem"], r["sample"]) for r in rows] == [(p, s) for p in range(3) for s in range(2)]
    assert {r["reference"] for r in rows} == {p["answer"] for p in PROBLEMS}
    # Recompute every figure from the written responses, grading them again.
    from emapg.tasks.math_grader import score

    assert [r["score"] for r in rows] == [score(r["response"], r["reference"]) for r in rows]
    correct = [sum(r["score"] == 1.0 for r in rows if r["problem"] == p) for p in range(3)]
    assert 0 < sum(correct) < 6, "the fixture should give a mix of right and wrong answers"
    figures = results["datasets"]["three"]
    assert figures["problems"] == 3 and figures["samples_per_problem"] == 2
    assert figures["accuracy"] == pytest.approx(sum(correct) / 6)
    assert figures["pass_at_k"] == pytest.approx(
        {str(k): sum(closed_form(2, c, k) for c in correct) / 3 for k in (1, 2)}
    )
    assert figures["response_length_mean"] == pytest.approx(sum(r["length"] for r in rows) / 6)
    table = capsys.readouterr().out
    assert table.splitlines()[1].split() == [
        "three", "3", f"{figures['accuracy']:.1%}", f"{figures['pass_at_k']['1']:.1%}",
        f"{figures['pass_at_k']['2']:.1%}", f"{figures['response_length_mean']:.1f}",
    ]  # fmt: skip


def test_eval_errors_are_one_line(tmp_path, capsys, boxed_model_dir):
    model_dir, data = boxed_model_dir
    assert main(["eval", "--model", str(tmp_path / "none"), "--data", str(data)]) == 2
    assert "model path" in capsys.readouterr().err
    assert main(["eval", "--model", str(model_dir), "--data", str(tmp_path / "x.jsonl")]) == 2
    assert capsys.readouterr().err == f"emapg: error: math data {str(tmp_path / 'x.jsonl')!r}: no such file\n"
    assert main(["eval", "--model", str(model_dir), "--data", str(data), "--n", "0"]) == 2
    assert "--n" in capsys.readouterr().err
