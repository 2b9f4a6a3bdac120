"""The built-in tiny tokenizer and model, and loading models from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from emapg.model.models import ALPHABET, build_tiny_model, build_tiny_tokenizer, load_model_and_tokenizer

SAMPLES = [
    "347+85=432",
    "(12*3)-4=32",
    " leading and trailing ",
    "hello, world!\nnext: 'x'/\"y\"?;",
    ALPHABET,
]


def test_tokenizer_is_character_level_and_round_trips() -> None:
    tok = build_tiny_tokenizer()
    for s in SAMPLES:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(s)  # one token per character, spaces included
        assert tok.decode(ids) == s
        assert tok.decode(tok(s)["input_ids"], skip_special_tokens=True) == s
    assert tok.unk_token_id not in tok(ALPHABET)["input_ids"]
    # BOS is prepended (prompts for generation), EOS is never appended (the model must emit it).
    ids = tok("1+1=")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert not tok.chat_template
    assert tok("€", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_tokenizer_save_load_gives_identical_ids(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == len(tok)
    for s in SAMPLES:
        assert loaded(s)["input_ids"] == tok(s)["input_ids"]
        assert loaded.decode(tok(s)["input_ids"], skip_special_tokens=True) == s
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tok, name)


def test_tiny_model_save_load_gives_identical_logits(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=3)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded, loaded_tok = load_model_and_tokenizer(tmp_path)
    ids = torch.tensor([tok("12+34=46")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.config.eos_token_id == tok.eos_token_id
    assert loaded.generation_config.pad_token_id == tok.pad_token_id
    assert loaded_tok("9-9=0")["input_ids"] == tok("9-9=0")["input_ids"]


def test_tiny_model_init_depends_on_seed_only() -> None:
    tok = build_tiny_tokenizer()
    torch.manual_seed(123)
    a = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=0)
    b = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=0)
    c = build_tiny_model(tok, hidden_size=32, num_layers=1, seed=1)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied


def test_default_tiny_model_is_laptop_sized() -> None:
    model = build_tiny_model(build_tiny_tokenizer())
    assert 100_000 < model.num_parameters() < 3_000_000


def test_load_rejects_missing_paths_with_one_line(tmp_path: Path) -> None:
    for path in (tmp_path / "nope", "no-such-org/no-such-model"):
        with pytest.raises(ValueError, match="model path") as err:
            load_model_and_tokenizer(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(ValueError, match="config.json"):
        load_model_and_tokenizer(tmp_path)  # a directory, but not a model


def test_load_sets_pad_to_eos_when_missing(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(tmp_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    _, loaded = load_model_and_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id


def test_load_rejects_tokenizer_without_eos(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(tmp_path)
    tok.eos_token = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="eos_token"):
        load_model_and_tokenizer(tmp_path)
