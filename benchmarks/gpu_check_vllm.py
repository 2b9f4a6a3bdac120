"""GPU check of the vLLM engine (rollout/vllm.py): log-prob agreement with the HF policy before
and after a weight sync, sleep/wake, sampling speed, and training step time vs hf.

Needs a CUDA GPU and `pip install 'emapg[vllm]'`; exits with one line (code 2) otherwise.
MODEL is a local Hugging Face model directory (e.g. a Qwen2.5-0.5B-Instruct download).

    python benchmarks/gpu_check_vllm.py MODEL [--prompts 16] [--group 4] [--steps 4] [key=value ...]

Prints (1) for one batch, the max and mean |vLLM sampling log-prob - the HF model's
log softmax(logits / T)| over the response tokens and how often vLLM's top-k set equals the HF
one, first with the checkpoint's weights (then the bfloat16 engine against a float32 trainer:
benchmarks/rollout_mismatch.py's figures), then after one AdamW step on the HF model and a
`sync_weights` (the engine follows the policy; tied embeddings included); (2) whether a
sleep/wake cycle keeps the samples (with --sleep); (3) vLLM's sampling throughput; (4) with
--steps N > 0, the mean seconds per training step with each engine (key=value overrides go to
the training config) and their ratio hf / vllm.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "What is 17 * 23? Answer with a number.",
    "Solve for x: 3x + 7 = 22.",
    "A train travels 120 km in 1.5 hours. What is its average speed in km/h?",
    "What is the sum of the first 20 positive integers?",
    "If a rectangle has area 48 and width 6, what is its perimeter?",
    "What is 2 to the power of 10?",
    "How many prime numbers are there below 30?",
    "What is 15% of 240?",
]
PHASES = ("rollout", "scoring", "anchor", "update", "ema")


def hf_logp(model, out, temperature: float) -> torch.Tensor:
    """The HF model's log softmax(logits / T) at every response position, [N, L, V] (float32)."""
    parts = []
    with torch.no_grad():
        for a in range(0, out.sequences.shape[0], 8):
            seq = out.sequences[a : a + 8].cuda()
            mask = out.attention_mask[a : a + 8].cuda()
            logits = model(input_ids=seq, attention_mask=mask).logits[:, out.prompt_len - 1 : -1]
            parts.append(torch.log_softmax(logits.float() / temperature, -1).cpu())
    return torch.cat(parts)


def report_gap(label: str, model, out, temperature: float, k: int) -> None:
    logp = hf_logp(model, out, temperature)
    mask = out.response_mask
    token = logp.gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
    gap = (token - out.sampling_logp)[mask].abs()
    same = (logp.topk(k, -1).indices.sort(-1).values == out.topk_ids.sort(-1).values).all(-1)[mask]
    print(
        f"{label}: log-prob gap over {int(mask.sum())} tokens: max {gap.max():.4f}, mean {gap.mean():.5f}; "
        f"top-{k} sets identical on {same.float().mean():.1%} of tokens"
    )


def mismatch_against_float32(args, out) -> None:
    """The bfloat16 engine's samples against a float32 trainer's recomputed pi_old, the common GPU
    set-up: the figures benchmarks/rollout_mismatch.py prints on CPU."""
    from emapg.model.models import load_model_and_tokenizer
    from emapg.training.config import load_config
    from rollout_mismatch import header, mismatch_figures, row

    policy = load_model_and_tokenizer(args.model, dtype=torch.float32)[0].cuda().eval()
    cfg = load_config(
        None, [f"model.path={args.model}", f"rollout.temperature={args.temperature}", f"kl.k={args.k}"]
    )
    print(header())
    print(row("model", "bfloat16", mismatch_figures(cfg, policy, out.to("cuda"), args.k)))
    del policy
    torch.cuda.empty_cache()


def engine_checks(args) -> None:
    from emapg.model.models import load_model_and_tokenizer
    from emapg.prompts import encode_prompts
    from emapg.rollout.base import SamplingParams, eos_ids
    from emapg.rollout.vllm import VllmEngine

    model, tok = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    model.cuda().eval()
    engine = VllmEngine(
        args.model, tok, dtype="bfloat16", seed=0, max_logprobs=args.k,
        gpu_memory_utilization=args.gpu_memory_utilization, sleep=args.sleep, eos_ids=eos_ids(model, tok),
    )  # fmt: skip
    prompts = [p for p in (PROMPTS * args.prompts)[: args.prompts] for _ in range(args.group)]
    ids = encode_prompts(tok, prompts)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, topk=args.k, seed=1
    )
    engine.sync_weights(model, 0)
    out = engine.sample(ids, params)
    report_gap("checkpoint", model, out, args.temperature, args.k)
    mismatch_against_float32(args, out)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # one step: the policy moves
    model.train()
    batch = out.sequences[:4].cuda()
    model(input_ids=batch, attention_mask=out.attention_mask[:4].cuda(), labels=batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    del opt
    engine.sync_weights(model, 1)
    after = engine.sample(ids, params)
    report_gap("after 1 AdamW step + sync", model, after, args.temperature, args.k)
    print(f"samples changed by the sync: {not torch.equal(after.sequences, out.sequences)}")

    if args.sleep:
        engine.sleep()
        free = torch.cuda.mem_get_info()[0] / 2**30
        again = engine.sample(ids, params)  # wakes the engine
        print(f"sleep: {free:.1f} GiB free while asleep; samples kept after wake: "
              f"{torch.equal(again.sequences, after.sequences)}")  # fmt: skip

    torch.cuda.synchronize()
    start = time.perf_counter()
    timed = engine.sample(ids, params)
    seconds = time.perf_counter() - start
    tokens = int(timed.response_mask.sum())
    print(
        f"vLLM sampled {tokens} tokens for {len(ids)} rows in {seconds:.2f} s ({tokens / seconds:.0f} tokens/s)"
    )
    engine.close()
    del model
    torch.cuda.empty_cache()


def step_seconds(path: str, steps: int, overrides: list[str], engine: str) -> float:
    from emapg.training.config import load_config
    from emapg.training.loop import train

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            None,
            [f"model.path={path}", "train.precision=bf16-mixed", *overrides, f"rollout.engine={engine}",
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
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts in the batch")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--k", type=int, default=8, help="top-k ids recorded per token")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--sleep", action="store_true", help="build the engine with sleep mode and check it")
    parser.add_argument("--steps", type=int, default=4, help="training steps per engine (0: skip)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    missing = (
        "no CUDA GPU is visible" if not torch.cuda.is_available()
        else "vLLM is not installed (pip install 'emapg[vllm]')" if importlib.util.find_spec("vllm") is None
        else None
    )  # fmt: skip
    if missing:
        print(f"gpu_check_vllm: {missing}; nothing checked", file=sys.stderr)
        sys.exit(2)
    engine_checks(args)
    if args.steps > 0:
        vllm_s = step_seconds(args.model, args.steps, args.overrides, "vllm")
        hf_s = step_seconds(args.model, args.steps, args.overrides, "hf")
        print(f"seconds per step: hf {hf_s:.3f}, vllm {vllm_s:.3f}, ratio hf/vllm {hf_s / vllm_s:.2f}x")


if __name__ == "__main__":
    main()
