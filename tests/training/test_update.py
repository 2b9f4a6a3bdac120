"""The update (emapg.training.update): the trainer's KL and policy-gradient losses against the
formulas and emapg.algo.kl.token_kl; micro-batching by a token budget, overlong masking and
gradient checkpointing; off-policy-correct updates with the hf engine (pi_old recomputed or taken
from the engine, the rollout correction in the loop, top-p's exact weights, bfloat16 training);
non-finite steps leaving the weights untouched; and multi-turn tokens that the environment
inserted left out of the loss and KL. The same with a real bfloat16 vLLM:
tests/rollout/test_vllm_mismatch.py."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from emapg.algo import kl
from emapg.algo.policy_loss import aggregate
from emapg.algo.rollout_correction import correct
from emapg.errors import DivergedError
from emapg.model.anchor import Anchor
from emapg.model.models import (
    build_tiny_model,
    build_tiny_tokenizer,
    checkpoint_activations,
    load_model_and_tokenizer,
)
from emapg.tasks.search.task import TINY_EXTRA_CHARS
from emapg.training import loop as trainer
from emapg.training import update
from emapg.training.config import Config, load_config
from emapg.training.metrics import PhaseTimer
from emapg.training.run import TrainerState
from emapg.training.update import token_losses
from helpers import config, engine_old, sample


def _perturb(model, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


# kl.iw_clip as an override and as the tuple token_kl gets (null: one-sided)
BOTH, UPPER, LOWER = ("[0.5, 2.0]", (0.5, 2.0)), ("[null, 2.0]", (None, 2.0)), ("[0.5, null]", (0.5, None))


CASES = [
    ("topk", "reverse", 8, BOTH),
    ("topk", "forward", 8, BOTH),
    ("exact", "reverse", 0, BOTH),
    ("k3", "reverse", 0, UPPER),
    ("k5", "forward", 0, LOWER),
]


@pytest.mark.parametrize("estimator,direction,k,clip", CASES)
def test_trainer_kl_path_equals_token_kl(tmp_path, tiny_model_dir, estimator, direction, k, clip):
    cfg = config(
        tmp_path, tiny_model_dir, f"kl.estimator={estimator}", f"kl.direction={direction}", f"kl.k={k}",
        "rollout.temperature=0.8", f"kl.iw_clip={clip[0]}",
    )  # fmt: skip
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    sampler, _ = load_model_and_tokenizer(tiny_model_dir)
    batch = sample(
        model, tokenizer, ["12+34=", "5+6=", "70+8="] * 2, max_new_tokens=5, temperature=0.8,
        topk=k if direction == "reverse" else 0,
    )  # fmt: skip
    # Policy and anchor differ from the sampling policy (off-policy minibatch, moved anchor).
    anchor = Anchor(model, 0.9, 1)
    _perturb(model, 1)
    _perturb(anchor.model, 2)
    vocab = model.get_output_embeddings().weight.shape[0]
    old = engine_old(batch)
    ref = update.anchor_pass(cfg, anchor, batch, old, vocab)
    advantages = torch.linspace(-1, 1, 6)
    pg, kl_tok, *_ = update.token_losses(cfg, model, batch, advantages, old, ref)

    def logits_of(m):
        out = m(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
        return out[:, batch.prompt_len - 1 : -1] / 0.8

    with torch.no_grad():
        sampling_logits = logits_of(sampler)
        anchor_logits = logits_of(anchor.model)
    want = kl.token_kl(
        logits_of(model), anchor_logits, batch.responses, estimator=estimator, direction=direction,
        k=k if estimator != "exact" else vocab, sampling_logp=sampling_logits, iw_clip=clip[1],
    )  # fmt: skip
    mask = batch.response_mask
    assert mask.sum() > 6
    # Recorded sampling log-probs come from the KV-cached generate pass: equal up to rounding.
    assert torch.allclose(kl_tok[mask], want[mask], atol=1e-5)
    got_grads = torch.autograd.grad((kl_tok * mask).sum(), list(model.parameters()), retain_graph=True)
    want_grads = torch.autograd.grad((want * mask).sum(), list(model.parameters()))
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    # The policy-gradient part sees the same log-probs.
    logp = torch.log_softmax(logits_of(model), -1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - batch.sampling_logp)
    adv = advantages.unsqueeze(1)
    want_pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    want_pg = torch.where(adv < 0, torch.minimum(want_pg, -3.0 * adv), want_pg)  # the dual clip at 3
    assert torch.allclose(pg[mask], want_pg[mask], atol=1e-5)


@pytest.mark.parametrize("loss,level", [("cispo", "token"), ("ppo_clip", "sequence"), ("cispo", "sequence")])
def test_policy_loss_choices_reach_the_update(tmp_path, tiny_model_dir, loss, level):
    """algo.loss and algo.ratio_level as the update computes them, against the formulas written out
    here from the policy's own log-probs (the policy perturbed away from the sampling one)."""
    cfg = config(tmp_path, tiny_model_dir, f"algo.loss={loss}", f"algo.ratio_level={level}", "algo.clip_low=0.05",
                 "algo.clip_high=0.05", "kl.beta=0", "anchor.kind=none")  # fmt: skip
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    batch = sample(model, tokenizer, ["12+34=", "5+6=", "70+8="] * 2, max_new_tokens=5)
    _perturb(model, 1)
    advantages = torch.linspace(-1, 1, 6)
    pg, _, clipped, _ = update.token_losses(cfg, model, batch, advantages, engine_old(batch), None)
    with torch.no_grad():
        logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, batch.prompt_len - 1 : -1], -1).gather(
        -1, batch.responses.unsqueeze(-1)
    )[..., 0]
    mask, adv = batch.response_mask, advantages.unsqueeze(1)
    delta = logp - batch.sampling_logp
    if level == "sequence":  # GSPO: the mean log-ratio of the response, for each of its tokens
        delta = ((delta * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(delta)
    ratio = delta.exp()
    if loss == "cispo":
        want = -ratio.clamp(0.95, 1.05) * adv * logp
    else:
        want = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.95, 1.05))
    assert torch.allclose(pg.detach()[mask], want[mask], atol=1e-5)
    assert clipped[mask].any() and not clipped[mask].all()  # the clip range matters here


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


def _records(root):
    return [json.loads(line) for line in (root / "quickstart" / "metrics.jsonl").read_text().splitlines()]


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


COMMON = ["train.steps=2", "train.eval_every=2", "algo.minibatches=2", "algo.epochs=2", "kl.k=4"]


@pytest.mark.slow
def test_default_hf_run_is_the_uncorrected_engine_path_bit_for_bit(tmp_path, tiny_model_dir):
    """hf engine, float32: auto takes pi_old from the engine (no extra pass) and the correction's
    weights are exactly 1, so every figure equals the run that asks for neither."""
    trainer.train(config(tmp_path / "a", tiny_model_dir, *COMMON))
    trainer.train(
        config(
            tmp_path / "b", tiny_model_dir, *COMMON, "algo.old_logp=engine", "algo.rollout_correction=none"
        )
    )
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert _untimed(a) == _untimed(b)
    for r in a[1:]:
        assert "time/old_logp_s" not in r and not any(k.startswith("mismatch/") for k in r)
        assert r["rollout_correction/weight_mean"] == 1.0 and r["rollout_correction/weight_max"] == 1.0
        assert r["rollout_correction/masked_frac"] == 0.0


@pytest.mark.slow
def test_recomputed_pi_old_makes_the_first_minibatch_on_policy(tmp_path, tiny_model_dir):
    """With pi_old from the trainer's own pass the first minibatch's ratio is 1 up to the float32
    rounding of two forwards over differently composed micro-batches (0 to 1e-6 here), far inside
    a clip range of 1e-3, so nothing clips there. (The contrast with the engine's pi_old needs an
    engine whose numbers differ: tests/rollout/test_vllm_mismatch.py.)"""
    cfg = config(tmp_path, tiny_model_dir, *COMMON, "algo.old_logp=recompute", "algo.clip_low=1e-3",
                 "algo.clip_high=1e-3")  # fmt: skip
    trainer.train(cfg)
    for r in _records(tmp_path)[1:]:
        assert r["clip_frac/first_minibatch"] == 0.0
        assert r["ppo_ratio/first_minibatch_max_dev"] < 1e-3
        assert r["time/old_logp_s"] > 0
        # The hf engine in float32 is the policy itself: mu and pi_old agree to rounding.
        assert 0 <= r["mismatch/kl"] < 1e-8 and r["mismatch/max_abs_logp"] < 1e-4
        assert r["mismatch/topk_overlap"] > 0.95


def test_top_p_weights_are_the_nucleus_mass_exactly(tiny_model_dir):
    """top_p < 1: the engine records log mu, the truncated, renormalised distribution, so the
    weight pi_old / mu of every sampled token is the nucleus' mass Z_t at its position."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    batch = sample(model, tokenizer, ["12+34=", "5+6=", "70+8="] * 4, max_new_tokens=5, top_p=0.7)
    cfg = load_config(None, ["rollout.top_p=0.7"])
    old_logp, _ = update.response_logp(cfg, model, batch, cfg.rollout.temperature)
    weight = correct(old_logp, batch.sampling_logp, batch.response_mask, "token_tis", 1e9).weight
    with torch.no_grad():
        logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
    p = torch.softmax(logits[:, batch.prompt_len - 1 : -1].double(), -1)
    order = p.sort(-1, descending=True).values
    nucleus = order.cumsum(-1) - order < 0.7  # the smallest set with mass >= top_p
    mass = (order * nucleus).sum(-1)
    mask = batch.response_mask
    assert (mass[mask] < 1).any()  # the nucleus cut something: the check has teeth
    torch.testing.assert_close(weight[mask].double(), mass[mask], rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("precision, saved", [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_bfloat16_training_end_to_end_through_the_hf_engine(tmp_path, tiny_model_dir, precision, saved):
    trainer.train(
        config(tmp_path, tiny_model_dir, f"train.precision={precision}", "train.allow_lost_updates=true",
               "train.steps=2", "train.eval_every=2")
    )  # fmt: skip
    records = _records(tmp_path)
    for r in records[1:]:
        assert all(r[k] == r[k] for k in ("loss/policy", "kl/value", "grad_norm"))  # no NaN
        # bfloat16 rounds the engine's decode and the whole-row pass differently: pi_old recomputed
        assert "time/old_logp_s" in r and r["mismatch/max_abs_logp"] > 1e-4
    path = tmp_path / "quickstart" / "checkpoints" / "step_2" / "policy" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        names = f.keys()  # a safetensors file handle, not a dict
        assert {f.get_tensor(k).dtype for k in names} == {saved}


def _moved(start: dict, run_dir) -> float:
    """The share of the weights that differ from `start` (in the run's dtype) at its last checkpoint."""
    path = run_dir / "quickstart" / "checkpoints" / "step_10" / "policy" / "model.safetensors"
    with safe_open(str(path), "pt") as f:  # the tied embedding once, as the file holds it
        names = f.keys()  # a safetensors file handle, not a dict
        end = {k: f.get_tensor(k) for k in names}
    return sum(int((w != start[k].to(w.dtype)).sum()) for k, w in end.items()) / sum(
        w.numel() for w in end.values()
    )


@pytest.mark.slow
def test_the_papers_lr_moves_every_weight_under_bf16_mixed_and_few_in_bfloat16(tmp_path, tiny_model_dir):
    """The paper's recipes (lr 1e-6, weight decay 0.01) for 10 steps: float32 master weights keep
    every update, bfloat16 weights (insisted on) round most away. k1 gives every weight a gradient
    whether or not the random model earns a reward."""
    recipe = ["optim.lr=1e-6", "optim.weight_decay=0.01", "optim.warmup_steps=0", "kl.estimator=k1",
              "kl.beta=1.0", "train.steps=10", "train.eval_every=10", "train.save_every=10"]  # fmt: skip
    start = load_model_and_tokenizer(tiny_model_dir)[0].state_dict()
    trainer.train(config(tmp_path / "mixed", tiny_model_dir, "train.precision=bf16-mixed", *recipe))
    trainer.train(config(tmp_path / "true", tiny_model_dir, "train.precision=bf16-true",
                         "train.allow_lost_updates=true", *recipe))  # fmt: skip
    mixed, true = _moved(start, tmp_path / "mixed"), _moved(start, tmp_path / "true")
    assert mixed >= 0.99, mixed
    assert true < 0.2, true  # of those it kept, most were weights near zero


@pytest.mark.slow
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
    with pytest.raises(DivergedError, match=r"3 optimiser steps in a row .*train.max_bad_steps=3"):
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


class NoisyAtMasked(torch.nn.Module):
    """The wrapped model's logits, plus large noise wherever the next token is masked out."""

    def __init__(self, model, noise):
        super().__init__()
        self.inner, self.noise, self.config = model, noise, model.config

    def get_output_embeddings(self):
        return None  # not a plain linear head: the trainer uses these full logits

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = out.logits + self.noise
        return out


@pytest.mark.slow
def test_loss_and_kl_ignore_masked_tokens():
    torch.manual_seed(0)
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    policy = build_tiny_model(tok, max_position_embeddings=64, seed=1)
    anchor = build_tiny_model(tok, max_position_embeddings=64, seed=2)
    n, p, length, vocab = 3, 4, 10, len(tok)
    seq = torch.randint(4, vocab, (n, p + length))
    mask = torch.rand(n, length) < 0.5
    mask[:, 0] = True
    from emapg.batch import Rollout

    batch = Rollout(
        sequences=seq, attention_mask=torch.ones_like(seq), prompt_len=p, response_mask=mask,
        sampling_logp=torch.randn(n, length).clamp(max=0), topk_ids=torch.randint(0, vocab, (n, length, 4)),
        entropy=torch.zeros(n, length), texts=["."] * n,
        truncated=torch.zeros(n, dtype=torch.bool),
    )  # fmt: skip
    cfg = Config()
    cfg.kl.k = 4
    from emapg.model.anchor import Anchor
    from emapg.training.update import anchor_pass

    old = engine_old(batch)
    ref = anchor_pass(cfg, Anchor(anchor, 1.0, 1), batch, old, vocab)
    advantages = torch.randn(n)

    def loss_and_grad(noise_scale):
        noise = torch.zeros(n, p + length, vocab)
        # The logits at column P + t - 1 predict response token t: disturb those of masked tokens.
        noise[:, p - 1 : -1][~mask] = noise_scale * torch.randn(int((~mask).sum()), vocab)
        policy.zero_grad()
        pg, kl_tok, *_ = token_losses(cfg, NoisyAtMasked(policy, noise), batch, advantages, old, ref)
        loss = aggregate(pg + 0.1 * kl_tok, mask, "token_mean", float(mask.sum()))
        loss.backward()
        return loss.detach(), [q.grad.clone() for q in policy.parameters()]

    clean_loss, clean_grads = loss_and_grad(0.0)
    noisy_loss, noisy_grads = loss_and_grad(50.0)
    assert torch.equal(clean_loss, noisy_loss)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=0) for a, b in zip(clean_grads, noisy_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in clean_grads)


def test_shared_prompts_give_the_whole_row_gradients_with_fewer_tokens(tmp_path, tiny_model_dir):
    """Groups of 4 samples of 3 prompts, split into 2 random minibatches of micro-batches of 3:
    each minibatch's rows are put in order so that a group's rows sit together, and the passes
    compute its prompt once. The gradients are the whole-row passes' to float32 rounding (the
    bound of the other micro-batching tests here), on fewer tokens."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(1)
    prompts = [p for p in PROMPTS[:3] for _ in range(4)]
    batch = sample(model, tokenizer, prompts, max_new_tokens=5, stop=list("0123456789"))
    advantages = torch.linspace(-1, 1, len(prompts))
    common = ["kl.beta=0", "anchor.kind=none", "algo.micro_batch_size=3", "algo.minibatches=2"]
    results = {}
    for share in ("false", "true"):
        cfg = config(tmp_path, tiny_model_dir, *common, f"algo.share_prompts={share}")
        model = load_model_and_tokenizer(tiny_model_dir)[0]
        passes = []
        model.get_decoder().register_forward_pre_hook(
            lambda _m, _a, kw, passes=passes: passes.append(kw["input_ids"]), with_kwargs=True
        )
        grads, stats = _grads_after_update(cfg, model, batch, advantages)
        results[share] = grads, stats, passes
    (want, want_stats, whole), (got, stats, shared) = results["false"], results["true"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert stats == pytest.approx(want_stats, rel=1e-4, abs=1e-8)
    assert sum(ids.numel() for ids in shared) < sum(ids.numel() for ids in whole)
    prompt_passes = shared[0::2]  # each micro-batch: its prompts, then its responses
    assert len(prompt_passes) == len(whole) and sum(len(ids) for ids in prompt_passes) < len(prompts)
    assert all(len(ids.unique(dim=0)) == len(ids) for ids in prompt_passes)  # a group's rows were together
