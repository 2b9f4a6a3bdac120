"""The rollout engine interface: what an engine is given, what it returns, and prompt helpers.

An engine samples responses to token-id prompts and records, per response token, what the
trainer's KL needs from the sampling pass (the sampled token's log-prob and the top-k ids of
the sampling distribution). The trainer builds one engine per run and owns it:

    engine.sync_weights(model, version)   # before sampling: the engine follows the policy
    rollout = engine.sample(prompt_ids, SamplingParams(...), rows=...)
    engine.sleep()                        # while the trainer needs the memory
    engine.close()                        # at the end of the run

`rollout/hf.py` (transformers generate) and `rollout/vllm.py` (colocated vLLM) implement it;
`rollout/multiturn.py` drives any engine through multi-turn episodes with an environment.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import StringConstraints, model_validator
from torch import nn

from emapg.batch import Rollout
from emapg.settings import Float, Section, check, setting

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RolloutSettings(Section):
    """The `rollout` section: the batch each step samples and how. Its engine's own settings
    (`rollout.engine=vllm`: rollout.vllm.VllmSettings) extend it."""

    key: ClassVar[str] = "rollout"
    prompts_per_step: int = setting(32, "prompts per rollout batch", ge=1)
    group_size: int = setting(8, "samples per prompt (GRPO group)", ge=1)
    max_new_tokens: int = setting(
        8, "response length limit in tokens; multi-turn episodes (search): per model turn", ge=1
    )
    temperature: Float = setting(
        1.0, "sampling temperature; the policy is softmax(logits / temperature)", gt=0
    )
    top_p: Float = setting(
        1.0,
        "nucleus sampling; < 1 samples from a truncated policy, corrected by algo.rollout_correction",
        gt=0,
        le=1,
    )
    stop: list[Annotated[str, StringConstraints(min_length=1)]] = setting(
        [], "stop strings that end a response (besides EOS)"
    )
    batch_size: int = setting(256, "sequences per generate call (training and evaluation)", ge=1)
    engine: str = setting("hf", "a registered engine: hf (transformers generate) or vllm (docs/vllm.md)")
    mode: Literal["sync", "async"] = setting(
        "sync",
        "sync: the trainer samples each batch itself; async: rollout worker processes sample the next "
        "batches while the trainer updates (docs/training.md, 'Async rollouts')",
    )
    max_staleness: int = setting(
        1,
        "async: policy versions a batch may lag the weights it trains (0: drawn with those weights; "
        "1: one step off)",
        ge=0,
    )
    workers: int = setting(1, "async: rollout worker processes the trainer starts on this host", ge=0)
    remote_workers: int = setting(
        0, "async: workers started elsewhere with `emapg rollout-worker --address HOST:PORT --rank N`", ge=0
    )
    worker_threads: int = setting(0, "async: torch threads in each local worker (0: torch's default)", ge=0)
    address: str = setting(
        "127.0.0.1:0",
        "async: host:port where workers meet the trainer (port 0: a free one; remote workers need a "
        "fixed port and an address they can reach)",
        pattern=r"^[^:\s]+:\d{1,5}$",
    )
    worker_timeout_s: Float = setting(
        600.0, "async: seconds to wait for workers to start, and for any one message from them", gt=0
    )

    @model_validator(mode="after")
    def _async_rules(self) -> RolloutSettings:
        check(
            self.mode == "sync" or self.workers + self.remote_workers > 0,
            "rollout.mode=async needs rollout.workers or rollout.remote_workers > 0",
        )
        check(
            not self.remote_workers or not self.address.endswith(":0"),
            f"rollout.remote_workers={self.remote_workers} need a fixed port in rollout.address "
            f"(got {self.address!r}): they cannot learn a port chosen at random",
        )
        return self


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response per prompt."""

    max_new_tokens: int  # response length limit in tokens
    temperature: float = 1.0  # the sampling policy is softmax(logits / temperature)
    top_p: float = 1.0  # nucleus sampling; the recorded log-probs are of the truncated distribution
    greedy: bool = False  # argmax decoding; temperature then only shapes the recorded log-probs
    topk: int = 0  # top-k ids of the sampling distribution to record per token (0: none)
    stop: tuple[str, ...] = ()  # strings that end a response besides EOS (kept in the response)
    seed: int | None = None  # call seed of the row noise; None: drawn from torch's global generator


def with_call_seed(params: SamplingParams) -> SamplingParams:
    """`params` with its call seed: its own, or (sampling without one) a draw from torch's global
    generator, so that `torch.manual_seed` governs the stream. Every engine draws it so, and an
    async run draws it in the trainer, so that its worker samples what the trainer would."""
    if params.seed is not None or params.greedy:
        return params
    return replace(params, seed=int(torch.randint(0, 1 << 62, ())))


@dataclass(frozen=True)
class EngineNeeds:
    """What a run asks of its engine beyond the `rollout` section."""

    dtype: str  # what the engine computes in: the policy's compute dtype, or the engine's own rollout.dtype
    seed: int  # the run's seed (an engine with a generator of its own seeds it so)
    max_logprobs: int  # the most top-k ids recorded per token (the KL's k)
    share_prompts: bool  # prefill a group's prompt once (algo.share_prompts; the hf engine)


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses with the current policy; see the module doc for the call order."""

    def sample(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        rows: Sequence[int] | None = None,
    ) -> Rollout:
        """One response per prompt (repeat a prompt for a group). `rows[i]` is prompt i's global
        row index (default 0..N-1): a row's samples depend on (seed, row, step) only, so a rank
        that samples its slice of a batch draws what one process would draw for those rows."""
        ...

    def sync_weights(self, model: nn.Module, version: Hashable) -> None:
        """Make the engine sample from `model`'s current weights; `version` names them (the
        policy's optimiser-step count, or ("anchor", step) for the anchor's), so an engine that
        copies weights skips the copy when they are the ones it holds."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds on the device until its next `sample` or `sync_weights`
        (a colocated engine sleeps through the anchor pass and the update)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (memory, processes)."""
        ...


def eos_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a response: the generation config's EOS ids and the tokenizer's."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
