"""Helpers shared by the tests: `from helpers import ...` (pytest puts tests/, the folder of the
root conftest.py, on sys.path). Fixtures are in conftest.py; the retrievers a server's worker
process unpickles are in retriever_stubs.py, which must stay cheap to import (no torch)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import LlamaForCausalLM

import emapg
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.base import Example, Task
from emapg.tasks.math import TINY_EXTRA_CHARS, MathTask, warm_start
from emapg.tasks.math_data import load_problems
from emapg.training.config import load_config
from emapg.training.sft import sft

ROOT = Path(__file__).resolve().parents[1]  # the repository
DATA = Path(__file__).resolve().parent / "data"  # tests/data

# --- runs of the trainer on the tiny model of conftest's tiny_model_dir --------------------------
FAST = [
    "task.num_train=64",
    "task.num_eval=16",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "algo.micro_batch_size=8",
    "train.progress=false",
    "train.tensorboard=false",
]


def config(tmp_path, model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", f"train.output_dir={tmp_path}", *FAST, *extra])


# --- rollouts through the HF engine, and pi_old taken from them --------------------------------
def sample(model, tokenizer, prompts, *, batch_size=256, first_row=0, chat_template=True, **params):
    """The HF engine's responses to text prompts (rows first_row, first_row + 1, ...)."""
    from emapg.prompts import encode_prompts
    from emapg.rollout import SamplingParams
    from emapg.rollout.hf import HFEngine

    params["stop"] = tuple(params.get("stop", ()))
    return HFEngine(model, tokenizer, batch_size=batch_size).sample(
        encode_prompts(tokenizer, prompts, chat_template),
        SamplingParams(**params),
        rows=range(first_row, first_row + len(prompts)),
    )


def engine_old(batch):
    """pi_old taken from the engine that sampled `batch`, uncorrected (algo.old_logp=engine with
    algo.rollout_correction=none): what the update divides by when the engine is the policy."""
    from emapg.training.update import OldPolicy

    return OldPolicy(
        batch.sampling_logp, batch.topk_ids, torch.ones_like(batch.sampling_logp), batch.response_mask
    )


# --- multi-process runs and HTTP -----------------------------------------------------------------
# A small search run for a random tiny model: a 10-person world, 2 rounds, an 80-token context
# cap (episodes end after different numbers of turns), 2 steps of k1 at beta 1 (nothing is
# rewarded; k1's sampled gradient still gives every step a real update).
SEARCH_ARGS = ["task.name=search", "task.world_people=10", "task.num_train=16", "task.num_eval=4",
               "task.max_turns=2", "task.max_observation_tokens=20", "rollout.max_new_tokens=5",
               "task.max_context=80", "train.steps=2", "kl.beta=1.0", "kl.estimator=k1"]  # fmt: skip


# Time limit (timeout): test_distributed.py's tests measured at most 20 s at load 3-4; 300 s is over x10.
def torchrun(nproc: int, *args: str, timeout: int = 300) -> None:
    """`torchrun --nproc_per_node nproc args...` on a free local port, 1 OMP thread per process;
    fails the test with the end of stderr when it does not exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port), *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def http(url: str, body: bytes | None = None, method: str = "POST") -> tuple[int, dict, object]:
    """One request to a test server: its status, headers and JSON body, errors included."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# --- a user's task, a scripted policy and retriever, a boxed-answer model ------------------------
class EchoTask(Task):
    """A user's task: reward 1 when the response starts with the prompt's last character."""

    name = "echo"
    score_is_safe = True

    def train_examples(self):
        return [Example(f"{d}+{d}=", d) for d in "123456789"]

    def eval_examples(self):
        return [Example(f"{d}=", d) for d in "1234"]

    def score(self, response, example):
        return float(response.startswith(example.answer))

    def metrics(self, responses, examples):
        return {"echo/length": sum(map(len, responses)) / len(responses)}


class ScriptedLM(LlamaForCausalLM):
    """Emits a fixed first turn, then after any inserted information a fixed second turn, then EOS.

    Generation feeds the whole prompt once and then one token at a time, so the sequences seen
    so far are kept here and the next token is read off the script."""

    script: tuple[str, str] = ("", "")

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        tok = self.tokenizer
        self.seen = input_ids if input_ids.shape[1] > 1 else torch.cat([self.seen, input_ids], 1)
        logits = torch.full_like(out.logits[:, -1:], -30.0)
        for b, row in enumerate(self.seen.tolist()):
            text = tok.decode(row, skip_special_tokens=True).split("\n", 1)[1]  # after the prompt line
            turn, done = (
                (self.script[1], text.rpartition("</information>\n\n")[2])
                if "</information>" in text
                else (self.script[0], text)
            )
            nxt = tok.eos_token_id if len(done) >= len(turn) else tok.convert_tokens_to_ids(turn[len(done)])
            logits[b, 0, nxt] = 0.0
        out.logits = logits
        return out


class DictRetriever:
    """One fixed passage per query; records the queries it was asked."""

    def __init__(self, docs):
        self.docs, self.queries = docs, []

    def retrieve(self, queries, topk):
        self.queries += queries
        return [[self.docs[q]] for q in queries]


PROBLEMS = [
    {"problem": "What is 2 + 3 * 4?", "answer": "14"},
    {"problem": "Solve for x: 2x = 3.", "answer": "\\frac{3}{2}"},
    {"problem": "Ana has 7 pens and gets 5 more. How many pens does Ana have now?", "answer": "12"},
]


def boxed_model(path: Path, name: str, copies: int, steps: int) -> tuple[Path, Path]:
    """(model dir, data file) in `path`: a tiny model (heads 32 wide, as vLLM's CPU kernel needs)
    taught for `steps` SFT steps to answer PROBLEMS with "\\boxed{...}", and `name`.jsonl holding
    `copies` copies of PROBLEMS (the dataset `name` in eval's figures)."""
    data = path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS * copies))
    task = MathTask(load_problems(data)[: len(PROBLEMS)], [])
    tokenizer = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = build_tiny_model(tokenizer, max_position_embeddings=192, seed=0)
    sft(model, tokenizer, warm_start(task).examples, steps=steps, batch_size=3, lr=3e-3, progress=False)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path, data


# --- the paper's configs (configs/paper/) -----------------------------------------------------
def placeholders(path, tmp_path) -> list[str]:
    """Overrides that point every placeholder path at a file or directory that exists."""
    data = yaml.safe_load(path.read_text())
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (tmp_path / "data.jsonl").write_text("")
    out = [f"model.path={model}"]
    for section, values in data.items():
        for key, value in values.items():
            if isinstance(value, str) and value.startswith("/path/to/") and key != "path":
                out.append(f"{section}.{key}={tmp_path / 'data.jsonl'}")
            if isinstance(value, list) and any(str(v).startswith("/path/to/") for v in value):
                out.append(f"{section}.{key}=[{tmp_path / 'data.jsonl'}]")
    return out


# --- `emapg train` through the real vLLM engine (tests/rollout/test_vllm_*.py) ---------------------------
# (the tests import them under their old names: VLLM_TASK as TASK, vllm_train as _train, ...)


VLLM_TASK = ["task.num_train=40", "task.min_digits=1", "task.max_digits=1", "task.num_eval=5"]  # arithmetic's


VLLM_ARGS = ["eval.samples=2", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=5", "algo.micro_batch_size=8", "train.steps=3",
        "train.eval_every=3", "train.save_every=3", "train.progress=false", "train.tensorboard=false",
        "rollout.engine=vllm", "rollout.vllm_enforce_eager=true", "rollout.vllm_gpu_memory_utilization=0.15",
        "train.threads=2"]  # fmt: skip


def vllm_train(model_dir: Path, out: Path, *extra: str, task: tuple | list = tuple(VLLM_TASK)) -> list[dict]:
    """`emapg train` in a child process; its metrics without timings."""
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    cmd = [
        sys.executable,
        "-m",
        "emapg",
        "train",
        f"model.path={model_dir}",
        f"train.output_dir={out}",
        *task,
        *VLLM_ARGS,
        *extra,
    ]
    # Time limit: not measured here (no vLLM); CI's whole vLLM set runs in about 4 min: 600 s.
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=1800
    )  # ~1 min quiet in CI; past 600 s at a load of 5 beside a benchmark
    assert done.returncode == 0, done.stderr[-3000:]
    return vllm_records(out)


def vllm_records(out: Path) -> list[dict]:
    lines = (out / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]
