"""Why attention runs in float32 on a CPU (emapg/model/attention.py): torch's SDPA forward and
backward at SmolLM2's attention shape in float32 and in bfloat16, alternating in one process.

    python benchmarks/cpu_attention.py [--threads 2] [--rounds 5] [--rows 64] [--queries 16] [--keys 67]

The shape is smollm2_math's update with a group's prompt computed once: 64 rows of 16 response
queries over 67 keys (51 of prompt), 9 heads of 64 (key and value repeated from 3, as transformers
hands them to SDPA), a causal mask over the response part. Printed: the median milliseconds of a
forward and backward per dtype over `--rounds` rounds (each the mean of 10 calls after one), their
ratio round by round, and the CPU's kernel capability and bfloat16 flags.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from emapg.model.precision import native_bf16


def timed(dtype: torch.dtype, rows: int, queries: int, keys: int, calls: int = 10) -> float:
    """Milliseconds of one SDPA forward and backward in `dtype` (the mean of `calls`, after one)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(rows, 9, n, 64, generator=g).to(dtype).requires_grad_() for n in (queries, keys, keys)
    )
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)

    def once():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    once()
    start = time.perf_counter()
    for _ in range(calls):
        once()
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--keys", type=int, default=67)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU kernels {torch.backends.cpu.get_cpu_capability()}, native bfloat16 {native_bf16('cpu')}, "
          f"{args.threads} threads; SDPA forward + backward, {args.rows} x 9 heads x {args.queries} queries "
          f"over {args.keys} keys")  # fmt: skip
    got = {torch.float32: [], torch.bfloat16: []}
    for _ in range(args.rounds):  # alternating: a drift in the machine's speed hits both
        for dtype in got:
            got[dtype].append(timed(dtype, args.rows, args.queries, args.keys))
    for dtype, ms in got.items():
        print(f"{str(dtype)[6:]:<9} {statistics.median(ms):7.2f} ms (min {min(ms):.2f}, max {max(ms):.2f})")
    ratios = [b / f for f, b in zip(got[torch.float32], got[torch.bfloat16], strict=True)]
    print(
        f"bfloat16 / float32: {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
