"""bf16-mixed against fp32 on the same batch and the same weights: the per-token log-probs, the
top-k KL and the update's gradient, with bfloat16's own rounding of the weights as the yardstick.

    python benchmarks/precision_numerics.py [--model smollm2|tiny] [--seeds 0 1 2 3 4]

For each seed, a batch of responses is sampled from the config's policy as training loads it
(smollm2_math's warm-started SmolLM2-135M-Instruct, or the quickstart's warm-started tiny model;
hf engine, float32, the config's batch and length), and the trainer's own passes run on it
(`update.response_logp` for pi_old, `update.anchor_pass`, `update.token_losses`, then the
backward) in three numerics:

- fp32: float32 weights and compute (the reference);
- bf16-mixed: float32 weights under bfloat16 autocast, as `train.precision=bf16-mixed` trains;
- rounded: float32 compute on the weights rounded to bfloat16: the error of bfloat16's rounding
  of the weights alone, measured on this batch (the yardstick: bf16-mixed also rounds
  activations, so it should be a small multiple of it).

The anchor is the policy with every weight perturbed by 5% of its tensor's standard deviation
(seeded), so that the KL is far from zero, as an EMA anchor's is after some steps. The top-k set
is fp32's pi_old's in all three, so the KLs are of the same tokens. The loss is the config's
per-token loss (policy term with seeded advantages, +-1 within each group, plus kl.beta times the
top-k KL), averaged over tokens.

Printed per seed and numerics: max and mean |delta log p| against fp32 over the response tokens,
the same for the per-token top-k KL, and the cosine and relative norm difference between the
update's gradient and fp32's. tests/training/test_update.py and tests/model/test_real_model.py hold
their bounds against these figures (benchmarks/RESULTS.md, "Mixed precision").
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

from emapg.algo.policy_loss import aggregate
from emapg.model.anchor import Anchor
from emapg.model.precision import autocast
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams, make_engine
from emapg.tasks import make_task
from emapg.training import update
from emapg.training.config import load_config
from emapg.training.setup import load_policy
from rollout_engines import load_average

CONFIGS = {"smollm2": "smollm2_math", "tiny": "quickstart"}
NUMERICS = ("fp32", "bf16-mixed", "rounded")


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with each weight moved by `scale` of its tensor's standard deviation."""
    anchor = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in anchor.parameters():
            std = float(p.float().std()) if p.numel() > 1 else 0.0
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale * std)
    return anchor


def rounded(model):
    """A float32 copy of `model` whose weights are its weights rounded to bfloat16."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.bfloat16().float())
    return out


def passes(cfg, model, anchor_model, batch, old, advantages, vocab: int) -> dict:
    """pi_old's log-probs, the per-token top-k KL and the flat gradient of the update's loss."""
    logp, _ = update.response_logp(cfg, model, batch, cfg.rollout.temperature, cfg.kl.k)
    ref = update.anchor_pass(cfg, Anchor(anchor_model, 1.0, 1, model=anchor_model), batch, old, vocab)
    model.zero_grad(set_to_none=True)
    part, rows = batch.trimmed(), torch.arange(len(batch.texts))
    width, mask = part.response_mask.shape[1], part.response_mask
    with autocast(cfg.train.precision, batch.sequences.device):
        pg, kl_tok, _, _ = update.token_losses(
            cfg, model, part, advantages, old.select(rows, width), ref.select(rows, width)
        )
        loss = aggregate(pg + cfg.kl.beta * kl_tok, mask, "token_mean", float(mask.sum()))
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return {"logp": logp[:, :width], "kl": kl_tok.detach(), "grad": grad, "mask": mask}


def figures(got: dict, want: dict) -> dict:
    mask = want["mask"]
    dlogp = (got["logp"] - want["logp"]).abs()[mask]
    dkl = (got["kl"] - want["kl"]).abs()[mask]
    cos = torch.nn.functional.cosine_similarity(got["grad"].double(), want["grad"].double(), dim=0)
    return {
        "max_dlogp": float(dlogp.max()),
        "mean_dlogp": float(dlogp.mean()),
        "max_dkl": float(dkl.max()),
        "mean_dkl": float(dkl.mean()),
        "cos": float(cos),
        "dnorm": float((got["grad"] - want["grad"]).norm() / want["grad"].norm()),
    }


def measure(config: str, seed: int, overrides: list[str], device: str = "cpu") -> dict[str, dict]:
    """`figures` of bf16-mixed and of the rounded weights against fp32, on one seed's batch."""
    base = ["train.progress=false", "algo.micro_batch_size=4096", f"train.seed={seed}", *overrides]
    cfgs = {name: load_config(config, [*base, f"train.precision={'fp32' if name != 'bf16-mixed' else name}"])
            for name in NUMERICS}  # fmt: skip
    cfg = cfgs["fp32"]
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    model, tokenizer, model_dir = load_policy(cfg, task, progress=False)
    model.to(device)
    vocab = model.get_output_embeddings().weight.shape[0]
    anchor = perturbed(model, seed)
    r = cfg.rollout
    examples = task.train_examples()[seed * r.prompts_per_step : (seed + 1) * r.prompts_per_step]
    prompts = encode_prompts(tokenizer, [e.prompt for e in examples for _ in range(r.group_size)], True)
    engine = make_engine(r, model, tokenizer, model_dir, cfg.engine_needs)
    torch.manual_seed(seed)
    batch = engine.sample(prompts, SamplingParams(r.max_new_tokens, r.temperature, topk=cfg.kl.k))
    logp, topk_ids = update.response_logp(cfg, model, batch, r.temperature, cfg.kl.k)
    mask = batch.response_mask
    old = update.OldPolicy(logp, topk_ids, torch.ones_like(logp), mask.clone())
    g = torch.Generator().manual_seed(seed)
    advantages = torch.where(torch.rand(len(batch.texts), generator=g) < 0.5, -1.0, 1.0).to(device)
    got = {}
    for name in NUMERICS:
        policy, ref = (rounded(model), rounded(anchor)) if name == "rounded" else (model, anchor)
        got[name] = passes(cfgs[name], policy, ref, batch, old, advantages, vocab)
    return {name: figures(got[name], got["fp32"]) for name in ("bf16-mixed", "rounded")} | {
        "tokens": int(mask.sum())
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=tuple(CONFIGS), default="smollm2")
    parser.add_argument("--config", help="another config (its model: model.path=...)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (scripts/gpu-check.sh)")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_intermixed_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {load_average()}")
    print(f"{'model':<8}{'seed':>5}{'tokens':>7} {'numerics':<11}{'max|dlogp|':>11}{'mean|dlogp|':>12}"
          f"{'max|dKL|':>10}{'mean|dKL|':>11}{'grad cos':>10}{'|dgrad|/|g|':>12}")  # fmt: skip
    worst = {"bf16-mixed": {}, "rounded": {}}
    for seed in args.seeds:
        got = measure(args.config or CONFIGS[args.model], seed, args.overrides, args.device)
        for name in ("bf16-mixed", "rounded"):
            f = got[name]
            print(f"{args.model:<8}{seed:>5}{got['tokens']:>7} {name:<11}{f['max_dlogp']:>11.2e}{f['mean_dlogp']:>12.2e}"
                  f"{f['max_dkl']:>10.2e}{f['mean_dkl']:>11.2e}{f['cos']:>10.5f}{f['dnorm']:>12.3f}", flush=True)  # fmt: skip
            for key, value in f.items():
                pick = min if key == "cos" else max
                worst[name][key] = pick(worst[name].get(key, value), value)
    for key in ("max_dlogp", "mean_dlogp", "max_dkl", "mean_dkl"):
        ratio = worst["bf16-mixed"][key] / worst["rounded"][key] if worst["rounded"][key] else math.inf
        print(f"worst over seeds, {key}: bf16-mixed {worst['bf16-mixed'][key]:.2e}, rounded weights "
              f"{worst['rounded'][key]:.2e} (ratio {ratio:.2f})")  # fmt: skip
    print(f"worst over seeds, gradient cosine: bf16-mixed {worst['bf16-mixed']['cos']:.5f}, rounded "
          f"{worst['rounded']['cos']:.5f}")  # fmt: skip
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
