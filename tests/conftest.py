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


def sample(model, tokenizer, prompts, *, batch_size=256, first_row=0, chat_template=True, **params):
    """The HF engine's responses to text prompts (rows first_row, first_row + 1, ...)."""
    from emapg.rollout import SamplingParams, encode_prompts
    from emapg.rollout.hf import HFEngine

    params["stop"] = tuple(params.get("stop", ()))
    return HFEngine(model, tokenizer, batch_size=batch_size).sample(
        encode_prompts(tokenizer, prompts, chat_template),
        SamplingParams(**params),
        rows=range(first_row, first_row + len(prompts)),
    )


@pytest.fixture(autouse=True)
def _restore_task_registry():
    """Tasks a test registers are gone after it, so messages listing the registry stay exact."""
    from emapg import tasks

    saved = dict(tasks._FACTORIES)
    yield
    tasks._FACTORIES.clear()
    tasks._FACTORIES.update(saved)
