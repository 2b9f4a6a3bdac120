"""Shared fixtures: a tiny random model saved to disk, so trainer tests skip the warm start."""

import pytest
import torch

from emapg.models import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)
