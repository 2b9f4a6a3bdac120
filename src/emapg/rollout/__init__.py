"""Rollout engines: sample responses and record what the KL needs from the sampling pass."""

from emapg.rollout.base import Rollout, format_prompts

__all__ = ["Rollout", "format_prompts"]
