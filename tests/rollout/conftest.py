"""`model_dir`: the vLLM tests' tiny model (test_vllm_training.py, test_vllm_mismatch.py), built once
per test module."""

import pytest

from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.arithmetic import ArithmeticTask
from emapg.training.sft import sft


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
