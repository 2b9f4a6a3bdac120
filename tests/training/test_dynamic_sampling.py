"""DAPO's dynamic sampling on made-up reward streams: the groups kept, the rounds run, the stop at
the bound and the metrics, exactly; the kept rows assembled across rounds of other widths."""

import json

import pytest
import torch

from emapg.rollout import Rollout
from emapg.training.dynamic_sampling import Round, collect, round_picks, uniform_groups

PAD = 0


def fake_round(number: int, rewards: list[float]) -> Round:
    """A round whose row i holds the token 100 * number + i and a response `number` tokens wide."""
    n, width = len(rewards), number
    tokens = torch.tensor([[100 * number + i] for i in range(n)])
    batch = Rollout(
        sequences=torch.cat([tokens, tokens.expand(n, width)], 1),
        attention_mask=torch.ones(n, 1 + width, dtype=torch.long),
        prompt_len=1,
        response_mask=torch.ones(n, width, dtype=torch.bool),
        sampling_logp=torch.full((n, width), -float(number)),
        topk_ids=torch.zeros(n, width, 2, dtype=torch.long),
        entropy=torch.zeros(n, width),
        texts=[f"r{number}-{i}" for i in range(n)],
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    return Round([f"p{number}-{i // 2}" for i in range(n)], batch, rewards, [None] * n)


def run(stream: list[list[float]], quota: int = 3, max_rounds: int = 5):
    rounds = iter(enumerate(stream, 1))
    return collect(lambda: fake_round(*next(rounds)), quota, 2, max_rounds, PAD)


def test_uniform_groups_and_picks():
    assert uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2) == [True, False, True]
    assert round_picks([True, False, True, False], kept=0, quota=3, last=False) == [1, 3]
    assert round_picks([True, False, True, False], kept=2, quota=3, last=False) == [1]
    assert round_picks([True, False, True, False], kept=0, quota=3, last=True) == [0, 1, 3]  # filled in order


def test_rounds_run_until_the_step_has_its_groups_with_signal():
    kept, metrics = run([[1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 1, 1], [0, 1, 0, 1, 0, 1]])
    # round 1 keeps its group 1; round 2 its groups 0 and 1; round 3 never runs
    assert kept.examples == ["p1-1", "p1-1", "p2-0", "p2-0", "p2-1", "p2-1"]
    assert kept.rewards == [0, 1, 0, 1, 1, 0]
    assert kept.batch.texts == ["r1-2", "r1-3", "r2-0", "r2-1", "r2-2", "r2-3"]
    assert metrics == {"sampling/rounds": 2, "sampling/filtered_frac": 3 / 6}
    # rows of a 1-token and a 2-token round, right-padded to 2: every token and mask where it was
    b = kept.batch
    assert b.prompt_len == 1 and b.responses.tolist() == [[102, PAD], [103, PAD], [200, 200], [201, 201],
                                                          [202, 202], [203, 203]]  # fmt: skip
    assert b.response_mask.sum(-1).tolist() == [1, 1, 2, 2, 2, 2]
    assert b.sampling_logp[:, 0].tolist() == [-1, -1, -2, -2, -2, -2] and b.sampling_logp[0, 1] == 0


def test_at_the_bound_the_last_rounds_groups_without_signal_fill_the_step():
    kept, metrics = run([[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 0, 0]], max_rounds=2)
    assert kept.examples == ["p2-0", "p2-0", "p2-1", "p2-1", "p2-2", "p2-2"]
    assert kept.rewards == [0, 1, 1, 1, 0, 0]
    assert metrics == {"sampling/rounds": 2, "sampling/filtered_frac": 3 / 6}  # round 2's are kept


def test_one_round_with_signal_everywhere_is_the_plain_step():
    kept, metrics = run([[0, 1, 1, 0, 0.5, 1]])
    assert kept.batch.texts == [f"r1-{i}" for i in range(6)]
    assert metrics == {"sampling/rounds": 1, "sampling/filtered_frac": 0.0}


def _records(root):
    return [json.loads(line) for line in (root / "quickstart" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_loop_with_dynamic_sampling_and_overlong_shaping(tmp_path, tiny_model_dir):
    """A training run: every step logs its rounds and the share of groups it filtered, trains on a
    batch of the usual shape, and its overlong term is the linear penalty of its lengths (buffer
    = the whole limit: -penalty * length / limit, so its mean follows the mean length)."""
    from emapg.training import loop as trainer
    from helpers import config

    cfg = config(tmp_path, tiny_model_dir, "algo.dynamic_sampling=true", "algo.max_sampling_rounds=3",
                 "algo.overlong_buffer=5", "algo.overlong_penalty=0.5", "train.steps=3")  # fmt: skip
    trainer.train(cfg)
    records = _records(tmp_path)[1:]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 1 <= r["sampling/rounds"] <= 3 and 0 <= r["sampling/filtered_frac"] < 1
        # groups without signal are left in only at the bound
        assert r["sampling/uniform_frac"] == 0 or r["sampling/rounds"] == 3
        assert r["reward/overlong/mean"] == pytest.approx(-0.5 * r["response_length/mean"] / 5, rel=1e-6)
    assert any(r["sampling/rounds"] > 1 for r in records)  # the tiny model's groups are often all right
