"""Attention as transformers' SDPA computes it, but in float32 on a CPU.

torch 2.13's CPU flash attention is slower in bfloat16 than in float32: forward and backward of
SmolLM2's attention (64 rows, 16 queries over 67 keys, 9 heads of 64) took 32 ms in bfloat16
against 11-17 ms in float32 on 2 cores with AMX (`python benchmarks/cpu_attention.py`). Under
bf16-mixed autocast would hand it bfloat16 (and bf16-true holds it); on a CPU this function widens
query, key and value to float32 and runs SDPA there, which is also the more exact of the two. On
any other device, and for float32 inputs outside autocast (an fp32 run, bit for bit), it is
transformers' own `sdpa_attention_forward`. Models emapg loads use it through transformers'
attention registry, under the name `emapg_sdpa`, wherever they would use "sdpa".
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "emapg_sdpa"


def sdpa_float32_on_cpu(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, in float32 on a CPU (see the module doc)."""
    on_cpu = query.device.type == "cpu"
    wide = all(t.dtype == torch.float32 for t in (query, key, value)) and not torch.is_autocast_enabled("cpu")
    if not on_cpu or wide:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(value.dtype), weights


AttentionInterface.register(NAME, sdpa_float32_on_cpu)
# The attention mask as "sdpa" builds it: a name transformers does not know would get another form.
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_float32_cpu_attention(model: nn.Module) -> nn.Module:
    """Point a model that attends with "sdpa" at `sdpa_float32_on_cpu`; any other choice (eager,
    flash attention) stays as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
    return model
