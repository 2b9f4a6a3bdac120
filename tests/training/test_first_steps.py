"""The default run's first steps, pinned: speed work must not change what the quickstart computes.

`emapg train` on the quickstart config, with a short warm start (150 supervised steps: some
problems solved, so the steps have rewards, gradients and a KL) built in the test, then 3 RL
steps. Every logged figure but the timings must equal the values recorded before the speed work
of benchmarks/roofline.py (docs/design.md, "Speed"). A change that alters them on purpose
records new values here and says why in its commit.

Exact equality holds across the CPUs it was pinned on because `emapg train` pins ATen's kernels to AVX2 for
builtin:tiny (models.pin_cpu_kernels): measured here, restricting MKL's GEMM to AVX2
(MKL_ENABLE_INSTRUCTIONS=AVX2) or oneDNN's (ONEDNN_MAX_CPU_ISA=AVX2) changed no figure in any
bit, while ATen's AVX-512 kernels (ATEN_CPU_CAPABILITY=avx512) changed every one from step 0.

The run keeps whole rows (`algo.share_prompts=false`): computing a group's prompt once changes
the passes' figures in their last bits, differently on each machine class, and only this one
class's record could be re-taken here. That path is held to the whole-row pass's values and
gradients by tests/model/test_lm_head.py, to float32 rounding.

Re-pinned once: torch's fused AdamW (optim.make_optimizer) rounds its update differently from the
for-loop AdamW; rewards, response lengths and entropies stayed equal, loss/policy moved by at most
1.7e-6 relative, kl/value by 2.7e-5 and grad_norm by 3.4e-7 over the 3 steps. The LM head's
backward by vocabulary blocks (topk._SummarizeHidden) changed no figure.
"""

import json
import subprocess
import sys

import pytest
import torch

# Slow: `emapg train` in a child process, with a 150-step warm start (110 s measured at load 3-4).
pytestmark = pytest.mark.slow

PINNED = [
    {"step": 0, "eval/accuracy": 0.015625, "eval/anchor/accuracy": 0.015625},
    {
        "step": 1,
        "reward/mean": 0.02734375,
        "sampling/uniform_frac": 0.84375,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "train/skipped_steps": 0,
        "loss/policy": 0.0017502625094782008,
        "kl/value": 0.0,
        "clip_frac": 0.0,
        "clip_frac/first_minibatch": 0.0,
        "ppo_ratio/first_minibatch_max_dev": 1.430511474609375e-06,
        "grad_norm": 0.13068026304244995,
        "rollout_correction/weight_mean": 1.0,
        "rollout_correction/weight_max": 1.0,
        "rollout_correction/masked_frac": 0.0,
        "entropy": 1.360012394366878,
        "response_length/mean": 3.15625,
        "anchor/updates": 0,
        "lr": 8e-05,
    },
    {
        "step": 2,
        "reward/mean": 0.01953125,
        "sampling/uniform_frac": 0.84375,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "train/skipped_steps": 0,
        "loss/policy": 0.0008212586866992415,
        "kl/value": 0.00015950896079531946,
        "clip_frac": 0.0,
        "clip_frac/first_minibatch": 0.0,
        "ppo_ratio/first_minibatch_max_dev": 3.814697265625e-06,
        "grad_norm": 0.16687071323394775,
        "rollout_correction/weight_mean": 1.0,
        "rollout_correction/weight_max": 1.0,
        "rollout_correction/masked_frac": 0.0,
        "entropy": 1.3638200039924506,
        "response_length/mean": 3.36328125,
        "anchor/updates": 0,
        "lr": 0.00012,
    },
    {
        "step": 3,
        "reward/mean": 0.01171875,
        "sampling/uniform_frac": 0.90625,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "train/skipped_steps": 0,
        "loss/policy": 0.0025374587072710102,
        "kl/value": 0.001565383060982353,
        "clip_frac": 0.0,
        "clip_frac/first_minibatch": 0.0,
        "ppo_ratio/first_minibatch_max_dev": 1.1920928955078125e-06,
        "grad_norm": 0.17722636461257935,
        "rollout_correction/weight_mean": 1.0,
        "rollout_correction/weight_max": 1.0,
        "rollout_correction/masked_frac": 0.0,
        "entropy": 1.3402400404642643,
        "response_length/mean": 3.265625,
        "anchor/updates": 0,
        "lr": 0.00016,
        "eval/accuracy": 0.0,
        "eval/anchor/accuracy": 0.015625,
    },
]


# The same run on an Intel Xeon with AMX and AVX512-FP16 (Sapphire Rapids class), 2026-12-06:
# rewards equal at every step, every other figure apart from step 1 (the warm start's SFT, chaotic,
# ends in other bits). Restricting MKL and oneDNN to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2,
# MKL_CBWR=AVX2, ONEDNN_MAX_CPU_ISA=AVX2) changed none of them; the kernel that differs is not
# found yet. Each machine class is held to its own record.
PINNED_AMX = [
    {"step": 0, "eval/accuracy": 0.015625, "eval/anchor/accuracy": 0.015625},
    {
        "step": 1,
        "reward/mean": 0.02734375,
        "sampling/uniform_frac": 0.84375,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "train/skipped_steps": 0,
        "loss/policy": 0.0025838201504822336,
        "kl/value": 0.0,
        "clip_frac": 0.0,
        "clip_frac/first_minibatch": 0.0,
        "ppo_ratio/first_minibatch_max_dev": 2.0265579223632812e-06,
        "grad_norm": 0.11450782418251038,
        "rollout_correction/weight_mean": 1.0,
        "rollout_correction/weight_max": 1.0,
        "rollout_correction/masked_frac": 0.0,
        "entropy": 1.3684835863752285,
        "response_length/mean": 3.20703125,
        "anchor/updates": 0,
        "lr": 8e-05,
    },
    {
        "step": 2,
        "reward/mean": 0.01953125,
        "sampling/uniform_frac": 0.84375,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "train/skipped_steps": 0,
        "loss/policy": 0.0012376373818485434,
        "kl/value": 8.411709080116613e-05,
        "clip_frac": 0.0,
        "clip_frac/first_minibatch": 0.0,
        "ppo_ratio/first_minibatch_max_dev": 3.5762786865234375e-06,
        "grad_norm": 0.15139055252075195,
        "rollout_correction/weight_mean": 1.0,
        "rollout_correction/weight_max": 1.0,
        "rollout_correction/masked_frac": 0.0,
        "entropy": 1.353834973472141,
        "response_length/mean": 3.34765625,
        "anchor/updates": 0,
        "lr": 0.00012,
    },
    {
        "step": 3,
        "reward/mean": 0.01171875,
        "sampling/uniform_frac": 0.90625,
        "reward/errors": 0,
        "reward/timeouts": 0,
        "train/skipped_steps": 0,
        "loss/policy": 0.0033472464634821965,
        "kl/value": 0.0007458189094560387,
        "clip_frac": 0.0,
        "clip_frac/first_minibatch": 0.0,
        "ppo_ratio/first_minibatch_max_dev": 1.430511474609375e-05,
        "grad_norm": 0.1757376790046692,
        "rollout_correction/weight_mean": 1.0,
        "rollout_correction/weight_max": 1.0,
        "rollout_correction/masked_frac": 0.0,
        "entropy": 1.3424197947485208,
        "response_length/mean": 3.30078125,
        "anchor/updates": 0,
        "lr": 0.00016,
        "eval/accuracy": 0.015625,
        "eval/anchor/accuracy": 0.015625,
    },
]


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="pinning needs AVX2 (x86-64)"
)
def test_quickstart_first_steps_are_pinned(tmp_path):
    out = tmp_path / "runs"
    subprocess.run(
        [sys.executable, "-m", "emapg", "train", f"train.output_dir={out}", f"warmstart.cache_dir={tmp_path}",
         "warmstart.steps=150", "warmstart.target_accuracy=1", "train.steps=3", "train.eval_every=3",
         "train.save_every=3", "train.progress=false", "train.tensorboard=false", "task.num_eval=16",
         "algo.share_prompts=false"],
        # Time limit: the test measured 110 s at load 3-4; x6 for a loaded machine.
        check=True, capture_output=True, timeout=660,
    )  # fmt: skip
    lines = (out / "quickstart" / "metrics.jsonl").read_text().splitlines()
    got = [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]
    assert got == (PINNED_AMX if _has_amx() else PINNED)


def _has_amx() -> bool:
    """Whether this CPU has Intel AMX tiles (the machine class of PINNED_AMX)."""
    try:
        return " amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False
