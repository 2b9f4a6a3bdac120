"""Rollout engines: sample responses and record what the KL needs from the sampling pass."""

from emapg.rollout.base import (
    ChatPrompt,
    Rollout,
    RolloutEngine,
    SamplingParams,
    encode_prompts,
    eos_ids,
    left_pad,
)

ENGINES = ("hf", "vllm")

__all__ = [
    "ENGINES",
    "ChatPrompt",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "encode_prompts",
    "eos_ids",
    "left_pad",
]
