"""A group's prompt computed once. GRPO samples a group of responses to one prompt, and a
group's rows lie side by side in a batch: one pass over the distinct prompts fills a KV cache,
the cache is repeated to each group's rows, and the passes over the responses run on it (the
trainer's passes over whole rows in `lm_head.response_summary`, the hf engine's generate).
With G samples per prompt the prompt's share of the work falls G-fold.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn


def prompt_groups(ids: Tensor, mask: Tensor) -> Tensor | None:
    """Sizes of the runs of consecutive rows whose prompts (left-padded `ids` and their `mask`,
    [N, P]) are equal, as a GRPO group's samples are; None when no two neighbours share one."""
    same = (ids[1:] == ids[:-1]).all(-1) & (mask[1:] == mask[:-1]).all(-1)
    if ids.shape[1] == 0 or not bool(same.any()):
        return None
    starts = torch.cat([same.new_ones(1), ~same]).nonzero().squeeze(-1)
    return torch.diff(starts, append=starts.new_tensor([len(ids)]))


def group_starts(groups: Tensor) -> Tensor:
    """The first row of each group, from `prompt_groups`' sizes."""
    return torch.cat([groups.new_zeros(1), groups.cumsum(0)[:-1]])


def cache_keyword(model: nn.Module) -> str | None:
    """The forward's name for a KV cache (transformers renamed past_key_values to cache); None
    for a forward that takes none."""
    parameters = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in parameters), None)


def empty_cache(model: nn.Module):
    """An empty KV cache of `model`'s own layer kinds that can be repeated to a group's rows, or
    None where it cannot: a forward without a cache, a layer other than full attention's (a
    sliding window keeps only its last tokens), gradient checkpointing (transformers turns the
    cache off under it) or FSDP (ranks whose batches differ in groups would run different
    passes)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if cache_keyword(model) is None or checkpointing(model) or isinstance(model, FSDPModule):
        return None
    cache = DynamicCache(config=model.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    return cache


def checkpointing(model: nn.Module) -> bool:
    """Whether gradient checkpointing is on; asked under transformers' new name where it has one
    (the old one warns on every call since 5.x)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def repeat_to_groups(cache, groups: Tensor) -> None:
    """Repeat each distinct prompt's keys and values to its group's rows, in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(groups, 0)
        layer.values = layer.values.repeat_interleave(groups, 0)
