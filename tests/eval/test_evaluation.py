"""`emapg eval`: the pass@k estimator, and the command end to end on a tiny model."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from emapg.cli import main
from emapg.eval.math import ks, pass_at_k, summarize
from helpers import PROBLEMS, boxed_model


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


@pytest.fixture(scope="module")
def boxed_model_dir(tmp_path_factory):
    """A tiny model taught to answer the three problems with "\\boxed{...}", often but not always right."""
    return boxed_model(tmp_path_factory.mktemp("boxed-model"), "three", copies=1, steps=40)


@pytest.mark.slow
def test_eval_end_to_end_figures_match_the_responses(boxed_model_dir, tmp_path, capsys):
    model_dir, data = boxed_model_dir
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(model_dir), "--data", str(data), "--n", "2"]
    argv += ["--max-new-tokens", "16", "--temperature", "1.0", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert [(r["example"], r["sample"]) for r in rows] == [(p, s) for p in range(3) for s in range(2)]
    assert {r["reference"] for r in rows} == {p["answer"] for p in PROBLEMS}
    # Recompute every figure from the written responses, grading them again.
    from emapg.tasks.math_grader import score

    assert [r["score"] for r in rows] == [score(r["response"], r["reference"]) for r in rows]
    correct = [sum(r["score"] == 1.0 for r in rows if r["example"] == p) for p in range(3)]
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


@pytest.mark.slow
def test_eval_errors_are_one_line(tmp_path, capsys, boxed_model_dir):
    model_dir, data = boxed_model_dir
    assert main(["eval", "--model", str(tmp_path / "none"), "--data", str(data), "--out", str(tmp_path)]) == 2
    assert "model path" in capsys.readouterr().err
    assert (
        main(["eval", "--model", str(model_dir), "--data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path)])
        == 2
    )
    assert capsys.readouterr().err == f"emapg: error: math data {str(tmp_path / 'x.jsonl')!r}: no such file\n"
    assert (
        main(["eval", "--model", str(model_dir), "--data", str(data), "--n", "0", "--out", str(tmp_path)])
        == 2
    )
    assert "--n" in capsys.readouterr().err


@pytest.fixture(scope="module")
def twenty_one(boxed_model_dir):
    """21 problems (three chunks of PROBLEMS_PER_CALL = 8) in a file of their own."""
    model_dir, data = boxed_model_dir
    path = data.parent / "twentyone.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS * 7))
    return model_dir, path


def _eval(model_dir, data, out, *extra):
    return main(["eval", "--model", str(model_dir), "--data", str(data), "--n", "2", "--max-new-tokens", "12",
                 "--no-progress", "--out", str(out), *extra])  # fmt: skip


@pytest.mark.slow
def test_a_killed_evaluation_resumes_to_the_uninterrupted_results(twenty_one, tmp_path, monkeypatch):
    from emapg.eval import files as eval_files

    model_dir, data = twenty_one
    assert _eval(model_dir, data, tmp_path / "straight") == 0
    straight = (tmp_path / "straight" / "responses.jsonl").read_text()
    # Killed while sampling the second chunk, after the first was written, with a torn line
    # (a kill inside a write) at the end of its part file.
    calls = {"n": 0}
    real = eval_files.sample_and_score

    def dies_on_the_second_chunk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            with open(tmp_path / "killed" / "responses.part-0.jsonl", "a") as f:
                f.write('{"dataset": "twentyone", "chunk": 1, "chu')
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_files, "sample_and_score", dies_on_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        _eval(model_dir, data, tmp_path / "killed")
    monkeypatch.setattr(eval_files, "sample_and_score", real)
    written = (tmp_path / "killed" / "responses.part-0.jsonl").read_text().splitlines()
    assert len(written) == 8 * 2 + 1  # the first chunk, and the torn line
    calls["n"] = 0
    monkeypatch.setattr(
        eval_files, "sample_and_score", lambda *a, **k: (calls.update(n=calls["n"] + 1), real(*a, **k))[1]
    )
    assert _eval(model_dir, data, tmp_path / "killed") == 0
    assert calls["n"] == 2  # only the two chunks not yet written were sampled
    assert (tmp_path / "killed" / "responses.jsonl").read_text() == straight
    assert not list((tmp_path / "killed").glob("responses.part-*"))
    results = [
        json.loads((tmp_path / d / "results.json").read_text())["datasets"] for d in ("straight", "killed")
    ]
    assert results[0] == results[1]


@pytest.mark.slow
def test_a_finished_evaluation_is_reused_and_other_settings_stop(twenty_one, tmp_path, capsys):
    model_dir, data = twenty_one
    assert _eval(model_dir, data, tmp_path) == 0
    before = (tmp_path / "responses.jsonl").read_text()
    assert _eval(model_dir, data, tmp_path) == 0  # nothing left to sample: the same figures
    assert (tmp_path / "responses.jsonl").read_text() == before
    capsys.readouterr()
    assert _eval(model_dir, data, tmp_path, "--temperature", "0.5") == 2
    err = capsys.readouterr().err
    assert "holds an evaluation with another settings" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_model_or_data_written_again_at_the_same_path_is_another_evaluation(twenty_one, tmp_path, capsys):
    """`emapg export` to a folder emptied first, or a data file edited in place: the same paths,
    but the finished evaluation in --out is of other files and must not be reported as theirs."""
    model_dir, data = (
        shutil.copytree(twenty_one[0], tmp_path / "model"),
        shutil.copy(twenty_one[1], tmp_path),
    )
    assert _eval(model_dir, data, tmp_path / "out") == 0
    weights = next(Path(model_dir).glob("*.safetensors"))
    later = weights.stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(later, later))  # written again a second later, same size
    capsys.readouterr()
    assert _eval(model_dir, data, tmp_path / "out") == 2
    assert "another model (its files were written again since)" in capsys.readouterr().err
    assert _eval(model_dir, data, tmp_path / "out2") == 0
    with open(data, "a") as f:
        f.write(json.dumps(PROBLEMS[0]) + "\n")
    assert _eval(model_dir, data, tmp_path / "out2") == 2
    assert "another data (a file was written again since)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_benchmark_of_the_wrong_size_stops(boxed_model_dir, tmp_path, capsys):
    model_dir, _ = boxed_model_dir
    aime = tmp_path / "aime24.jsonl"
    aime.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    assert _eval(model_dir, aime, tmp_path / "out") == 2
    assert "has 3 problems; aime24 has 30" in capsys.readouterr().err


@pytest.mark.slow
def test_paper_protocol_is_the_default_and_options_override_it(boxed_model_dir, tmp_path):
    model_dir, data = boxed_model_dir
    assert main(["eval", "--model", str(model_dir), "--data", str(data), "--n", "2", "--no-progress",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    settings = json.loads((tmp_path / "eval.json").read_text())["settings"]
    assert {k: settings[k] for k in ("n", "temperature", "top_p", "max_new_tokens", "seed")} == {
        "n": 2,
        "temperature": 0.8,
        "top_p": 0.9,
        "max_new_tokens": 28000,
        "seed": 429,
    }


@pytest.mark.slow
def test_training_validates_on_eval_datasets(boxed_model_dir, tmp_path):
    """eval.datasets at each evaluation, for the policy and the EMA anchor: the task's own
    held-out problems given again as a dataset must score exactly eval/accuracy (the same
    prompts, rows and noise), and pass@k is the estimator's over those rows."""
    from emapg.training import loop as trainer
    from emapg.training.config import load_config

    model_dir, data = boxed_model_dir
    cfg = load_config(None, [
        f"model.path={model_dir}", f"train.output_dir={tmp_path}", "train.name=run", "task.name=math",
        f"task.train_files=[{data}]", f"task.eval_files=[{data}]", f"eval.datasets=[{data}]", "eval.samples=4",
        "rollout.prompts_per_step=3", "rollout.group_size=2", "rollout.max_new_tokens=16", "train.steps=2",
        "train.eval_every=2", "anchor.update_period=1", "anchor.eta=0.5", "train.progress=false",
        "train.tensorboard=false", "task.reward_isolation=inline",
    ])  # fmt: skip
    trainer.train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        for prefix in ("eval/", "eval/anchor/"):
            assert r[f"{prefix}three/accuracy"] == r[f"{prefix}accuracy"]
            assert r[f"{prefix}three/pass@1"] == pytest.approx(r[f"{prefix}accuracy"])
            assert r[f"{prefix}three/pass@1"] <= r[f"{prefix}three/pass@2"] <= r[f"{prefix}three/pass@4"]
    assert 0 < evals[0]["eval/three/accuracy"] < 1  # a mix of right and wrong: the figures can tell
