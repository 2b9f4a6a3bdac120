"""GGUF model paths: bad files stop with one line (exit 2) before any work; conversion is cached.

The files are written here with gguf-py's own writer: tiny, each wrong in one way."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import emapg
from emapg.errors import EmapgError
from emapg.model import gguf as gguf_models
from emapg.training.config import load_config

gguf = pytest.importorskip("gguf")


def write_gguf(path: Path, arch: str = "llama", quantization=None) -> Path:
    """A one-tensor GGUF of architecture `arch`; its tensor float32, or raw bytes of `quantization`."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    if quantization is None:
        w.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
    else:  # two rows of one block each
        block_bytes = gguf.GGML_QUANT_SIZES[quantization][1]
        w.add_tensor("token_embd.weight", np.zeros((2, block_bytes), np.uint8), raw_dtype=quantization)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def config_error(path) -> str:
    with pytest.raises(EmapgError) as e:
        load_config(None, [f"model.path={path}"])
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_readable_llama_gguf_passes_the_check(tmp_path):
    assert gguf_models.check(str(write_gguf(tmp_path / "m.gguf"))) == tmp_path / "m.gguf"


def test_a_gguf_that_is_not_a_causal_lm_is_refused(tmp_path):
    message = config_error(write_gguf(tmp_path / "enc.gguf", arch="t5encoder"))
    assert "a 't5' GGUF is not a causal language model" in message


def test_an_architecture_transformers_cannot_read_is_refused(tmp_path):
    message = config_error(write_gguf(tmp_path / "bert.gguf", arch="bert"))
    assert "transformers cannot read this GGUF" in message and "bert" in message


def test_a_quantization_gguf_py_cannot_dequantize_is_refused(tmp_path):
    message = config_error(write_gguf(tmp_path / "q.gguf", quantization=gguf.GGMLQuantizationType.Q8_K))
    assert "quantization Q8_K cannot be dequantized" in message


def test_a_truncated_gguf_is_refused(tmp_path):
    whole = write_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 64])  # the tensor's data is short
    assert "truncated or damaged" in config_error(cut)
    cut.write_bytes(whole[:20])  # inside the header
    assert "truncated or damaged" in config_error(cut)


def test_a_missing_file_and_a_missing_package_name_what_to_do(tmp_path, monkeypatch):
    assert "no such GGUF file" in config_error(tmp_path / "absent.gguf")
    monkeypatch.setitem(
        gguf_models.SHIPPED, "smollm2", gguf_models.ShippedModel("no_such_pkg", "m.gguf", "bash install.sh")
    )
    assert "the package no_such_pkg is not installed; run bash install.sh" in config_error("smollm2")


@pytest.mark.slow
def test_the_cli_says_one_line_and_exits_2_before_any_work(tmp_path):
    bad = write_gguf(tmp_path / "enc.gguf", arch="t5encoder")
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    cmd = [sys.executable, "-m", "emapg", "train", f"model.path={bad}", f"train.output_dir={tmp_path}/runs"]
    # Time limit: the test measured 12 s at load 3-4; 120 s is x10.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"emapg: error: model.path: model path '{bad}': a 't5' GGUF is not a causal language model"
    ]
    assert not (tmp_path / "runs").exists()


def test_the_cache_key_is_the_files_content(tmp_path):
    a = write_gguf(tmp_path / "a.gguf")
    b = tmp_path / "b.gguf"
    b.write_bytes(a.read_bytes())
    assert gguf_models.file_digest(a) == gguf_models.file_digest(b)
    b.write_bytes(a.read_bytes()[:-1] + b"\x01")
    assert gguf_models.file_digest(a) != gguf_models.file_digest(b)


def test_a_finished_conversion_is_reused_and_a_killed_one_is_never_taken(tmp_path, monkeypatch):
    file = write_gguf(tmp_path / "m.gguf")
    calls = []

    def convert(src, out, progress):
        calls.append(out)
        (out / "config.json").write_text("{}")
        if len(calls) == 1:
            raise KeyboardInterrupt  # killed mid-way: its folder must not count as finished

    monkeypatch.setattr(gguf_models, "_convert", convert)
    with pytest.raises(KeyboardInterrupt):
        gguf_models.converted(str(file), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # the partial folder is gone
    first = gguf_models.converted(str(file), tmp_path / "cache")
    again = gguf_models.converted(str(file), tmp_path / "cache")
    assert first == again and len(calls) == 2 and (first / "config.json").is_file()
