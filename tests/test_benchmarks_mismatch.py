"""benchmarks/rollout_mismatch.py's own figures at a tiny size, without vLLM: the entropy it
prints, the entropy knob of rollout_engines.py, and the gap figures of an engine that samples
exactly the trainer's pi_old. (The script's vLLM runs are not in the suite.)"""

import dataclasses
import math
import sys

import pytest
import torch

from emapg.algo import rollout_correction
from emapg.rollout import SamplingParams
from emapg.rollout.hf import HFEngine
from emapg.training import update
from emapg.training.config import load_config
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from bf16_weights import rounding_figures  # noqa: E402
from random_models import padded_tokenizer, random_qwen2  # noqa: E402
from rollout_engines import ENTROPY_TOL, next_token_entropy, set_entropy  # noqa: E402
from rollout_mismatch import CAPS, mismatch_figures  # noqa: E402


def tiny_qwen():
    """A random Qwen2 of 64 channels over a 256-token vocabulary, and its tokenizer."""
    tokenizer = padded_tokenizer(256)
    model = random_qwen2(tokenizer, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return tokenizer, model


def enumerated_entropy(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """-sum_v p_v log p_v over the whole vocabulary from the model's full logits, in float64."""
    logp = torch.log_softmax(model(ids).logits.double() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def test_set_entropy_reaches_its_target_and_the_entropy_is_the_enumerated_one():
    _, model = tiny_qwen()
    ids = torch.randint(10, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    assert float(next_token_entropy(model, ids).mean()) > math.log(256) - 0.1  # random: flat
    factor = set_entropy(model, ids, 2.0)
    assert factor > 1
    assert abs(float(next_token_entropy(model, ids).mean()) - 2.0) <= ENTROPY_TOL
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            ours = next_token_entropy(model, ids, temperature).double()
            assert torch.allclose(ours, enumerated_entropy(model, ids, temperature), atol=1e-4)


def test_an_engine_that_samples_the_trainers_pi_old_shows_no_gap():
    tokenizer, model = tiny_qwen()
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)  # peaked, not flat: about 1 nat over its responses at T = 0.7
    g = torch.Generator().manual_seed(1)
    prompts = [
        [tokenizer.bos_token_id, *torch.randint(10, 256, (n,), generator=g).tolist()] for n in (3, 6, 4, 5)
    ]
    k, temperature = 8, 0.7
    cfg = load_config(None, [f"rollout.temperature={temperature}", f"kl.k={k}", "algo.micro_batch_size=3"])
    batch = HFEngine(model, tokenizer).sample(prompts, SamplingParams(6, temperature, topk=k, seed=1))
    logp, topk_ids = update.response_logp(cfg, model, batch, temperature, k)
    own = dataclasses.replace(
        batch, sampling_logp=logp.masked_fill(~batch.response_mask, 0.0), topk_ids=topk_ids
    )

    f = mismatch_figures(cfg, model, own, k)
    assert f["kl"] == 0 and f["max_abs_logp"] == 0 and f["topk_overlap"] == 1
    assert all(f[f"{mode}@{cap:g}"] == 0 for cap in CAPS for mode in rollout_correction.MASKS)
    assert f["tis_weight_mean"] == 1 and f["tis_truncated"] == 0
    # The trainer's entropy over the responses is the one the hf engine enumerated as it sampled
    # (left-padded prompts, two micro-batches).
    assert 0.5 < f["entropy"] < math.log(256) - 0.5
    assert f["entropy"] == pytest.approx(float(batch.entropy[batch.response_mask].mean()), abs=1e-4)


def test_bf16_rounding_erases_changes_below_half_a_bf16_step():
    start = {"w": torch.ones(4), "b": torch.full((2,), 0.5)}
    # At 1.0 bfloat16's step is 2^-7 (0.0078): +1e-4 and +2e-3 round back to 1.0, +1e-2 does not.
    policy = {"w": torch.tensor([1.0, 1 + 1e-4, 1 + 1e-2, 1 + 2e-3]), "b": torch.full((2,), 0.5)}
    f = rounding_figures(policy, start)
    assert f["changed"] == pytest.approx(3 / 6) and f["erased"] == pytest.approx(2 / 3)
    assert f["median_relative"] == pytest.approx(2e-3, rel=1e-3)  # the median of w's three changes
