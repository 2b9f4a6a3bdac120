"""Rollout engines: sample responses and record what the KL needs from the sampling pass.

Engines are found by `rollout.engine` in a registry whose entries carry the engine's factory
and its settings (the `rollout` section, extended by the engine's own fields):

    from emapg.rollout import register_engine
    register_engine("my_engine", lambda settings, model, tokenizer, model_dir, needs: MyEngine(...),
                    config=MySettings)
"""

from __future__ import annotations

from emapg.batch import Rollout, left_pad
from emapg.rollout import hf, vllm
from emapg.rollout.base import (
    EngineNeeds,
    RolloutEngine,
    RolloutSettings,
    SamplingParams,
    eos_ids,
    with_call_seed,
)
from emapg.settings import Registry

ENGINES = Registry("rollout.engine", RolloutSettings)


def register_engine(name: str, factory, config: type[RolloutSettings] | None = None) -> None:
    """`rollout.engine=name` builds its engine with `factory(settings, model, tokenizer, model_dir,
    needs)`, settings its `rollout` section and needs an EngineNeeds;
    `config` is its `rollout` section (a RolloutSettings subclass; default: RolloutSettings)."""
    ENGINES.register(name, factory, config)


def make_engine(
    settings: RolloutSettings, model, tokenizer, model_dir: str, needs: EngineNeeds
) -> RolloutEngine:
    """The engine `settings.engine` names, sampling from `model` (whose weights `model_dir` holds)."""
    return ENGINES[settings.engine].factory(settings, model, tokenizer, model_dir, needs)


register_engine("hf", hf.make)
register_engine("vllm", vllm.make, vllm.VllmSettings)

__all__ = [
    "ENGINES",
    "EngineNeeds",
    "Rollout",
    "RolloutEngine",
    "RolloutSettings",
    "SamplingParams",
    "eos_ids",
    "left_pad",
    "make_engine",
    "register_engine",
    "with_call_seed",
]
