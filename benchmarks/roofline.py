"""How close each phase of a training step runs to this machine's limit: a roofline.

Measures the machine's peaks at the trainer's thread count (GEMM FLOP/s of torch.mm in float32
and bfloat16, the best of square sizes 1024-4096; memory bandwidth, bytes/s of y += x over
256 MiB arrays, two reads and a write), before and after the steps (the bound uses the higher),
then runs real training steps (`emapg.training.loop.training_step`, after setting
up the run as `emapg train` does, without its evaluations), each run in a process of its own
(its peak RSS is its own), and prints per phase: its seconds and share of the step, the FLOP/s it
reached and the share of its bound it reached (bound seconds / measured seconds), the bound being
the time the FLOP take at the GEMM peak of the dtype the run computes in (bfloat16's for
bf16-mixed and bf16-true), or the bytes at the bandwidth, whichever is longer. With several
`--precisions` the runs alternate (A B A B ... over `--rounds`), each precision gets its columns
(medians over its runs), and the step's ratio is printed round by round.

    python benchmarks/roofline.py [--model tiny|qwen0.5b|smollm2] [--config NAME] [--steps 4]
        [--precisions fp32 bf16-mixed] [--rounds 2] [--profile] [key=value ...]
    python benchmarks/roofline.py --model smollm2 --steps 4 --precisions fp32 bf16-mixed --rounds 3
    .venv-vllm/bin/python benchmarks/roofline.py --model qwen0.5b rollout.engine=vllm

`tiny` is the quickstart as it trains (the warm-started tiny Llama, its batch; the warm start
is cached). `qwen0.5b` is a random Qwen2 of Qwen2.5-0.5B's shape (494M parameters, vocabulary
151,936) on the quickstart's arithmetic task, 4 prompts x 4 samples of up to 32 new tokens
(random weights: every response runs to the limit). `smollm2` is the smollm2_math config as it
trains: SmolLM2-135M-Instruct from its GGUF (bash scripts/install-smollm2.sh; converted once
into a cached Hugging Face folder), warm-started as the config says (cached too), 8 prompts x 8
samples of up to 16 new tokens on 2 threads; a Llama of 30 layers, width 576, 9 heads / 3 KV
heads of 64, vocabulary 49,152 and tied embeddings (134.5M parameters, N_lin 106.2M). `--config`
names another config (default: quickstart, or smollm2_math for smollm2); key=value settings
override it. The EMA anchor is applied at every optimiser step (anchor.update_period=1) so that
its cost shows. `--profile` adds the operators that took the most time in one step
(torch.profiler). The model's shape is read from the loaded model and its config, for every
model; the first lines of the table print it.

FLOP and bytes, counted over the real tokens of the step's batch (padding is work the machine
does and the model does not need: it shows as a lower share of the bound), with N_lin the
parameters of the decoder's linear layers (embedding and LM head excluded), d_attn = heads x
head_dim, d_kv = KV heads x head_dim, H the width and V the vocabulary:

- a forward pass over a batch, F: per token 2 N_lin (its matmuls) plus 4 d_attn (i + 1) per
  layer for the token at position i of its sequence (QK^T and AV over its causal prefix), plus
  2 H V for each token whose next token is a response token (the LM head). Left out: the
  elementwise work (norms, activations, softmax, rotary embeddings) and the linear layers'
  biases, and what an attention kernel computes past the causal prefix (eager attention
  computes the whole square and masks half of it).
- rollout: F (prefill plus one token per decode step compute what one forward computes); bytes:
  every weight read once per decode step (decode steps = generate calls x the response width)
  plus, per generated token, the KV cache of its prefix (2 x layers x d_kv x context).
- pi_old pass (when recomputed), anchor pass: F each, no gradient; with algo.share_prompts (the
  default) these passes, the update's and the hf engine's prefill compute each group's prompt
  once, so their F counts a group's prompt tokens once (vLLM's rollout is counted whole).
- update: 3F per epoch (the backward is 2x the forward: gradients of activations and of
  weights; the fused LM head also recomputes its logits, 2 H V per response token, and
  train.gradient_checkpointing a whole forward, both counted as overhead); plus AdamW's step,
  memory-bound: it reads parameter, gradient and two moments and writes three, 28 bytes per
  float32 parameter.
- EMA: the anchor read and written, the policy read, once per anchor update.

Tied embeddings (SmolLM2's, Qwen2.5-0.5B's) are one matrix: its bytes count once in the weights
read, and it counts as the LM head (2 H V), never in N_lin.

The bound adds the update's optimiser bytes to its compute time (the step follows the
backward); elsewhere it is the larger of the two. Scoring (the reward) has no FLOP bound.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from emapg import distributed
from emapg.model import prompt_cache
from emapg.model.lm_head import backbone
from emapg.model.models import pin_cpu_kernels
from emapg.model.precision import PRECISIONS, compute_dtype
from emapg.rollout import Rollout
from emapg.training.config import load_config
from emapg.training.loop import training_params, training_step
from emapg.training.run import device_of
from emapg.training.setup import setup
from random_models import QWEN_05B, padded_tokenizer, random_qwen2

PHASES = ("rollout", "scoring", "old_logp", "anchor", "update", "ema")


def best_seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """The fastest of `repeats` calls, after a warm-up call (a GPU's queue drained around each)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    best = math.inf
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of torch.mm on square matrices, the best of 1024, 2048 and 4096."""
    rates = []
    for n in (1024, 2048, 4096):
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        rates.append(2 * n**3 / best_seconds(lambda a=a, b=b: torch.mm(a, b), device, repeats=3))
    return max(rates)


def bandwidth(device: torch.device) -> float:
    """Bytes/s of y += x over 256 MiB arrays: two streams read, one written in place, the access
    of AdamW's and the EMA's updates (a copy into a fresh array also reads its target first)."""
    x, y = torch.ones(64 << 20, device=device), torch.ones(64 << 20, device=device)
    return 3 * x.numel() * 4 / best_seconds(lambda: y.add_(x), device, repeats=10)


def peaks(device: torch.device) -> tuple[dict[torch.dtype, float], float]:
    """GEMM FLOP/s per dtype and memory bytes/s of `device` (the trainer's)."""
    return {dtype: gemm_peak(dtype, device) for dtype in (torch.float32, torch.bfloat16)}, bandwidth(device)


@dataclass
class Shape:
    linear: int  # N_lin: parameters of the decoder's linear layers
    layers: int
    d_attn: int
    d_kv: int
    hidden: int
    vocab: int
    tied: bool  # the LM head is the input embedding
    weight_bytes: int  # every parameter once (tied embeddings once)
    trainable: int


def shape_of(model: nn.Module) -> Shape:
    """The figures the counts need, read from the model and its config (nothing assumed of the
    architecture: head_dim where the config gives it, KV heads where it has fewer)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    params = list(model.parameters())  # a tied matrix once
    head = model.get_output_embeddings().weight
    return Shape(
        linear=sum(m.weight.numel() for m in backbone(model).modules() if isinstance(m, nn.Linear)),
        layers=c.num_hidden_layers,
        d_attn=c.num_attention_heads * head_dim,
        d_kv=(getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim,
        hidden=c.hidden_size,
        vocab=head.shape[0],
        tied=head is model.get_input_embeddings().weight,
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
    )


def forward_flops(s: Shape, batch: Rollout, share_prompts: bool = False) -> float:
    """F of the module docstring: one forward over the batch's real tokens; with `share_prompts`,
    each group's prompt tokens once (`prompt_cache.prompt_groups`), as the passes then run them."""
    n = batch.attention_mask.sum(-1).double()  # real tokens per row: prompt and response
    p = batch.attention_mask[:, : batch.prompt_len].sum(-1).double()
    groups = prompt_cache.prompt_groups(*batch.prompts) if share_prompts else None
    once = torch.ones_like(n)  # rows whose prompt is computed
    if groups is not None:
        once = torch.zeros_like(n)
        once[prompt_cache.group_starts(groups)] = 1
    tokens = (n - p) + once * p
    attention = s.layers * 2 * s.d_attn * (n * (n + 1) - p * (p + 1) + once * p * (p + 1)).sum()
    return float(2 * s.linear * tokens.sum() + attention + 2 * s.hidden * s.vocab * batch.response_mask.sum())


def rollout_bytes(s: Shape, batch: Rollout, batch_size: int, params: float, element: int) -> float:
    """What decoding must read: every weight per decode step, the KV cache of each new token's
    prefix, both in the engine's dtype (`element` bytes: a bf16-mixed hf engine decodes on
    bfloat16 copies of the weights, cast once a call)."""
    calls = math.ceil(len(batch.texts) / batch_size)
    decode_steps = calls * batch.response_mask.shape[1]
    prompt = batch.attention_mask[:, : batch.prompt_len].sum(-1, keepdim=True)
    context = (prompt + batch.response_mask.cumsum(-1)) * batch.response_mask  # prefix of each new token
    kv = 2 * s.layers * s.d_kv * element * float(context.sum())
    return decode_steps * params * element + kv


def phase_work(cfg, s: Shape, batch: Rollout, anchor_updates: int) -> dict[str, tuple[float, float]]:
    """(FLOP, bytes) each phase must do for this batch."""
    f, passes = forward_flops(s, batch), forward_flops(s, batch, cfg.algo.share_prompts)
    element, anchor_element, engine_element = (
        torch.finfo(getattr(torch, dtype)).bits // 8
        for dtype in (cfg.param_dtype, cfg.anchor_dtype, cfg.engine_dtype)
    )
    optimizer_steps = cfg.algo.epochs * cfg.algo.minibatches
    params = s.weight_bytes / element
    return {
        "rollout": (
            passes if cfg.rollout.engine == "hf" else f,
            rollout_bytes(s, batch, cfg.rollout.batch_size, params, engine_element),
        ),
        "old_logp": (passes, s.weight_bytes),
        "anchor": (passes, params * anchor_element),
        "update": (3 * passes * cfg.algo.epochs, 28 * s.trainable * optimizer_steps),
        "ema": (0.0, anchor_updates * params * (2 * anchor_element + element)),
    }


CONFIGS = {"tiny": "quickstart", "qwen0.5b": "quickstart", "smollm2": "smollm2_math"}


def build(args, out: str):
    """The run's config (`--config`, else the model's own: CONFIGS), with a random
    Qwen2.5-0.5B-shaped model for `--model qwen0.5b`."""
    overrides = [f"train.output_dir={out}", "train.progress=false", "train.tensorboard=false",
                 "anchor.update_period=1", "eval.kl=false"]  # fmt: skip
    if args.model == "qwen0.5b":
        model_dir = os.path.join(out, "model")
        tokenizer = padded_tokenizer(QWEN_05B["vocab"])
        random_qwen2(tokenizer, **QWEN_05B).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        overrides += [f"model.path={model_dir}", "rollout.prompts_per_step=4", "rollout.group_size=4",
                      "rollout.max_new_tokens=32", "algo.micro_batch_size=16"]  # fmt: skip
    return load_config(args.config or CONFIGS[args.model], overrides + args.overrides)


@dataclass
class Measured:
    """Per phase, summed over the measured steps: seconds and [FLOP, bytes] of work."""

    seconds: dict[str, float]
    work: dict[str, list[float]]
    slots: list[float]  # real tokens, token slots of the padded batches
    profiler: torch.profiler.profile | None  # the extra step's, with --profile


def measure(run, cfg, shape: Shape, steps: int, profile: bool) -> Measured:
    """Training steps 1..steps, the first a warm-up left out, and with `profile` one more under
    torch.profiler, also left out. The engine's sample calls are recorded: their batches give
    each step's token counts."""
    batches = []
    sample = run.engine.sample

    def recording(*a, **kw):
        batches.append(sample(*a, **kw))
        return batches[-1]

    run.engine.sample = recording
    params = training_params(run)
    m = Measured(defaultdict(float), defaultdict(lambda: [0.0, 0.0]), [0.0, 0.0], None)
    updates = 0  # the anchor's count, read at each step
    for step in range(1, steps + 1 + profile):
        batches.clear()
        with torch.profiler.profile() if step > steps else nullcontext() as m.profiler:
            record = training_step(run, step, params)
        done, updates = record["anchor/updates"] - updates, record["anchor/updates"]
        if step == 1 or step > steps:
            continue
        for phase in PHASES:
            m.seconds[phase] += record.get(f"time/{phase}_s", 0.0)
        batch = Rollout.cat(batches, run.tokenizer.pad_token_id) if len(batches) > 1 else batches[0]
        m.slots[0] += float(batch.attention_mask.sum())
        m.slots[1] += batch.attention_mask.numel()
        for phase, (f, b) in phase_work(cfg, shape, batch, done).items():
            m.work[phase][0] += f
            m.work[phase][1] += b
    return m


def print_peaks(device: str, threads: int, before, after) -> None:
    """The peaks measured before and after the steps: one that moved says the machine was shared."""
    for name, b, a in (
        ("GEMM float32", before[0][torch.float32], after[0][torch.float32]),
        ("GEMM bfloat16", before[0][torch.bfloat16], after[0][torch.bfloat16]),
        ("memory", before[1], after[1]),
    ):
        unit = "GB/s" if name == "memory" else "GFLOP/s"
        print(
            f"machine ({device}, {threads} CPU threads, {torch.backends.cpu.get_cpu_capability()} kernels): {name} {b / 1e9:.0f} {unit} before the steps, {a / 1e9:.0f} after"
        )


def print_header(cfg, model: str, s: dict, steps: int) -> None:
    """The run and the model's shape as the counts read it."""
    print(f"\n{cfg.train.name}, {model} model: {s['weight_bytes'] / 1e6:.0f} MB of weights ({cfg.param_dtype}), "
          f"{s['layers']} layers, width {s['hidden']}, d_attn {s['d_attn']}, d_kv {s['d_kv']}, N_lin {s['linear'] / 1e6:.2f}M, "
          f"vocabulary {s['vocab']}, {'tied' if s['tied'] else 'untied'} embeddings")  # fmt: skip
    print(f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} sequences of <= {cfg.rollout.max_new_tokens} "
          f"new tokens; engine {cfg.rollout.engine}; kl {cfg.kl.estimator}; mean of steps 2..{steps}")  # fmt: skip


def phase_rows(run: dict, compute_peak: float, bytes_per_s: float) -> dict[str, tuple]:
    """Per phase of one measured run: (seconds a step, share of the step, GFLOP/s reached, share of
    its bound reached); the bound is the time its FLOP take at `compute_peak` or its bytes at the
    bandwidth, whichever is longer (the update's add up: the optimiser follows the backward)."""
    measured = run["measured"]
    total = sum(run["seconds"].values()) / measured
    rows = {}
    for phase in PHASES:
        if run["seconds"].get(phase, 0.0) == 0.0:
            continue
        t = run["seconds"][phase] / measured
        f, b = (x / measured for x in run["work"].get(phase, (0.0, 0.0)))
        compute, memory = f / compute_peak, b / bytes_per_s
        bound = compute + memory if phase == "update" else max(compute, memory)
        rows[phase] = (t, t / total, f / t / 1e9 if f else None, bound / t if bound else None)
    rows["step"] = (total, 1.0, None, None)
    return rows


def print_table(runs: dict[str, list[dict]], peaks_: dict, bytes_per_s: float) -> None:
    """One column group per precision (medians over its runs), each bounded by the GEMM peak of
    the dtype it computes in; then the step's ratio to the first precision's, round by round."""
    names = list(runs)
    rows = {n: [phase_rows(r, peaks_[compute_dtype(n)], bytes_per_s) for r in runs[n]] for n in names}

    def med(n, phase, i):
        values = [r[phase][i] for r in rows[n] if phase in r and r[phase][i] is not None]
        return statistics.median(values) if values else None

    print(
        f"{'phase':<10}"
        + "".join(f"{n + ' s/step':>18}{'share':>7}{'GFLOP/s':>9}{'of bound':>9}" for n in names)
    )
    for phase in [*PHASES, "step"]:
        if all(med(n, phase, 0) is None for n in names):
            continue
        cells = ""
        for n in names:
            t, share, rate, bound = (med(n, phase, i) for i in range(4))
            if t is None:  # a phase this precision has not (an fp32 run's engine is pi_old)
                cells += f"{'-':>18}{'':>7}{'':>9}{'':>9}"
                continue
            cells += f"{t:>18.3f}{share:>7.1%}" + (f"{rate:>9.1f}" if rate else f"{'':>9}")
            cells += f"{bound:>9.1%}" if bound else f"{'':>9}"
        print(f"{phase:<10}{cells}")
    padding = [1 - r["slots"][0] / r["slots"][1] for n in names for r in runs[n]]
    print(
        f"padding: {statistics.median(padding):.1%} of the batch's token slots (before each micro-batch is trimmed)"
    )
    print(
        "peak RSS: "
        + ", ".join(f"{n} {max(r['peak_rss_kib'] for r in runs[n]) / 2**20:.2f} GiB" for n in names)
    )
    for n in names[1:]:
        ratios = [
            a["seconds_per_step"] / b["seconds_per_step"]
            for a, b in zip(runs[names[0]], runs[n], strict=True)
        ]
        print(f"step, {names[0]} / {n}: {statistics.median(ratios):.2f}x (rounds: "
              f"{', '.join(f'{x:.2f}x' for x in ratios)})")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="a shipped config or a YAML file (default: the model's, CONFIGS)")
    parser.add_argument(
        "--model", choices=tuple(CONFIGS), default="tiny", help="tiny: the config's own model"
    )
    parser.add_argument("--steps", type=int, default=4, help="training steps; the first is a warm-up")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        help="train.precision of each run (default: the config's)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each precision, alternating")
    parser.add_argument("--profile", action="store_true", help="then profile one more step's operators")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a run's JSON file: measure one run into it
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_intermixed_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first is a warm-up)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def child(args) -> None:
    """One run in this process (its own, for its peak RSS): set up as `emapg train` does, measure,
    write the figures to the JSON file `args.child`."""
    with tempfile.TemporaryDirectory(prefix="emapg-roofline-") as out:
        cfg = build(args, out)
        if cfg.model.path == "builtin:tiny":
            pin_cpu_kernels()  # as `emapg train` does, before any kernel runs
        torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
        device = distributed.init(device_of(cfg))
        run = setup(cfg, False, device)
        try:
            shape = shape_of(run.model)
            m = measure(run, cfg, shape, args.steps, args.profile)
        finally:
            run.close()
            distributed.close()
    measured = args.steps - 1
    Path(args.child).write_text(json.dumps({
        "seconds": m.seconds, "work": m.work, "slots": m.slots, "measured": measured,
        "seconds_per_step": sum(m.seconds.values()) / measured, "shape": asdict(shape),
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "device": str(device),
        "threads": torch.get_num_threads(),
    }))  # fmt: skip
    if args.profile:
        print(m.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="emapg-roofline-") as out:
        cfg = build(args, out)
    names = args.precisions or [cfg.train.precision]
    device = device_of(cfg)
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    before = peaks(device)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="emapg-roofline-runs-") as scratch:
        for round_ in range(args.rounds):  # A B A B ...: a drift in the machine's speed hits both
            for n in names:
                file = Path(scratch) / f"{n}-{round_}.json"
                cmd = [sys.executable, __file__, "--child", str(file), "--model", args.model, "--steps",
                       str(args.steps), *(["--config", args.config] if args.config else []),
                       *(["--profile"] if args.profile else []), *args.overrides, f"train.precision={n}"]  # fmt: skip
                subprocess.run(cmd, check=True)
                runs[n].append(json.loads(file.read_text()))
    after = peaks(device)
    first = runs[names[0]][0]
    print_peaks(first["device"], first["threads"], before, after)
    print_header(cfg, args.model, first["shape"], args.steps)
    print(f"precisions {', '.join(names)}, {args.rounds} run(s) each, alternating, each in its own process; "
          f"each bounded by the GEMM peak of the dtype it computes in")  # fmt: skip
    # The bound takes the higher of the two measurements: what the machine can do.
    best = {dtype: max(before[0][dtype], after[0][dtype]) for dtype in before[0]}
    print_table(runs, best, max(before[1], after[1]))
    print(f"load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
