"""The `algo` section: the choices among this package's algorithms a run makes."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import field_validator

from emapg.algo.advantages import estimator
from emapg.algo.policy_loss import AGGREGATIONS, LOSSES, RATIO_LEVELS
from emapg.algo.rollout_correction import MODES as CORRECTIONS
from emapg.settings import Float, Section, check, setting


class AlgoSettings(Section):
    """The `algo` section: advantages, the policy loss, epochs, batching, dynamic sampling and the
    off-policy corrections (docs/training.md has each method and its source)."""

    key: ClassVar[str] = "algo"
    advantage: str = setting(
        "grpo",
        "grpo (std-normalised), drgrpo (no std), batch_std, rloo (leave-one-out), reinforce_pp (REINFORCE++: "
        "batch whitening), or module:function / path/to/file.py:function (emapg/algo/advantages.py)",
    )
    loss: Literal[LOSSES] = setting(
        "ppo_clip", "ppo_clip (PPO's clipped surrogate) or cispo (clipped weight, no gradient, times log pi)"
    )
    ratio_level: Literal[RATIO_LEVELS] = setting(
        "token",
        "token: pi/pi_old per token; sequence: GSPO's length-normalised ratio of the whole response "
        "(use GSPO's clip ranges, e.g. clip_low=3e-4 clip_high=4e-4)",
    )
    clip_low: Float = setting(0.2, "ratio clip below: 1 - clip_low (1: no lower clip)", ge=0, le=1)
    clip_high: Float = setting(0.2, "ratio clip above: 1 + clip_high", ge=0)
    dual_clip: Float = setting(
        3.0, "ppo_clip with A < 0: the loss bounded by dual_clip * |A| (verl's clip_ratio_c); 0: off"
    )
    epochs: int = setting(1, "passes over each rollout batch", ge=1)
    minibatches: int = setting(1, "optimiser steps per epoch (the batch is split this many ways)", ge=1)
    micro_batch_size: int = setting(64, "sequences per forward/backward (gradient accumulation)", ge=1)
    micro_batch_tokens: int = setting(
        0,
        "pack micro-batches up to this many tokens (rows x padded length) instead; 0: by micro_batch_size",
        ge=0,
    )
    share_prompts: bool = setting(
        True,
        "compute a group's prompt once in the hf engine's prefill and in the passes over whole rows "
        "(pi_old, anchor, update), and run its responses on the cached keys and values: the same values "
        "and gradients to float rounding, less work and memory; sliding-window models, gradient "
        "checkpointing and FSDP keep whole rows",
    )
    mask_overlong: bool = setting(
        False, "leave responses cut at the length limit (no EOS or stop) out of the loss"
    )
    loss_aggregation: Literal[AGGREGATIONS] = setting(
        "token_mean", "every token weighs the same, or every sequence"
    )
    old_logp: Literal["auto", "recompute", "engine"] = setting(
        "auto",
        "pi_old of the PPO ratio and the KL's top-k set: recompute (a no-grad pass of the policy), engine "
        "(the sampling engine's); auto: engine only where it is the policy itself (hf, same dtype, top_p=1). "
        "A bfloat16 vLLM's beside a float32 policy cost SmolLM2 0.24 of accuracy gained (benchmarks/RESULTS.md)",
    )
    rollout_correction: Literal[CORRECTIONS] = setting(
        "token_tis",
        "weight or drop tokens by pi_old/mu (mu: the engine that sampled). token_tis, verl's default, "
        "never drops data and does not grow with length; seq_mask (TRL's) drops most long sequences. "
        "On SmolLM2 through a bfloat16 vLLM, token_tis and none learned the same within the seed spread",
    )
    rollout_correction_cap: Float = setting(
        2.0, "C of algo.rollout_correction: weights truncated at C, masks keep ratios in [1/C, C]", gt=1
    )
    dynamic_sampling: bool = setting(
        False,
        "DAPO: drop groups whose rewards are all equal and sample further prompts until the step has "
        "rollout.prompts_per_step groups with signal",
    )
    max_sampling_rounds: int = setting(
        10,
        "dynamic sampling: most rounds of rollout.prompts_per_step prompts a step samples; at the bound the "
        "last round's groups without signal fill the step",
        ge=1,
    )
    overlong_buffer: int = setting(
        0,
        "DAPO's overlong shaping: a linear penalty over the last this many tokens of the length limit; 0: off",
        ge=0,
    )
    overlong_penalty: Float = setting(1.0, "the overlong shaping's penalty at the length limit", ge=0)

    @field_validator("advantage")
    @classmethod
    def _estimator(cls, name: str) -> str:
        estimator(name)  # a built-in one, or the user's function by import path: loaded now
        return name

    @field_validator("dual_clip")
    @classmethod
    def _above_one(cls, c: float) -> float:
        check(c == 0 or c > 1, f"must be 0 (off) or > 1; got {c}")
        return c
