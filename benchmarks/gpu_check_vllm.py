"""GPU check of rollout.engine=vllm: log-prob agreement with the trainer, and step time vs hf.

Needs a CUDA GPU and `pip install 'emapg[vllm]'`; exits with one line (code 2) otherwise.
MODEL is a local Hugging Face model directory (e.g. a Qwen2.5-0.5B-Instruct download).

    python benchmarks/gpu_check_vllm.py MODEL [--steps 4] [key=value ...]

Prints (1) the max and mean |vLLM sampling log-prob - trainer's recomputed log-prob| over
the response tokens of one batch, the agreement of vLLM's top-k ids with the trainer's, and
(2) the mean seconds per training step with each engine and their ratio hf / vllm.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

from emapg.config import load_config, validate
from emapg.models import load_model_and_tokenizer
from emapg.rollout import format_prompts
from emapg.rollout.vllm import engine_for
from emapg.trainer import make_task, response_summary, train

PHASES = ("rollout", "scoring", "anchor", "update", "ema")


def logp_gap(cfg) -> None:
    model, tok = load_model_and_tokenizer(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    model.cuda().eval()
    examples = make_task(cfg).train_examples()[: cfg.rollout.prompts_per_step]
    prompts = [e.prompt for e in examples for _ in range(cfg.rollout.group_size)]
    prompts, special = format_prompts(tok, prompts, cfg.model.chat_template)
    k, T = cfg.kl.k, cfg.rollout.temperature
    batch = engine_for(cfg)(
        model, tok, prompts, max_new_tokens=cfg.rollout.max_new_tokens, temperature=T, topk=k,
        add_special_tokens=special,
    )  # fmt: skip
    with torch.no_grad():
        s = response_summary(model, batch, batch.responses.unsqueeze(-1), temperature=T, topk_self=k)
    mask = batch.response_mask
    gap = (s.logp()[..., 0] - batch.sampling_logp)[mask].abs()
    same = (s.topk_ids.sort(-1).values == batch.topk_ids.sort(-1).values).all(-1)[mask].float()
    print(f"log-prob gap over {int(mask.sum())} tokens: max {gap.max():.4f}, mean {gap.mean():.5f}")
    print(f"top-{k} sets identical to the trainer's on {same.mean():.1%} of tokens")
    del model
    torch.cuda.empty_cache()


def step_seconds(path: str, steps: int, overrides: list[str], engine: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            None,
            [f"model.path={path}", "model.dtype=bfloat16", *overrides, f"rollout.engine={engine}",
             f"train.output_dir={out}", f"train.steps={steps}", f"train.eval_every={steps}",
             f"train.save_every={steps}", "train.tensorboard=false", "train.progress=false"],
        )  # fmt: skip
        train(cfg)
        lines = (Path(out) / cfg.train.name / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["step"] > 1 and "time/rollout_s" in r]
    return sum(sum(r[f"time/{p}_s"] for p in PHASES) for r in records) / len(records)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    missing = (
        "no CUDA GPU is visible" if not torch.cuda.is_available()
        else "vLLM is not installed (pip install 'emapg[vllm]')" if importlib.util.find_spec("vllm") is None
        else None
    )  # fmt: skip
    if missing:
        print(f"gpu_check_vllm: {missing}; nothing checked", file=sys.stderr)
        sys.exit(2)
    cfg = load_config(
        None, [f"model.path={args.model}", "model.dtype=bfloat16", "rollout.engine=vllm", *args.overrides]
    )
    validate(cfg)
    logp_gap(cfg)
    vllm_s = step_seconds(args.model, args.steps, args.overrides, "vllm")
    hf_s = step_seconds(args.model, args.steps, args.overrides, "hf")
    print(f"seconds per step: hf {hf_s:.3f}, vllm {vllm_s:.3f}, ratio hf/vllm {hf_s / vllm_s:.2f}x")


if __name__ == "__main__":
    main()
