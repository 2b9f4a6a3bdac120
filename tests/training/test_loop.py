"""Runs of the training loop (emapg.training.loop): no anchor built or run without a KL, an exact
resume, the EMA period counted in training or optimiser steps, and the warm-up ratio as a share
of all optimiser steps."""

import json

import pytest
import torch

from emapg.model.models import load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training import run as run_module
from helpers import config


def test_no_anchor_is_built_or_run_without_kl(tmp_path, tiny_model_dir, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("anchor pass ran with kl.beta = 0")

    monkeypatch.setattr(trainer, "anchor_pass", forbidden)
    monkeypatch.setattr(run_module, "Anchor", forbidden)
    cfg = config(
        tmp_path, tiny_model_dir, "kl.beta=0", "anchor.kind=none", "train.steps=2", "train.eval_every=2"
    )
    result = trainer.train(cfg)
    records = [
        json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("kl/value" not in r and r["anchor/updates"] == 0 for r in records[1:])  # no KL, not 0
    assert result["accuracy_after"] == records[-1]["eval/accuracy"]


def _strip_times(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, tiny_model_dir):
    common = ["train.steps=4", "train.eval_every=2", "train.save_every=2", "anchor.update_period=1", "kl.k=4",
              "algo.minibatches=2", "algo.epochs=2", "anchor.period_unit=optimizer_steps"]  # fmt: skip
    straight = config(tmp_path / "a", tiny_model_dir, *common)
    trainer.train(straight)
    # Interrupted after step 2 (its checkpoint), then resumed to step 4.
    first = config(tmp_path / "b", tiny_model_dir, *common, "train.steps=2")
    trainer.train(first)
    with open(tmp_path / "b" / "quickstart" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/mean": 0.5}\n{"step": 3, "rew')  # a torn record past the checkpoint
    resumed = config(tmp_path / "b", tiny_model_dir, *common)
    trainer.train(resumed, resume=True)

    def read(root):
        run = root / "quickstart"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        ckpt = run / "checkpoints" / "step_4"
        weights = load_model_and_tokenizer(str(ckpt / "policy"))[0].state_dict()
        return records, weights, json.loads((ckpt / "state.json").read_text())

    rec_a, w_a, s_a = read(tmp_path / "a")
    rec_b, w_b, s_b = read(tmp_path / "b")
    assert [r["step"] for r in rec_b] == [0, 1, 2, 3, 4]
    assert _strip_times(rec_a) == _strip_times(rec_b)
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    assert s_a["trainer"]["optimizer_steps"] == s_b["trainer"]["optimizer_steps"] == 16
    assert s_b["anchor"]["updates"] == 16


@pytest.mark.slow
@pytest.mark.parametrize(
    "unit,updates", [("training_steps", [0, 1, 1, 2]), ("optimizer_steps", [1, 2, 3, 4])]
)
def test_the_ema_period_counts_what_the_config_says(tmp_path, tiny_model_dir, unit, updates):
    """Two optimiser steps per training step (two minibatches), period 2: the paper's training
    steps update the anchor every second step, optimiser steps every step."""
    cfg = config(
        tmp_path, tiny_model_dir, "algo.minibatches=2", "anchor.update_period=2", f"anchor.period_unit={unit}",
        "train.steps=4", "train.eval_every=100",
    )  # fmt: skip
    trainer.train(cfg)
    lines = (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["anchor/updates"] for line in lines[1:]] == updates


@pytest.mark.slow
@pytest.mark.parametrize("minibatches,ratio,want", [(2, 0.5, [3 / 4, 1, 1, 1]), (1, 0.75, [2 / 3, 1, 1, 1])])
def test_warmup_ratio_is_a_share_of_all_optimiser_steps(tmp_path, tiny_model_dir, minibatches, ratio, want):
    """4 training steps x `minibatches` optimiser steps, warm-up over round(ratio x that) of them:
    the logged rate is the one after each training step's last optimiser step, (k + 1) / warm-up."""
    cfg = config(
        tmp_path, tiny_model_dir, f"optim.warmup_ratio={ratio}", "optim.lr=1.0", f"algo.minibatches={minibatches}",
        "train.steps=4", "train.eval_every=100", "optim.max_grad_norm=1e-9",
    )  # fmt: skip
    trainer.train(cfg)
    lines = (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["lr"] for line in lines[1:]] == pytest.approx(want)
