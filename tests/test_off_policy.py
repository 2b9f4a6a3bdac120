"""Off-policy-correct updates with the hf engine: pi_old recomputed or taken from the engine,
the rollout correction in the loop, top-p's exact weights, bfloat16 training, config errors.
The same with a real bfloat16 vLLM is in tests/test_vllm_mismatch.py."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import sample
from emapg.algo.rollout_correction import correct
from emapg.errors import EmapgError
from emapg.model.models import load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training import update
from emapg.training.config import load_config
from test_trainer import config


def _records(root):
    return [json.loads(line) for line in (root / "quickstart" / "metrics.jsonl").read_text().splitlines()]


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


COMMON = ["train.steps=2", "train.eval_every=2", "algo.minibatches=2", "algo.epochs=2", "kl.k=4"]


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


def test_recomputed_pi_old_makes_the_first_minibatch_on_policy(tmp_path, tiny_model_dir):
    """With pi_old from the trainer's own pass the first minibatch's ratio is 1 up to the float32
    rounding of two forwards over differently composed micro-batches (0 to 1e-6 here), far inside
    a clip range of 1e-3, so nothing clips there. (The contrast with the engine's pi_old needs an
    engine whose numbers differ: tests/test_vllm_mismatch.py.)"""
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


def test_bfloat16_training_end_to_end_through_the_hf_engine(tmp_path, tiny_model_dir):
    trainer.train(
        config(tmp_path, tiny_model_dir, "model.dtype=bfloat16", "train.steps=2", "train.eval_every=2")
    )
    records = _records(tmp_path)
    for r in records[1:]:
        assert all(r[k] == r[k] for k in ("loss/policy", "kl/value", "grad_norm"))  # no NaN
        assert "time/old_logp_s" not in r  # the hf engine samples in the policy's own dtype
    saved = tmp_path / "quickstart" / "checkpoints" / "step_2" / "policy" / "model.safetensors"
    with safe_open(str(saved), "pt") as f:
        names = f.keys()  # a safetensors file handle, not a dict
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}


@pytest.mark.parametrize(
    "overrides, recompute",
    [
        ([], False),
        (["rollout.top_p=0.9"], True),
        (["rollout.engine=vllm"], True),
        (["rollout.engine=vllm", "algo.old_logp=engine"], False),
        (["algo.old_logp=recompute"], True),
        (["model.dtype=bfloat16"], False),
    ],
)
def test_when_pi_old_is_recomputed(overrides, recompute):
    assert load_config(None, overrides).recomputes_old_logp is recompute


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.dtype=bfloat16"],
            r"^unknown config key 'rollout.dtype': a setting of rollout.engine=vllm",
        ),
        (["algo.old_logp=engine", "rollout.top_p=0.9"], r"^algo.old_logp=engine with rollout.top_p < 1"),
        (["algo.rollout_correction_cap=1"], r"^algo.rollout_correction_cap: input should be greater than 1"),
        (["algo.rollout_correction=tis"], r"^algo.rollout_correction: unknown 'tis'"),
        (["algo.old_logp=trainer"], r"^algo.old_logp: unknown 'trainer'"),
        (["lora.r=8", "anchor.dtype=bfloat16"], r"^anchor.dtype=bfloat16: with LoRA"),
    ],
)
def test_off_policy_config_errors_are_one_line(overrides, message):
    with pytest.raises(EmapgError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
