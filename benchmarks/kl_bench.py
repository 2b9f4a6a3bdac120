"""Cost and statistics of emapg's token-level KL estimators.

Part 1, cost. The training path: policy hidden states [T, H] and LM head weight [V, H] ->
emapg.algo.topk.summarize_hidden gathered at the sampled token plus the top-k ids -> emapg.algo.kl.from_summary
-> backward into both. The rollout's top-k ids and the anchor's log-probs there are computed
beforehand (they are stored between passes; their size is the "stored" column). Variants: K4 and
top-k for each k through that path, exact KL through it with k = V, and the full-logits route other
frameworks take (materialise [T, V] logits, kl.token_kl, estimators "k4" and "exact"). For each:
time of forward + backward (median of repeats, after a run that measures memory and warms up) and
peak extra memory (live tensor bytes above the inputs: a dispatch mode on CPU,
torch.cuda.max_memory_allocated on CUDA), relative to K4 (time) and to exact KL (memory).

Part 2, statistics. On a fixed small distribution (float64), every estimator's bias and per-sample
standard deviation of value and gradient, exactly, by enumerating the sampled token (on-policy).

    python benchmarks/kl_bench.py            # the issue's configuration (T reduced if it does not fit)
    python benchmarks/kl_bench.py --quick    # a small configuration, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from emapg.algo import kl, topk

MB = 1e6
QWEN_VOCAB = 151936
CALIBRATION_TOKENS = (64, 128)  # memory calibration runs, with a chunk of 64 tokens
TOKEN_STEP = 256  # T is reduced in steps of this when the configuration does not fit


# --------------------------------------------------------------------------------------------
# Memory measurement
# --------------------------------------------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created under this mode and alive at the same time.

    Every op output whose storage is new (not one of the op's inputs', as views, in-place and out=
    ops give) is counted when created and uncounted when its storage is freed (weakref.finalize:
    PyTorch keeps a storage's Python object alive as long as the storage). Tensors that existed
    before the mode are not counted; allocations internal to a kernel are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage data_ptr -> nbytes
        self.current = 0
        self.peak = 0

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self.live:
                continue
            self.live[ptr] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, ptr)
        return out


def peak_extra_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Run `step` once; the peak of memory allocated during it above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveTensorBytes() as live:
        step()
    return live.peak


def seconds(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def nbytes(*tensors: Tensor) -> int:
    """Bytes of the tensors' elements (of a slice: the slice's, not its storage's)."""
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------------------------
# Part 1: cost
# --------------------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    build: Callable[[], tuple[Callable[[], None], int]]  # -> (forward + backward step, stored bytes)
    light: bool = True  # its inputs are views of the shared ones: its step can stay built


class CostBench:
    """Shared inputs for one configuration: a policy LM head, an anchor one, on-policy samples."""

    def __init__(
        self, tokens: int, vocab: int, hidden: int, ks: list[int], dtype, device, chunk: int, seed: int
    ):
        self.tokens, self.vocab, self.chunk, self.device = tokens, vocab, chunk, device
        self.ks = [k for k in ks if k < vocab]
        g = torch.Generator().manual_seed(seed)
        sampler = torch.Generator(device).manual_seed(seed)
        # Unit hidden states and a head of scale 3 / sqrt(H): logits of standard deviation 3.
        h = torch.randn(tokens, hidden, generator=g)
        w = torch.randn(vocab, hidden, generator=g) * (3.0 / hidden**0.5)
        w_ref = w + torch.randn(vocab, hidden, generator=g) * (0.5 / hidden**0.5)
        self.hidden = h.to(device, dtype).requires_grad_()
        self.weight = w.to(device, dtype).requires_grad_()
        self.ref_weight = w_ref.to(device, dtype)
        kmax = max(self.ks, default=0)
        self.token = self._per_chunk(
            self.weight, lambda x: torch.multinomial(torch.softmax(x, -1), 1, generator=sampler)
        )
        with torch.no_grad():
            # Rollout pass: the sampling (here: current) policy's top-k ids, sorted by probability.
            rollout = topk.summarize_hidden(self.hidden, self.weight, self.token, topk=kmax, chunk_size=chunk)
            self.head_ids = rollout.topk_ids
            # Anchor pass: the anchor's log-probs at the token and at the rollout's top-k ids.
            ids = torch.cat([self.token, self.head_ids], -1)
            self.ref_logp = topk.summarize_hidden(self.hidden, self.ref_weight, ids, chunk_size=chunk).logp()

    def _per_chunk(self, weight: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """fn(fp32 logits of a chunk of tokens) for each chunk, concatenated; no gradient."""
        with torch.no_grad():
            chunks = range(0, self.tokens, self.chunk)
            return torch.cat([fn((self.hidden[a : a + self.chunk] @ weight.T).float()) for a in chunks])

    def head_hit_rate(self, k: int) -> float:
        return (self.head_ids[:, :k] == self.token).any(-1).float().mean().item()

    def variants(self) -> list[Variant]:
        out = [Variant("K4", lambda: self._summary("k4", 0))]
        out += [Variant(f"top-k k={k}", lambda k=k: self._summary("topk", k)) for k in self.ks]
        out += [
            Variant("exact (top-k, k=V)", self._summary_exact, light=False),
            Variant("K4, full logits", lambda: self._full_logits("k4"), light=False),
            Variant("exact, full logits", lambda: self._full_logits("exact"), light=False),
        ]
        return out

    def _summary_step(self, estimator: str, head: Tensor, ref_logp: Tensor, ref_head: Tensor):
        def step() -> None:
            ids = torch.cat([self.token, head], -1)
            policy = topk.summarize_hidden(self.hidden, self.weight, ids, chunk_size=self.chunk)
            in_head = (head == self.token).any(-1)
            est = kl.from_summary(policy, in_head, ref_logp, ref_head, estimator=estimator)
            est.mean().backward()

        return step

    def _summary(self, estimator: str, k: int):
        head, ref_logp, ref_head = self.head_ids[:, :k], self.ref_logp[:, 0], self.ref_logp[:, 1 : k + 1]
        return self._summary_step(estimator, head, ref_logp, ref_head), nbytes(head, ref_logp, ref_head)

    def _summary_exact(self):
        # q = the whole vocabulary: every id (a free expanded view), the anchor's full log-probs stored.
        head = torch.arange(self.vocab, device=self.device).expand(self.tokens, self.vocab)
        ref_head = self._per_chunk(self.ref_weight, lambda x: torch.log_softmax(x, -1))
        ref_logp = ref_head.gather(-1, self.token).squeeze(-1)
        return self._summary_step("exact", head, ref_logp, ref_head), nbytes(ref_logp, ref_head)

    def _full_logits(self, estimator: str):
        with torch.no_grad():
            ref_logits = self.hidden @ self.ref_weight.T
        token = self.token.squeeze(-1)

        def step() -> None:
            logits = self.hidden @ self.weight.T
            kl.token_kl(logits, ref_logits, token, estimator=estimator).mean().backward()

        return step, nbytes(ref_logits)

    def input_bytes(self) -> int:
        return nbytes(self.hidden, self.weight, self.ref_weight, self.token, self.head_ids, self.ref_logp)

    def clear_grads(self) -> None:
        self.hidden.grad = self.weight.grad = None


@dataclass
class Result:
    name: str
    times: list[float]
    peak: int
    stored: int

    @property
    def time(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(slowest - fastest timed run) / median: how much to trust the time on a shared machine."""
        return (max(self.times) - min(self.times)) / self.time


def measure_memory(bench: CostBench, variant: Variant) -> tuple[Callable[[], None], Result]:
    """Build the variant and run it once, measuring its peak extra memory (and warming it up)."""
    step, stored = variant.build()
    bench.clear_grads()
    peak = peak_extra_bytes(step, bench.device)
    bench.clear_grads()
    return step, Result(variant.name, [], peak, stored)


def time_once(bench: CostBench, step: Callable[[], None], result: Result) -> None:
    result.times.append(seconds(step, bench.device))
    bench.clear_grads()


def run_variants(bench: CostBench, repeats: int, time_budget: float) -> list[Result]:
    """Per variant, one run that measures memory and warms up, then timed runs. Light variants (K4
    and top-k, the comparison that matters) are timed round-robin, `repeats` rounds in alternating
    order, so a slow spell of a shared machine, or a variant's place in the round, hits them alike. The others are timed one after the other, each
    `repeats` times or fewer (at least once) when its runs add up to `time_budget` seconds, and
    freed before the next is built."""
    results, kept = [], []
    for variant in bench.variants():
        step, result = measure_memory(bench, variant)
        results.append(result)
        if variant.light:
            kept.append((step, result))
        else:
            while len(result.times) < repeats and (not result.times or sum(result.times) < time_budget):
                time_once(bench, step, result)
            del step
            gc.collect()
        print(f"  {variant.name}: {result.peak / MB:.1f} MB extra", flush=True)
    print(
        f"  timing {', '.join(result.name for _, result in kept)}: {repeats} rounds, alternating order",
        flush=True,
    )
    for round_ in range(repeats):
        for step, result in kept if round_ % 2 == 0 else kept[::-1]:
            time_once(bench, step, result)
    return results


def fit_tokens(args, dtype, device, ks: list[int], budget: int) -> tuple[int, list[str]]:
    """The largest T <= args.tokens (a multiple of TOKEN_STEP) whose costliest variant fits `budget`.

    Each variant's total (inputs + stored + peak extra) is measured at two small T with a chunk of
    64 tokens and extrapolated linearly in T; the constant part, mostly chunk work space, is scaled
    up to the real chunk size (an overestimate for the part that is not)."""
    t1, t2 = CALIBRATION_TOKENS
    totals: dict[str, list[int]] = {}
    for t in (t1, t2):
        bench = CostBench(t, args.vocab, args.hidden, ks, dtype, device, t1, args.seed)
        for variant in bench.variants():
            step, result = measure_memory(bench, variant)
            totals.setdefault(variant.name, []).append(bench.input_bytes() + result.stored + result.peak)
            del step
        del bench
        gc.collect()
    scale = max(1.0, args.chunk_size / t1)

    def need(name: str, t: int) -> float:
        m1, m2 = totals[name]
        slope = (m2 - m1) / (t2 - t1)
        return max(0.0, m1 - slope * t1) * scale + slope * t

    tokens = args.tokens
    while tokens > TOKEN_STEP and max(need(name, tokens) for name in totals) > budget:
        tokens = (tokens - 1) // TOKEN_STEP * TOKEN_STEP
    worst = max(totals, key=lambda name: need(name, args.tokens))
    notes = [
        f"memory budget {budget / 1e9:.1f} GB ({args.mem_fraction:.0%} of available); predicted need at "
        f"T={args.tokens}: {need(worst, args.tokens) / 1e9:.1f} GB ({worst})"
    ]
    if tokens < args.tokens:
        notes.append(
            f"*** T={args.tokens} does not fit: running T={tokens} "
            f"(predicted {need(worst, tokens) / 1e9:.1f} GB for {worst}) ***"
        )
    if max(need(name, tokens) for name in totals) > budget:
        raise SystemExit(
            f"kl_bench: even T={tokens} does not fit the memory budget of {budget / 1e9:.1f} GB; "
            "lower --vocab or raise --mem-fraction"
        )
    return tokens, notes


def print_cost(results: list[Result], bench: CostBench) -> None:
    by_name = {r.name: r for r in results}
    k4 = by_name["K4"]
    exact, exact_full = by_name["exact (top-k, k=V)"], by_name["exact, full logits"]
    header = (
        f"{'variant':<22}{'time s':>9}{'x K4':>7}{'runs':>6}{'spread':>8}{'extra MB':>11}{'x exact':>9}"
        f"{'x exact-full':>13}{'over K4 MB':>12}{'stored MB':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:<22}{r.time:>9.3f}{r.time / k4.time:>7.2f}{len(r.times):>6}{r.spread:>8.0%}{r.peak / MB:>11.1f}"
            f"{r.peak / exact.peak:>9.4f}{r.peak / exact_full.peak:>13.4f}{(r.peak - k4.peak) / MB:>12.1f}"
            f"{r.stored / MB:>11.1f}"
        )
    print(
        "time: forward + backward, median of the timed runs; x K4: / K4's time; spread: (slowest -\n"
        "fastest run) / median. extra MB: peak memory allocated during forward + backward above the\n"
        "inputs (the gradients of hidden and head weight included); x exact / x exact-full: / exact KL's\n"
        "through the summary path / through full logits; over K4: extra minus K4's. stored: the rollout\n"
        "and anchor tensors this variant keeps between passes (top-k ids, anchor log-probs or full\n"
        "anchor logits), not in extra."
    )
    if 32 in bench.ks:
        r = by_name["top-k k=32"]
        t_ratio, m_ratio = r.time / k4.time, r.peak / exact.peak
        own = (r.peak - k4.peak) / exact.peak
        print(
            f"\nGoal, time:   top-k k=32 / K4 = {t_ratio:.2f}x (goal <= 1.5x): "
            f"{'met' if t_ratio <= 1.5 else 'NOT met'}\n"
            f"Goal, memory: top-k k=32 extra / exact extra = {m_ratio:.2%} (goal < 1%): "
            f"{'met' if m_ratio < 0.01 else 'NOT met'}; / exact-full extra = "
            f"{r.peak / exact_full.peak:.2%}\n"
            f"              top-k k=32's own share, (extra - K4 extra) / exact extra = {own:.3%}; the rest\n"
            f"              is K4's too: computing log pi(token) through the chunked summary costs\n"
            f"              about chunk_size x V fp32 work space ({bench.chunk} tokens here, --chunk-size)."
        )


def run_cost(args, device: torch.device) -> None:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
    if dtype is None:  # auto
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ks = sorted({args.vocab if k == "V" else int(k) for k in args.k.split(",")})
    args.chunk_size = args.chunk_size or topk.default_chunk_size(args.vocab)
    budget = int(available_bytes(device) * args.mem_fraction)
    tokens, notes = fit_tokens(args, dtype, device, ks, budget)
    print("== Part 1: cost of forward + backward, per estimator ==")
    print(
        f"T={tokens} tokens, V={args.vocab}, H={args.hidden}, policy hidden/head/logits {dtype}, "
        f"device {device}, threads {torch.get_num_threads()}, chunk {args.chunk_size} tokens, "
        f"repeats {args.repeats} (for the heavy variants: until {args.time_budget:g} s, at least 1), "
        "on-policy, reverse KL"
    )
    print(
        f"H={args.hidden} is small on purpose: the LM head matmul is the same in every variant and would\n"
        "otherwise dominate the CPU time and hide the estimators' differences (real models: H >= 1536)."
    )
    if device.type == "cpu" and dtype == torch.float32 and args.dtype == "auto":
        print(
            "fp32 on CPU: bf16 matmuls without AVX512-BF16/AMX run tens of times slower (--dtype bf16 forces)."
        )
    for note in notes:
        print(note)
    load_before = os.getloadavg()[0]
    bench = CostBench(tokens, args.vocab, args.hidden, ks, dtype, device, args.chunk_size, args.seed)
    hits = ", ".join(f"k={k}: {bench.head_hit_rate(k):.0%}" for k in bench.ks if k)
    print(f"sampled token inside the rollout's top-k: {hits}\n")
    results = run_variants(bench, args.repeats, args.time_budget)
    if device.type == "cpu":
        print(
            f"load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
    print()
    print_cost(results, bench)


# --------------------------------------------------------------------------------------------
# Part 2: bias and standard deviation, exactly
# --------------------------------------------------------------------------------------------


def exact_kl(theta: Tensor, ref: Tensor, direction: str) -> Tensor:
    logp, ref_logp = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    if direction == "reverse":
        return (logp.exp() * (logp - ref_logp)).sum()
    return (ref_logp.exp() * (ref_logp - logp)).sum()


def estimator_stats(theta: Tensor, ref: Tensor, estimator: str, direction: str, k: int, truth) -> tuple:
    """Exact (E[est], value bias, value std, gradient bias, gradient std) under p ~ pi = softmax(theta).

    Position p of a [V, V] batch holds the token p, each row its own copy of theta, so the gradient's
    row p is the per-sample gradient of the estimate when p is sampled."""
    vocab = theta.shape[0]
    logits = theta.detach().expand(vocab, vocab).clone().requires_grad_()
    est = kl.token_kl(
        logits, ref.expand(vocab, vocab), torch.arange(vocab), estimator=estimator, direction=direction, k=k
    )
    (grads,) = torch.autograd.grad(est.sum(), logits)
    est = est.detach()
    mu = torch.softmax(theta.detach(), -1)
    true_value, true_grad = truth
    mean = mu @ est
    mean_grad = mu @ grads
    value_std = (mu @ (est - mean).square()).sqrt()
    grad_std = (mu @ (grads - mean_grad).square().sum(-1)).sqrt()
    norm = true_grad.norm()
    return (
        mean.item(),
        (mean - true_value).item(),
        value_std.item(),
        ((mean_grad - true_grad).norm() / norm).item(),
        (grad_std / norm).item(),
    )


def run_stats(args) -> None:
    vocab = args.stats_vocab
    g = torch.Generator().manual_seed(args.seed)
    # A Zipf-like policy (LM-like: a few likely tokens, a long tail) and an anchor perturbed from it.
    theta = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float64))
    theta = theta + 0.3 * torch.randn(vocab, generator=g, dtype=torch.float64)
    ref = theta + 0.5 * torch.randn(vocab, generator=g, dtype=torch.float64)
    theta.requires_grad_()
    ks = sorted({vocab if k == "V" else min(int(k), vocab) for k in args.k.split(",")})
    truths = {}
    for direction in kl.DIRECTIONS:
        value = exact_kl(theta, ref, direction)
        truths[direction] = (value.detach(), torch.autograd.grad(value, theta)[0])

    pi = torch.softmax(theta.detach(), -1).sort(descending=True).values
    print(f"\n== Part 2: exact bias and standard deviation, V={vocab}, on-policy, float64 ==")
    print(
        f"policy: Zipf-like (logit = -1.1 log rank + noise), anchor: policy logits + N(0, 0.5^2); "
        f"reverse KL {truths['reverse'][0].item():.5f}, forward KL {truths['forward'][0].item():.5f}; "
        f"policy mass of its top-k: "
        + ", ".join(f"k={k}: {pi[:k].sum().item():.2f}" for k in ks if 0 < k < vocab)
    )
    rows = [(name, kl.SAMPLED_DIRECTION[name], 0) for name in kl.SAMPLED]
    for direction in kl.DIRECTIONS:
        rows.append(("exact", direction, 0))
        rows += [(name, direction, k) for name in kl.TOPK for k in ks]
    header = (
        f"{'estimator':<11}{'direction':<10}{'k':>6}{'E[value]':>12}{'value bias':>12}{'value std':>11}"
        f"{'grad bias':>11}{'grad std':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, direction, k in rows:
        mean, bias, std, g_bias, g_std = estimator_stats(theta, ref, name, direction, k, truths[direction])
        shown_k = ("V" if k == vocab else str(k)) if name in kl.TOPK else ""
        print(
            f"{name:<11}{direction:<10}{shown_k:>6}{mean:>12.6f}{bias:>12.1e}{std:>11.2e}{g_bias:>11.1e}{g_std:>10.2e}"
        )
    print(
        "direction: the KL estimated (sampled estimators: the one their value targets). value bias:\n"
        "E[est] - KL. value std: per-sample standard deviation. grad bias: |E[grad est] - grad KL| /\n"
        "|grad KL| (w.r.t. the policy logits); grad std: sqrt(trace of the per-sample gradient\n"
        "covariance) / |grad KL|. Expectations are exact sums over the sampled token. topk_paper is the\n"
        "paper's printed estimator (gradient off by grad pi(q)); topk is emapg's corrected one."
    )


# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", "-T", type=int, default=4096, help="tokens per batch (default: 4096)")
    p.add_argument(
        "--vocab", "-V", type=int, default=QWEN_VOCAB, help="vocabulary size (default: Qwen's 151936)"
    )
    p.add_argument("--hidden", "-H", type=int, default=16, help="hidden size of the LM head (default: 16)")
    p.add_argument(
        "--k",
        default="0,8,32,128,V",
        help="top-k sizes, comma-separated, V = the whole vocabulary (default: 0,8,32,128,V)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant, median taken (default: 3)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=30.0,
        help="heavy variants (exact, full logits) stop their timed runs, after at least one, once they "
        "add up to this many seconds (default: 30)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="tokens per chunk of the summaries (default: emapg.algo.topk's, 2^26 / V)",
    )
    p.add_argument(
        "--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.8,
        help="use at most this fraction of the available memory; T is reduced to fit (default: 0.8)",
    )
    p.add_argument(
        "--stats-vocab", type=int, default=1000, help="vocabulary of Part 2's distribution (default: 1000)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every random input (default: 0)")
    p.add_argument("--skip-cost", action="store_true", help="skip Part 1")
    p.add_argument("--skip-stats", action="store_true", help="skip Part 2")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small configuration that runs in seconds (T=256, V=4096, Part 2 V=100, 2 repeats)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.stats_vocab, args.repeats = 256, 4096, 100, 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    if not args.skip_cost:
        run_cost(args, device)
    if not args.skip_stats:
        run_stats(args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
