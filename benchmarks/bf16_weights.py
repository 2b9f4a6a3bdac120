"""How much of a fine-tune a bfloat16 engine sees: the float32 policy's changes to its starting
weights, and the share of them that rounding to bfloat16 (what a bf16 vLLM loads) erases.

    python benchmarks/bf16_weights.py [--config smollm2_math] [key=value ...]

The policy is the config's as training loads it (its cached warm start), the start the same
config without the warm start (`warmstart.pretrained=false`: the pretrained model as shipped).
Printed, over every float32 tensor (the tied head counted with the embedding it shares):
the share of elements the warm start changed, the share of those that are equal after both are
rounded to bfloat16 (a bf16 engine samples the start's weights there), and the median over
tensors of each tensor's median relative change, against bfloat16's relative spacing (8
significant bits: 2^-8 to 2^-7; an element moves to another bf16 value only when its change
crosses a rounding boundary). A fine-tune at a small learning rate moves weights
by less than that spacing, so a bf16 engine samples from a model between the start and the
policy: benchmarks/rollout_mismatch.py measures what that does to the engine/trainer gap.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from emapg.tasks import make_task
from emapg.training.config import load_config
from emapg.training.setup import load_policy


def weights(config: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    cfg = load_config(config, ["train.progress=false", *overrides])
    model, _, _ = load_policy(cfg, make_task(cfg.task, cfg.warmstart.cache_dir), progress=False)
    return {name: p.detach() for name, p in model.named_parameters() if p.dtype == torch.float32}


def rounding_figures(policy: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, float]:
    """The docstring's figures for `policy` against `start` (same names and shapes)."""
    total = changed = erased = 0
    relative = []
    for name, p in policy.items():
        s = start[name]
        moved = p != s
        total += p.numel()
        changed += int(moved.sum())
        erased += int((moved & (p.bfloat16() == s.bfloat16())).sum())
        if moved.any():
            relative.append(float(((p - s)[moved].abs() / s[moved].abs()).median()))
    return {
        "changed": changed / total,
        "erased": erased / max(changed, 1),
        "median_relative": statistics.median(relative) if relative else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="smollm2_math", help="a config with a warm start")
    parser.add_argument("overrides", nargs="*", help="key=value settings of both models")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(1)
    policy = weights(args.config, args.overrides)
    start = weights(args.config, [*args.overrides, "warmstart.pretrained=false"])
    f = rounding_figures(policy, start)
    print(
        f"{args.config}: the warm start changed {f['changed']:.1%} of the weights; rounded to bfloat16,"
        f" {f['erased']:.1%} of those changes vanish; median relative change {f['median_relative']:.2e}"
        f" (bfloat16's relative spacing: {2**-8:.2e} to {2**-7:.2e})"
    )


if __name__ == "__main__":
    main()
