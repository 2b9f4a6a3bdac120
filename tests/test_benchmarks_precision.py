"""bf16-mixed's numerics against fp32 (benchmarks/precision_numerics.py): the trainer's passes on
one batch, bounded by the noise of bfloat16's own rounding of the weights, measured on the same
batch (`rounded`).

The bounds come from the benchmark's runs (benchmarks/RESULTS.md, "Mixed precision"): on the
quickstart's tiny model over seeds 0-9, bf16-mixed's mean |delta log p| against fp32 was 1.5 to
3.1 times the rounded weights' (bf16-mixed rounds activations too), its gradient's cosine to
fp32's at least 0.998; on SmolLM2 (seeds 0-4) see the real-model test. The upper bound is 6x, twice
the largest ratio seen; the lower one fails a bf16-mixed that computes nothing in bfloat16 at all.
The LM head's float32 products are held apart (tests/model/test_precision.py): the tiny model's
small logits would hide a head that rounds its output to bfloat16.
"""

import sys

import pytest

from helpers import FAST, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from precision_numerics import measure  # noqa: E402

SMALL = [o for o in FAST if not o.startswith("algo.micro_batch_size")]


@pytest.mark.slow
def test_bf16_mixed_is_fp32_within_a_few_times_bfloat16s_rounding_of_the_weights(tiny_model_dir):
    got = measure("quickstart", 0, [f"model.path={tiny_model_dir}", *SMALL, "rollout.max_new_tokens=8"])
    mixed, rounded = got["bf16-mixed"], got["rounded"]
    assert got["tokens"] > 50
    assert 0.1 * rounded["mean_dlogp"] < mixed["mean_dlogp"] < 6 * rounded["mean_dlogp"]
    assert mixed["mean_dkl"] < 6 * rounded["mean_dkl"]
    assert mixed["cos"] >= 0.995


@pytest.mark.slow
def test_on_smollm2_the_bf16_mixed_gradient_points_where_fp32s_does(smollm2):
    """The issue's bar: a cosine of at least 0.99 between the bf16-mixed and float32 gradients of
    the update's loss on the real model as shipped (0.994-0.999 over seeds 0-4: RESULTS.md). Not on
    its warm start, whose changes bfloat16 cannot hold: there the weights rounded to bfloat16 alone
    give a cosine of 0.7-0.8 (RESULTS.md, "Mixed precision")."""
    cache, folder = smollm2
    got = measure("smollm2_math", 0, [f"model.path={folder}", f"model.cache_dir={cache}",
                                      "warmstart.pretrained=false", "rollout.prompts_per_step=2"])  # fmt: skip
    assert got["bf16-mixed"]["cos"] >= 0.99
    assert got["bf16-mixed"]["mean_dlogp"] < 6 * got["rounded"]["mean_dlogp"]
