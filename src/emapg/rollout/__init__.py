"""Rollout engines: sample responses and record what the KL needs from the sampling pass."""

from emapg.rollout.base import Rollout, RolloutEngine, SamplingParams, encode_prompts

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "encode_prompts"]
