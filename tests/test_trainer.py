"""The trainer: its KL path against emapg.algo.kl.token_kl, no anchor without a KL, and resume."""

import json

import pytest
import torch

from conftest import engine_old, sample
from emapg.algo import kl
from emapg.model.anchor import Anchor
from emapg.model.models import load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training import run as run_module
from emapg.training import update
from emapg.training.config import load_config

FAST = [
    "task.num_train=64",
    "task.num_eval=16",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "algo.micro_batch_size=8",
    "train.progress=false",
    "train.tensorboard=false",
]


def config(tmp_path, model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", f"train.output_dir={tmp_path}", *FAST, *extra])


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
    assert all(r["kl/value"] == 0.0 and r["anchor/updates"] == 0 for r in records[1:])
    assert result["accuracy_after"] == records[-1]["eval/accuracy"]


def _strip_times(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


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
