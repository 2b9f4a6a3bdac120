"""Extra memory of the LoRA EMA anchor against a full copy of the model (the anchor without LoRA).

With lora.r > 0 the EMA anchor is a second adapter on the policy's own model, so it costs the
adapter's bytes: r * (in + out) numbers per adapted linear layer. This prints that figure,
measured from the adapter tensors peft builds, next to the bytes of a full copy of the
parameters, for the built-in tiny model and for a model shaped like Qwen2.5-0.5B (built on
the meta device: no memory, no download). Usage: python benchmarks/lora_anchor_memory.py [r]
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from emapg.model import lora
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.training.config import load_config


def qwen25_05b() -> torch.nn.Module:
    """Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), weights on the meta device."""
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def measure(name: str, model: torch.nn.Module, r: int) -> str:
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    peft_model = lora.wrap(model, load_config(None, [f"lora.r={r}"]).lora)
    # The anchor adapter has the policy adapter's shapes and dtype (peft keeps adapters in fp32
    # under a bf16 base); a meta-device model has no values to copy into a real anchor.
    extra = lora.adapter_bytes(peft_model, lora.POLICY)
    if next(model.parameters()).device.type != "meta":
        assert lora.AdapterAnchor(peft_model, 0.9, 10).extra_bytes() == extra
    dtype = next(iter(lora.adapter_params(peft_model, lora.POLICY).values())).dtype
    return (
        f"{name}: r={r}, anchor adapter {extra:,} bytes ({dtype}), full copy {full:,} bytes "
        f"({next(model.parameters()).dtype}): {extra / full:.2%}"
    )


def main() -> None:
    r = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    tokenizer = build_tiny_tokenizer()
    tiny = build_tiny_model(tokenizer)
    shape = f"width {tiny.config.hidden_size}, {tiny.config.num_hidden_layers} layers"
    print(measure(f"builtin:tiny ({shape})", tiny, r))
    print(measure("Qwen2.5-0.5B shape", qwen25_05b(), r))


if __name__ == "__main__":
    main()
