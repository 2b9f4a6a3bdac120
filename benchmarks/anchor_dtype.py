"""A bfloat16 EMA anchor against a float32 one, on the trajectory of a real training run.

The paper's EMA reference lives in the inference dtype (bfloat16); a float32 policy's EMA kept in
bfloat16 rounds every update, and an update smaller than half a bfloat16 step (2^-9 relative) is
lost. This trains the quickstart (built-in tiny model, float32, its default settings) for
--steps steps, keeping the policy after every step, then replays the EMA over that trajectory
with emapg's Anchor twice, in float32 and in bfloat16, for each (eta, period). It prints, after
the last update of each:

- rel_err: |A_bf16 - A_fp32| / |A_fp32 - A_0|, the bfloat16 anchor's error as a share of how
  far the float32 EMA has moved from the start (parameter L2 norms over the whole model);
- lag: |P - A_bf16| / |P - A_fp32|, how much further behind the policy P the bfloat16 anchor is;
- kl: the exact KL(A_fp32 || A_bf16) per token (full vocabulary) on held-out problems with their
  answers, next to the floor (the float32 anchor rounded to bfloat16 once: what storing it in
  bfloat16 costs with no drift) and KL(P || A_fp32), the size of what the regulariser sees.

Usage: python benchmarks/anchor_dtype.py [--steps 100] [--out DIR] (the run is reused when DIR
holds it, trained with the same settings). The per-step relative size of the policy's updates is
printed too: drift grows as it shrinks, and real LLM runs (lr 1e-6) take far smaller steps than
the tiny model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from emapg.model.anchor import Anchor
from emapg.model.models import load_model_and_tokenizer
from emapg.tasks import make_task
from emapg.training.config import load_config
from emapg.training.loop import train
from emapg.training.setup import load_policy
from study import check_same_settings

SETTINGS = ((0.9, 1), (0.9, 10), (0.95, 10))  # (eta, period): the paper's two, and every step


def trajectory(out: Path, steps: int) -> tuple[Path, list[Path]]:
    """The quickstart's starting policy and its policy after each step (trained unless kept)."""
    overrides = [
        f"train.output_dir={out}", f"train.steps={steps}", "train.save_every=1",
        f"train.keep_checkpoints={steps}", f"train.eval_every={steps}", "train.tensorboard=false",
        "train.progress=false",
    ]  # fmt: skip
    cfg = load_config("quickstart", overrides)
    ckpts = [out / cfg.train.name / "checkpoints" / f"step_{s}" / "policy" for s in range(1, steps + 1)]
    check_same_settings(out / cfg.train.name, cfg.model_dump())  # a kept run of other --steps is not this one
    if not ckpts[-1].is_dir():
        train(cfg)
    start = load_policy(cfg, make_task(cfg.task, cfg.warmstart.cache_dir), progress=False)[2]
    return Path(start), ckpts


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


@torch.no_grad()
def per_token_kl(p: torch.nn.Module, q: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Exact KL(p || q) per token over the whole vocabulary, mean over the real positions."""
    logp = torch.log_softmax(p(input_ids=ids, attention_mask=mask).logits.double(), -1)
    logq = torch.log_softmax(q(input_ids=ids, attention_mask=mask).logits.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return float(kl[mask.bool()].mean())


def held_out(cfg, tokenizer, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [
        e.prompt + str(e.answer) for e in make_task(cfg.task, cfg.warmstart.cache_dir).eval_examples()[:n]
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (period 1: that many updates)")
    parser.add_argument("--out", type=Path, default=None, help="run directory to keep and reuse")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="anchor_dtype-"))
    start_dir, ckpts = trajectory(out, args.steps)

    start, tokenizer = load_model_and_tokenizer(str(start_dir))
    ids, mask = held_out(load_config("quickstart"), tokenizer)
    policies = [load_model_and_tokenizer(str(c))[0] for c in ckpts]
    moves = [flat(b) - flat(a) for a, b in zip([start, *policies[:-1]], policies, strict=True)]
    step_size = sum(float(m.norm()) for m in moves) / len(moves) / float(flat(start).norm())
    print(
        f"quickstart trajectory: {args.steps} steps of a float32 policy ({sum(p.numel() for p in start.parameters()):,} "
        f"parameters); mean relative step |P_t - P_t-1| / |P_0| = {step_size:.2e} (bfloat16's relative "
        f"rounding step: 2^-8 = {2**-8:.2e})"
    )
    final = policies[-1].eval()
    print(
        f"{'eta':>5} {'period':>6} {'updates':>7} {'rel_err':>9} {'lag':>7} {'kl bf16':>10} {'kl floor':>10} {'kl P||A':>10}"
    )
    for eta, period in SETTINGS:
        wide = Anchor(start, eta, period)
        low = Anchor(start, eta, period, dtype=torch.bfloat16)
        for step, policy in enumerate(policies, 1):
            wide.step(policy, step)
            low.step(policy, step)
        a0, a32, a16 = flat(start), flat(wide.model), flat(low.model)
        rel_err = float((a16 - a32).norm() / (a32 - a0).norm())
        lag = float((flat(final) - a16).norm() / (flat(final) - a32).norm())
        rounded = Anchor(wide.model, 1.0, 1, dtype=torch.bfloat16).model  # the float32 anchor, rounded once
        kl_low = per_token_kl(wide.model, low.model.float(), ids, mask)
        kl_floor = per_token_kl(wide.model, rounded.float(), ids, mask)
        kl_policy = per_token_kl(final, wide.model, ids, mask)
        print(
            f"{eta:>5} {period:>6} {wide.updates:>7} {rel_err:>9.3f} {lag:>7.2f} {kl_low:>10.2e} "
            f"{kl_floor:>10.2e} {kl_policy:>10.2e}"
        )


if __name__ == "__main__":
    main()
