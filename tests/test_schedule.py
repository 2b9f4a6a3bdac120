"""The paper's schedule and loss settings: micro-batching by a token budget, overlong masking,
gradient checkpointing, the EMA period counted in training or optimiser steps, warm-up ratio."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import engine_old, sample
from emapg.model.models import checkpoint_activations, load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training import update
from emapg.training.metrics import PhaseTimer
from emapg.training.run import TrainerState
from test_trainer import config

PROMPTS = ["1+2=", "34+5=", "6=", "78+90=", "1+1=", "2+3="]


def _grads_after_update(cfg, model, batch, advantages, checkpointing=False):
    """The gradient one update leaves (lr 0: the weights stay), and its statistics."""
    if checkpointing:
        checkpoint_activations(model)
    model.train()
    run = SimpleNamespace(
        cfg=cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        scheduler=SimpleNamespace(step=lambda: None), state=TrainerState(), anchor=None,
    )  # fmt: skip
    torch.manual_seed(0)
    stats = update.update(run, batch, advantages, engine_old(batch), None, PhaseTimer())
    return [p.grad.clone() for p in model.parameters()], stats


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    # Stop at any digit: some responses end early, the others run into the length limit.
    batch = sample(model, tokenizer, PROMPTS, max_new_tokens=5, stop=list("0123456789"))
    return batch, torch.linspace(-1, 1, len(PROMPTS))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_token_budget_micro_batches_give_the_fixed_count_gradients(
    tmp_path, tiny_model_dir, rollout, aggregation
):
    batch, advantages = rollout
    lengths = batch.attention_mask.sum(-1)
    common = ["kl.beta=0", "anchor.kind=none", f"algo.loss_aggregation={aggregation}"]
    whole = config(tmp_path, tiny_model_dir, *common, "algo.micro_batch_size=64")
    want, want_stats = _grads_after_update(
        whole, load_model_and_tokenizer(tiny_model_dir)[0], batch, advantages
    )
    for extra in ("algo.micro_batch_size=4", f"algo.micro_batch_tokens={2 * int(lengths.max())}"):
        cfg = config(tmp_path, tiny_model_dir, *common, extra)
        plan = update.micro_batches(cfg, batch, torch.arange(len(PROMPTS)))
        assert len(plan) > 1 and sorted(torch.cat(plan).tolist()) == list(range(len(PROMPTS)))
        got, stats = _grads_after_update(cfg, load_model_and_tokenizer(tiny_model_dir)[0], batch, advantages)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        assert stats == pytest.approx(want_stats, rel=1e-4, abs=1e-8)


def test_token_budget_packs_rows_in_order_up_to_the_budget(tmp_path, tiny_model_dir, rollout):
    batch, _ = rollout
    lengths = batch.attention_mask.sum(-1).tolist()
    budget = 2 * max(lengths)
    cfg = config(tmp_path, tiny_model_dir, f"algo.micro_batch_tokens={budget}")
    plan = update.micro_batches(cfg, batch, torch.arange(len(PROMPTS)))
    assert torch.cat(plan).tolist() == list(range(len(PROMPTS)))  # in order, each row once
    for i, part in enumerate(plan):
        rows = part.tolist()
        assert len(rows) * max(lengths[r] for r in rows) <= budget
        if i + 1 < len(plan):  # full: the next row would not have fitted
            nxt = rows + [plan[i + 1][0].item()]
            assert len(nxt) * max(lengths[r] for r in nxt) > budget


def test_overlong_masking_leaves_cut_responses_out_of_the_loss(tmp_path, tiny_model_dir, rollout):
    """On-policy, the PPO loss is -A * pi / sg(pi) per token: its gradient by hand, over the
    responses that ended (a stop string) only, token mean."""
    batch, advantages = rollout
    assert 0 < int(batch.truncated.sum()) < len(PROMPTS)  # some responses ran out of tokens
    cfg = config(
        tmp_path,
        tiny_model_dir,
        "kl.beta=0",
        "anchor.kind=none",
        "algo.mask_overlong=true",
        "optim.max_grad_norm=0",
    )
    model = load_model_and_tokenizer(tiny_model_dir)[0]
    got, stats = _grads_after_update(cfg, model, batch, advantages)
    model.zero_grad()
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=batch.sequences, attention_mask=batch.attention_mask, position_ids=positions
    ).logits
    logp = torch.log_softmax(logits[:, batch.prompt_len - 1 : -1], -1).gather(
        -1, batch.responses.unsqueeze(-1)
    )[..., 0]
    keep = batch.response_mask & ~batch.truncated.unsqueeze(-1)
    loss = (-advantages.unsqueeze(-1) * torch.exp(logp - logp.detach()) * keep).sum() / keep.sum()
    loss.backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    assert stats["loss/policy"] == pytest.approx(float(loss.detach()), rel=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, tiny_model_dir, rollout):
    batch, advantages = rollout
    cfg = config(tmp_path, tiny_model_dir, "kl.beta=0", "anchor.kind=none", "algo.micro_batch_size=4")
    want, _ = _grads_after_update(cfg, load_model_and_tokenizer(tiny_model_dir)[0], batch, advantages)
    got, _ = _grads_after_update(cfg, load_model_and_tokenizer(tiny_model_dir)[0], batch, advantages, True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


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
