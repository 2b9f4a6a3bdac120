"""Non-finite losses skip the optimiser step (weights untouched); too many in a row stop the run."""

import json
import math

import pytest
import torch

from emapg.algo.guards import step_is_finite
from emapg.errors import EmapgError
from emapg.model.models import load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training.run import TrainerState
from test_trainer import config


def test_counts_skips_and_stops_at_the_limit():
    state = TrainerState()
    assert step_is_finite(state, 1.0, 2.0, 3)
    assert not step_is_finite(state, math.nan, 2.0, 3)
    assert not step_is_finite(state, 1.0, math.inf, 3)
    assert step_is_finite(state, 1.0, 2.0, 3)  # a good step ends the run of bad ones
    assert (state.skipped_steps, state.bad_in_row) == (2, 0)
    assert not step_is_finite(state, math.nan, math.nan, 3)
    assert not step_is_finite(state, math.nan, math.nan, 3)
    with pytest.raises(EmapgError, match="3 optimiser steps in a row had a non-finite loss"):
        step_is_finite(state, math.nan, math.nan, 3)


def test_nan_steps_leave_weights_untouched_and_stop_the_run(tmp_path, tiny_model_dir, monkeypatch):
    real = trainer.step_advantages
    calls = []

    def nan_from_step_3(*args):
        calls.append(1)
        adv = real(*args)
        return adv * math.nan if len(calls) >= 3 else adv

    monkeypatch.setattr(trainer, "step_advantages", nan_from_step_3)
    cfg = config(
        tmp_path, tiny_model_dir, "train.steps=6", "train.save_every=2", "train.eval_every=100",
        "train.max_bad_steps=3", "train.keep_checkpoints=5",
    )  # fmt: skip
    with pytest.raises(EmapgError, match=r"3 optimiser steps in a row .*train.max_bad_steps=3"):
        trainer.train(cfg)
    run = tmp_path / "quickstart"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["train/skipped_steps"] for r in records[1:]] == [0, 0, 1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]

    def saved(step):
        ckpt = run / "checkpoints" / f"step_{step}"
        weights = load_model_and_tokenizer(str(ckpt / "policy"))[0].state_dict()
        state = json.loads((ckpt / "state.json").read_text())
        return weights, state, torch.load(ckpt / "optimizer.pt", weights_only=True)

    w2, s2, o2 = saved(2)
    w4, s4, o4 = saved(4)
    assert all(torch.equal(w2[k], w4[k]) and torch.isfinite(w4[k]).all() for k in w2)
    assert s2["trainer"]["optimizer_steps"] == s4["trainer"]["optimizer_steps"] == 2
    assert s4["trainer"]["skipped_steps"] == 2
    for a, b in zip(o2["optimizer"]["state"].values(), o4["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)  # AdamW moments untouched too
