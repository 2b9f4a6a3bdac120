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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from pydantic import StringConstraints, model_validator
from torch import Tensor, nn

from emapg.settings import Float, Section, check, setting

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Rollout:
    """A batch of sampled responses, laid out [left-padded prompt | response].

    Positions past a response's end hold padding and have response_mask False; every
    per-token tensor is [N, L] over the response columns.
    """

    sequences: Tensor  # [N, P + L] token ids
    attention_mask: Tensor  # [N, P + L] 1 on real prompt tokens and on response tokens
    prompt_len: int  # P
    response_mask: Tensor  # [N, L] bool: sampled tokens, up to and including EOS / stop
    sampling_logp: Tensor  # [N, L] log pi_sampling(token), the tempered policy at sampling time
    topk_ids: Tensor  # [N, L, k] top-k ids of the sampling distribution (k = 0: none)
    entropy: Tensor  # [N, L] entropy of the sampling distribution
    texts: list[str]  # decoded responses, special tokens removed
    truncated: Tensor  # [N] bool: cut at the length limit, without EOS or a stop string

    @property
    def responses(self) -> Tensor:
        return self.sequences[:, self.prompt_len :]

    def to(self, device: torch.device | str) -> Rollout:
        """This batch with every tensor on `device`."""
        return Rollout(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()})

    def select(self, rows: Tensor) -> Rollout:
        """The rows `rows` (a 1-D index tensor) of this batch."""
        return Rollout(
            sequences=self.sequences[rows],
            attention_mask=self.attention_mask[rows],
            prompt_len=self.prompt_len,
            response_mask=self.response_mask[rows],
            sampling_logp=self.sampling_logp[rows],
            topk_ids=self.topk_ids[rows],
            entropy=self.entropy[rows],
            texts=[self.texts[i] for i in rows.tolist()],
            truncated=self.truncated[rows],
        )

    @staticmethod
    def cat(parts: Sequence[Rollout], pad_id: int) -> Rollout:
        """The rows of `parts` in order, as one batch: prompts left-padded to the longest, responses
        right-padded to the longest (positions come from the attention mask, so no row changes)."""
        width_p, width_r = max(p.prompt_len for p in parts), max(p.response_mask.shape[1] for p in parts)

        def grown(p: Rollout) -> Rollout:
            left, right = width_p - p.prompt_len, width_r - p.response_mask.shape[1]
            return Rollout(
                sequences=F.pad(p.sequences, (left, right), value=pad_id),
                attention_mask=F.pad(p.attention_mask, (left, right), value=0),
                prompt_len=width_p,
                response_mask=F.pad(p.response_mask, (0, right), value=False),
                sampling_logp=F.pad(p.sampling_logp, (0, right)),
                topk_ids=F.pad(p.topk_ids, (0, 0, 0, right)),
                entropy=F.pad(p.entropy, (0, right)),
                texts=p.texts,
                truncated=p.truncated,
            )

        grown_parts = [grown(p) for p in parts]
        tensors = {
            k: torch.cat([getattr(p, k) for p in grown_parts])
            for k in (
                "sequences",
                "attention_mask",
                "response_mask",
                "sampling_logp",
                "topk_ids",
                "entropy",
                "truncated",
            )
        }
        return Rollout(**tensors, prompt_len=width_p, texts=[t for p in grown_parts for t in p.texts])

    def trimmed(self) -> Rollout:
        """The same rows without columns that are padding in every row (left of the earliest
        prompt token, right of the longest response): positions come from the attention mask,
        so every real token's distribution is unchanged, and the forward is cheaper."""
        first = int(self.attention_mask[:, : self.prompt_len].any(0).long().argmax())
        width = int(self.response_mask.any(0).nonzero().max()) + 1 if self.response_mask.any() else 1
        end = self.prompt_len + width
        return Rollout(
            sequences=self.sequences[:, first:end],
            attention_mask=self.attention_mask[:, first:end],
            prompt_len=self.prompt_len - first,
            response_mask=self.response_mask[:, :width],
            sampling_logp=self.sampling_logp[:, :width],
            topk_ids=self.topk_ids[:, :width],
            entropy=self.entropy[:, :width],
            texts=self.texts,
            truncated=self.truncated,
        )


@dataclass
class ResponseRow:
    """One response as per-token lists, before padding into a Rollout (an engine's output or a
    multi-turn episode, whose environment-inserted tokens have sampled False)."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # True: written by the policy
    logp: list[float] = field(default_factory=list)  # sampling log-prob (0 where not sampled)
    topk: list[list[int]] = field(default_factory=list)  # top-k ids per token (zeros where not sampled)
    entropy: list[float] = field(default_factory=list)
    truncated: bool = False  # cut at the length limit, without EOS or a stop string

    def add(self, ids, sampled: bool, logp, topk, entropy) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.logp += logp
        self.topk += topk
        self.entropy += entropy


def rollout_from_rows(
    rows: Sequence[ResponseRow], prompt_ids: Sequence[Sequence[int]], tokenizer, k: int
) -> Rollout:
    """Left-padded prompts and right-padded responses as one Rollout (CPU tensors). Every token of
    a response is attended to; only sampled ones are in response_mask."""
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    n, width = len(rows), max((len(r.ids) for r in rows), default=0)
    responses = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    real = torch.zeros(n, width, dtype=torch.bool)
    response_mask = torch.zeros(n, width, dtype=torch.bool)
    logp, entropy = torch.zeros(n, width), torch.zeros(n, width)
    topk_ids = torch.zeros(n, width, k, dtype=torch.long)
    for i, r in enumerate(rows):
        m = len(r.ids)
        if m:
            responses[i, :m], real[i, :m], response_mask[i, :m] = (
                torch.tensor(r.ids),
                True,
                torch.tensor(r.sampled),
            )
            logp[i, :m], entropy[i, :m] = torch.tensor(r.logp), torch.tensor(r.entropy)
            topk_ids[i, :m] = torch.tensor(r.topk, dtype=torch.long).view(m, k)
    return Rollout(
        sequences=torch.cat([prompts, responses], 1),
        attention_mask=torch.cat([prompt_mask, real.long()], 1),
        prompt_len=prompts.shape[1],
        response_mask=response_mask,
        sampling_logp=logp,
        topk_ids=topk_ids,
        entropy=entropy,
        texts=[tokenizer.decode(r.ids, skip_special_tokens=True) for r in rows],
        truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
    )


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


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id rows -> left-padded ids [N, W] and attention mask [N, W] (1 on real tokens)."""
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def eos_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a response: the generation config's EOS ids and the tokenizer's."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
