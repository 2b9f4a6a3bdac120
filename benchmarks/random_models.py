"""Random models of a real LLM's shape for the benchmarks, and a tokenizer whose vocabulary
matches: the built-in character tokenizer padded with CJK characters, so every id decodes."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from emapg.model.models import build_tiny_tokenizer

# Qwen2.5-0.5B: 494.0M parameters with tied embeddings.
QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "vocab": 151936}


def cjk_padding(n: int) -> str:
    """n distinct characters from U+4E00 on, UTF-16 surrogates left out."""
    chars, code = [], 0x4E00
    while len(chars) < n:
        if not 0xD800 <= code <= 0xDFFF:
            chars.append(chr(code))
        code += 1
    return "".join(chars)


def padded_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """The character tokenizer grown to `vocab` entries (at least its own size)."""
    base = len(build_tiny_tokenizer())
    if vocab < base:
        raise ValueError(f"vocab {vocab}: must be at least the character tokenizer's {base}")
    return build_tiny_tokenizer(extra_chars=cjk_padding(vocab - base))


def random_qwen2(
    tokenizer, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int = 0, **_
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 (tied embeddings, float32) over `tokenizer`'s vocabulary."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()
