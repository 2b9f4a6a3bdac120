"""The GPU check of mixed precision: bf16-mixed on CUDA as it trains, against fp32. Run through
`bash scripts/gpu-check.sh` on a machine with one CUDA GPU (it carries the wheels and the model's
shape there: no registry or hub is reachable from such a machine).

    python benchmarks/gpu_check.py --shape .gpu/smollm2-shape [--steps 4] [--seeds 0 1]

The model is SmolLM2-135M-Instruct's architecture and tokenizer (its converted folder's config and
tokenizer files, `--shape`) with random weights: the weights themselves (98 MB as a GGUF, 538 MB
as float32) are more than a call to the machine carries. A random model's next-token distribution
is near uniform (its entropy is printed), so figures that depend on the regime (the size of the
log-prob differences) are a random model's, not the trained one's. Printed, each a line:

1. the machine: GPU, torch, CUDA, whether it computes bfloat16 natively;
2. the LM head's product (`topk.head_matmul`) with bfloat16 operands on CUDA (`out_dtype`):
   its error against float64 products of the rounded operands, beside a bfloat16 matmul's;
3. bf16-mixed against fp32 on one batch per seed through the trainer's passes
   (benchmarks/precision_numerics.py): max and mean |delta log p|, the same for the top-k KL,
   beside the rounded weights' (bfloat16 rounding of the weights alone), and the cosine between
   the update's gradients;
4. `--steps` steps of smollm2_math on CUDA with the hf engine in fp32 and in bf16-mixed (each its
   own `emapg train`): seconds a step after the first (median), peak GPU memory, the loss and KL
   finite, and the step's ratio;
5. FSDP2 over NCCL on one rank (`distributed.shard_over` with bf16-mixed's MixedPrecisionPolicy):
   the loss and gradient of the fused head's summary of a batch against the unsharded model under
   autocast, the shards' and gradients' dtypes (float32), peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from emapg.model import precision

HERE = Path(__file__).resolve().parent


def machine(device: str) -> None:
    name = (
        torch.cuda.get_device_properties(0).name
        if device == "cuda"
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(f"1. machine: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, native bfloat16: "
          f"{precision.native_bf16(device)}", flush=True)  # fmt: skip


def random_model(shape: Path, out: Path) -> float:
    """SmolLM2's architecture and tokenizer from `shape`, random weights (seeded), saved to `out`;
    returns its mean next-token entropy (nats) over a few tokenized sentences."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(shape)
    tokenizer.save_pretrained(out)
    ids = tokenizer(["What is 17 + 25? Put the final answer in \\boxed{}."], return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)
    return float(-(logp.exp() * logp).sum(-1).mean())


def head(device: str) -> None:
    from emapg.algo.topk import head_matmul

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(512, 576, device=device, generator=g)
    w = torch.randn(8192, 576, device=device, generator=g) * 0.05
    want = h.bfloat16().double() @ w.bfloat16().double().T
    got = head_matmul(h, w.T, torch.bfloat16)
    scale = float(want.abs().max())
    ours = float((got.double() - want).abs().max()) / scale
    plain = float(((h.bfloat16() @ w.bfloat16().T).double() - want).abs().max()) / scale
    print(f"2. LM head, 512 x 576 x 8192 on {device}: output {got.dtype}, max error / max |logit| {ours:.1e} "
          f"(a bfloat16 matmul's rounded output: {plain:.1e})", flush=True)  # fmt: skip


def numerics(model_dir: Path, seeds: list[int], device: str) -> None:
    sys.path.insert(0, str(HERE))
    from precision_numerics import measure

    for seed in seeds:
        got = measure("smollm2_math", seed, [f"model.path={model_dir}", "warmstart.pretrained=false"], device)
        m, r = got["bf16-mixed"], got["rounded"]
        print(f"3. seed {seed}, {got['tokens']} tokens: bf16-mixed |dlogp| max {m['max_dlogp']:.2e} mean "
              f"{m['mean_dlogp']:.2e} (rounded weights {r['max_dlogp']:.2e} / {r['mean_dlogp']:.2e}); |dKL| max "
              f"{m['max_dkl']:.2e} mean {m['mean_dkl']:.2e} (rounded {r['max_dkl']:.2e} / {r['mean_dkl']:.2e}); "
              f"gradient cosine {m['cos']:.5f}", flush=True)  # fmt: skip


def steps(model_dir: Path, n: int, work: Path, device: str) -> None:
    seconds = {}
    for name in ("fp32", "bf16-mixed"):
        out = work / name
        cmd = [sys.executable, "-m", "emapg", "train", "--config", "smollm2_math", f"model.path={model_dir}",
               "warmstart.pretrained=false", f"train.device={device}", f"train.precision={name}", f"train.steps={n}",
               f"train.eval_every={n}", f"train.save_every={n}", "task.num_eval=16", "eval.samples=1",
               f"train.output_dir={out}", "train.progress=false", "train.tensorboard=false", "train.threads=0"]  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(f"4. {name}: emapg train failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        records = [
            json.loads(line) for line in (out / "smollm2_math" / "metrics.jsonl").read_text().splitlines()
        ]
        trained = [r for r in records if "time/step_s" in r]
        seconds[name] = statistics.median(r["time/step_s"] for r in trained[1:])
        finite = all(abs(r["loss/policy"]) < 1e9 and abs(r.get("kl/value", 0.0)) < 1e9 for r in trained)
        peak = max(r.get("memory/peak_gib", float("nan")) for r in trained)  # logged on a GPU only
        print(f"4. {name}: {len(trained)} steps, {seconds[name]:.2f} s a step after the first, peak GPU memory "
              f"{peak:.2f} GiB, loss and KL finite: {finite}, whole run {time.monotonic() - started:.0f} s",
              flush=True)  # fmt: skip
    if len(seconds) == 2:
        print(f"4. step fp32 / bf16-mixed: {seconds['fp32'] / seconds['bf16-mixed']:.2f}x", flush=True)


def fsdp_one_rank(model_dir: Path, device: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from emapg import distributed
    from emapg.batch import Rollout
    from emapg.model.lm_head import response_summary
    from emapg.model.models import load_model_and_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        g = torch.Generator().manual_seed(0)
        rows, prompt, response = 16, 48, 16
        plain = load_model_and_tokenizer(model_dir)[0].to(device)
        ids = torch.randint(0, plain.config.vocab_size, (rows, prompt + response), generator=g).to(device)
        batch = Rollout(
            sequences=ids, attention_mask=torch.ones_like(ids), prompt_len=prompt,
            response_mask=torch.ones(rows, response, dtype=torch.bool, device=device),
            sampling_logp=torch.zeros(rows, response, device=device),
            topk_ids=torch.zeros(rows, response, 0, dtype=torch.long, device=device),
            entropy=torch.zeros(rows, response, device=device), texts=[""] * rows,
            truncated=torch.zeros(rows, dtype=torch.bool, device=device),
        )  # fmt: skip
        tokens = ids[:, prompt:].unsqueeze(-1)

        def loss_and_grads(model):
            with precision.autocast("bf16-mixed", device):
                loss = response_summary(model, batch, tokens, temperature=1.0).logp().mean()
            loss.backward()
            grads = [distributed.full(p.grad).reshape(-1).float() for p in model.parameters()]
            return loss.item(), torch.cat(grads)

        want_loss, want_grad = loss_and_grads(plain)
        sharded = load_model_and_tokenizer(model_dir)[0].to(device)
        distributed.shard_over(sharded, init_device_mesh(device, (1,)), torch.bfloat16)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss, grad = loss_and_grads(sharded)
        dtypes = {distributed.local(p).dtype for p in sharded.parameters()} | {
            distributed.local(p.grad).dtype for p in sharded.parameters()
        }
        cos = float(torch.nn.functional.cosine_similarity(grad.double(), want_grad.double(), dim=0))
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        print(f"5. FSDP2 over {dist.get_backend().upper()}, one rank, bf16-mixed: loss {loss:.5f} against autocast's "
              f"{want_loss:.5f}, gradient cosine {cos:.5f}, shards and gradients {sorted(str(d) for d in dtypes)}, "
              f"peak GPU memory {peak:.2f} GiB", flush=True)  # fmt: skip
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", type=Path, required=True, help="SmolLM2's config and tokenizer files")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu runs the same check here (its smoke test)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    machine(args.device)
    work = Path(tempfile.mkdtemp(prefix="emapg-gpu-check-"))
    try:
        model_dir = work / "model"
        entropy = random_model(args.shape, model_dir)
        print(
            f"   model: {args.shape}'s architecture and tokenizer, random weights (mean next-token entropy {entropy:.2f} nats)"
        )
        head(args.device)
        numerics(model_dir, args.seeds, args.device)
        steps(model_dir, args.steps, work, args.device)
        fsdp_one_rank(model_dir, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
