"""Cost of batch-invariant sampling: emapg's rollout (`_RowSampler`: the CDF inverted at a hashed
per-row uniform) against HF generate's own multinomial sampling, same model, prompts, recorder.

    python benchmarks/sampling.py [--rows 256] [--tokens 8] [--repeats 5]

Prints the median seconds per rollout of each and their ratio, for the quickstart's tiny model
(57-token vocabulary) and the same model with a 32k vocabulary (where a float64 softmax and
cumulative sum per row and step weigh most against a cheap forward).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams
from emapg.rollout.hf import HFEngine, _SamplingRecorder


def hf_multinomial(model, tokenizer, prompts, tokens):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=tokens,
        do_sample=True,
        temperature=1.0,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generate(**enc, generation_config=config, logits_processor=[_SamplingRecorder(1.0, 0)])


def median_seconds(fns, repeats):
    """Median seconds of each function, called in turn `repeats` times (a shared machine's load
    then weighs on both alike); the first round is a warm-up."""
    times = [[] for _ in fns]
    for _ in range(repeats + 1):
        for fn, own in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            own.append(time.perf_counter() - t)
    return [statistics.median(own[1:]) for own in times]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = build_tiny_tokenizer()
    tiny = build_tiny_model(tokenizer).eval()
    wide = LlamaForCausalLM(LlamaConfig(**{**tiny.config.to_dict(), "vocab_size": 32000})).eval()
    prompts = [f"{i % 97}+{i % 13}=" for i in range(args.rows)]
    prompt_ids, params = encode_prompts(tokenizer, prompts), SamplingParams(max_new_tokens=args.tokens)
    print(
        f"{args.rows} rows x {args.tokens} new tokens, median of {args.repeats} alternating rounds, 2 threads"
    )
    print("vocab   emapg (per-row)   HF multinomial   ratio")
    for model in (tiny, wide):
        ours, theirs = median_seconds(
            [
                lambda m=model: HFEngine(m, tokenizer).sample(prompt_ids, params),
                lambda m=model: hf_multinomial(m, tokenizer, prompts, args.tokens),
            ],
            args.repeats,
        )
        print(f"{model.config.vocab_size:>5}   {ours:>13.3f} s   {theirs:>12.3f} s   {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
