"""The Hugging Face rollout engine: `generate` with the KV cache.

The sampling log-probs, entropy and top-k ids are recorded in the same pass that samples, by
a logits processor that sees the raw logits of every step (it runs before `_RowSampler`, which
applies the temperature and top-p itself; generate adds no warpers). The recorded log-prob of
each token is that of the distribution it was drawn from, mu: softmax(logits / temperature),
nucleus-truncated and renormalised when top_p < 1 (the rollout correction divides by it). The
top-k ids and the entropy are those of the untruncated tempered policy. The update pass
recomputes the policy on whole sequences without the KV cache, so its log-probs equal these
only up to floating-point rounding (ratio 1 +- 1e-6 in fp32).

Sampling is batch-invariant: `_RowSampler` draws each token by inverting the CDF at a uniform
hashed from (call seed, global row index, step), so a row samples the same tokens whichever
batch, chunk or rank it is generated in (multi-process training then equals one process). The
call seed comes from torch's global generator, so `torch.manual_seed` still governs the stream.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    TopPLogitsWarper,
)

from emapg import distributed
from emapg.batch import Rollout, left_pad
from emapg.model import prompt_cache
from emapg.model.lm_head import positions_of
from emapg.model.lora import unwrap
from emapg.rollout.base import EngineNeeds, RolloutSettings, SamplingParams, eos_ids, with_call_seed


class _SamplingRecorder(LogitsProcessor):
    """Records per step: top-k ids and entropy now, the sampled token's log-prob one step later
    (under the nucleus-truncated distribution when top_p < 1: the one `_RowSampler` draws from)."""

    def __init__(self, temperature: float, k: int, top_p: float = 1.0):
        self.temperature, self.k = temperature, k
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None
        self.token_logp: list[Tensor] = []
        self.topk_ids: list[Tensor] = []
        self.entropy: list[Tensor] = []
        self._last: Tensor | None = None  # log-probs of the latest step, [B, V]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self._last is not None:  # the token sampled at the previous step is input_ids[:, -1]
            self.token_logp.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        tempered = scores.float() if self.temperature == 1 else scores.float() / self.temperature
        logp = torch.log_softmax(tempered, dim=-1)
        self._last = (
            logp if self.top_p is None else torch.log_softmax(self.top_p(input_ids, tempered), dim=-1)
        )
        self.entropy.append(-(logp.exp() * logp).sum(-1))
        if self.k:
            self.topk_ids.append(logp.topk(min(self.k, logp.shape[-1]), dim=-1).indices)
        return scores

    def finish(self, last_tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.token_logp.append(self._last.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
        n = last_tokens.shape[0]
        topk = (
            torch.stack(self.topk_ids, 1)
            if self.k
            else torch.zeros(n, len(self.entropy), 0, dtype=torch.long)
        )
        return torch.stack(self.token_logp, 1), topk.to(last_tokens.device), torch.stack(self.entropy, 1)


_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic): a counter-based hash."""
    x = x + _GOLDEN
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def row_uniforms(seed: int, rows: Tensor, steps: int) -> Tensor:
    """Uniform draws in (0, 1), [len(rows), steps]: entry (i, t) is a pure function of
    (seed, rows[i], t). Drawn for all steps at once: hashing per step costs ~30 small ops."""
    t = torch.arange(steps, device=rows.device)
    bits = splitmix64(splitmix64(torch.tensor(seed, device=rows.device) ^ rows).unsqueeze(-1) + t)
    return (_shift(bits, 11).double() + 0.5) / float(1 << 53)  # 53 random bits, never 0 or 1


class _RowSampler(LogitsProcessor):
    """Draws the next token of each row from softmax(logits / temperature), nucleus-truncated,
    by inverting its CDF at the row's own uniform; returns scores whose argmax is that token,
    so generate runs greedy and never touches the global random stream."""

    def __init__(self, temperature: float, top_p: float, seed: int, rows: Tensor, steps: int):
        self.temperature, self.step = temperature, 0
        self.uniforms = row_uniforms(seed, rows, steps)
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1 else None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.temperature != 1:  # each pass here is over [rows, vocabulary]: skip the no-ops
            scores = scores / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        cdf = torch.softmax(scores, -1, dtype=torch.float64).cumsum_(-1)  # = softmax(double) bit for bit
        u = self.uniforms[:, self.step : self.step + 1]
        self.step += 1
        # The first token whose CDF reaches u (tokens of probability 0 never do).
        token = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -torch.inf).scatter_(-1, token, 0.0)


class _EndTracker(StoppingCriteria):
    """Records each response's length when it ends: at EOS or once it contains a stop string."""

    def __init__(self, prompt_len: int, batch: int, eos_ids: list[int], tokenizer, stop: list[str], device):
        self.prompt_len, self.eos, self.tokenizer, self.stop = prompt_len, eos_ids, tokenizer, stop
        self.length = torch.full((batch,), -1, dtype=torch.long, device=device)

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        done = torch.isin(input_ids[:, -1], torch.tensor(self.eos, device=input_ids.device))
        if self.stop:
            for b in (self.length < 0).nonzero().flatten().tolist():
                text = self.tokenizer.decode(input_ids[b, self.prompt_len :], skip_special_tokens=True)
                done[b] |= any(s in text for s in self.stop)
        newly = done & (self.length < 0)
        self.length[newly] = input_ids.shape[1] - self.prompt_len
        return self.length >= 0


def make(settings: RolloutSettings, model, tokenizer, model_dir: str, needs: EngineNeeds) -> HFEngine:
    """The engine `rollout.engine=hf` builds: generate with the live policy module itself."""
    return HFEngine(
        model, tokenizer, batch_size=settings.batch_size, share_prompts=needs.share_prompts,
        dtype=getattr(torch, needs.dtype),
    )  # fmt: skip


class HFEngine:
    """The rollout engine on Hugging Face `generate` with the KV cache (see the module doc).

    It samples with the live policy module itself, so `sync_weights` only points it at the
    model it is given and copies nothing. With `share_prompts`, consecutive rows with the same
    prompt (a group) prefill it once (`_prompt_cache`). `dtype` is what it computes in: a model
    whose parameters are wider (float32 weights of a bf16-mixed run) runs under autocast to it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size: int = 256,
        share_prompts: bool = True,
        dtype: torch.dtype | None = None,
    ):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.share_prompts, self.dtype = share_prompts, dtype

    def sync_weights(self, model: PreTrainedModel, version: Hashable) -> None:
        self.model = model

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        rows: Sequence[int] | None = None,
    ) -> Rollout:
        model, tokenizer = self.model, self.tokenizer
        device = next(model.parameters()).device
        rows = (
            torch.arange(len(prompt_ids)) if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
        )
        prompt_ids, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
        prompt_ids, prompt_mask, rows = prompt_ids.to(device), prompt_mask.to(device), rows.to(device)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=False,  # argmax of _RowSampler's scores when sampling
            top_k=None,  # GenerationConfig's default top_k=50 would be one more warper
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos_ids(model, tokenizer),
        )
        seed = with_call_seed(params).seed
        was_training = model.training
        model.eval()
        parts = []
        starts = range(0, prompt_ids.shape[0], self.batch_size)
        with self._compute(device):
            # Under torchrun (FSDP) every rank must run as many generate calls as the busiest one.
            for _ in range(distributed.max_one(len(starts)) - len(starts)):
                model.generate(
                    input_ids=prompt_ids[:1],
                    attention_mask=prompt_mask[:1],
                    generation_config=config,
                    max_new_tokens=1,
                    synced_gpus=True,
                )
            for a in starts:
                end = a + self.batch_size
                parts.append(
                    self._generate(prompt_ids[a:end], prompt_mask[a:end], rows[a:end], params, seed, config)
                )
        model.train(was_training)
        return _assemble(parts, prompt_ids, prompt_mask, tokenizer)

    def _compute(self, device: torch.device):
        """Autocast to the engine's dtype where the model's parameters are wider, else nothing."""
        params = next(self.model.parameters()).dtype
        if self.dtype is None or self.dtype.itemsize >= params.itemsize:  # (a bfloat16 anchor runs as it is)
            return nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def _generate(
        self, ids: Tensor, mask: Tensor, rows: Tensor, params: SamplingParams, seed, config
    ) -> tuple:
        """One generate call: (responses, log-probs, top-k ids, entropy, lengths, truncated)."""
        prompt_len = ids.shape[1]
        recorder = _SamplingRecorder(params.temperature, params.topk, 1.0 if params.greedy else params.top_p)
        processors = [recorder]
        if not params.greedy:
            processors.append(
                _RowSampler(params.temperature, params.top_p, seed, rows, params.max_new_tokens)
            )
        eos = config.eos_token_id
        ends = _EndTracker(prompt_len, ids.shape[0], eos, self.tokenizer, list(params.stop), ids.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=processors,
            stopping_criteria=[ends],
            synced_gpus=distributed.world() > 1,  # FSDP: every rank runs each forward until all end
            **self._prompt_cache(ids, mask),
        )
        logp, top, entropy = recorder.finish(out[:, -1])
        length = torch.where(ends.length < 0, out.shape[1] - prompt_len, ends.length)
        return out[:, prompt_len:], logp, top, entropy, length, ends.length < 0

    def _prompt_cache(self, ids: Tensor, mask: Tensor) -> dict:
        """generate's keyword argument for a KV cache holding every row's prompt but its last
        token, each group's computed once and repeated to its rows (generate then runs the last
        token itself, whose logits it needs); {} where the rows share no prompt or the model
        cannot (`prompt_cache.empty_cache`): generate prefills every row."""
        groups = prompt_cache.prompt_groups(ids, mask) if self.share_prompts and ids.shape[1] > 1 else None
        model = unwrap(self.model)  # a peft model's forward takes no cache: its transformers model's does
        cache = None if groups is None else prompt_cache.empty_cache(model)
        if cache is None:
            return {}
        first, keyword = prompt_cache.group_starts(groups), prompt_cache.cache_keyword(model)
        prefix = mask[first, :-1]
        model(input_ids=ids[first, :-1], attention_mask=prefix, position_ids=positions_of(prefix),
              use_cache=True, logits_to_keep=1, **{keyword: cache})  # fmt: skip
        prompt_cache.repeat_to_groups(cache, groups)
        return {keyword: cache}


def _assemble(parts: list[tuple], prompt_ids: Tensor, prompt_mask: Tensor, tokenizer) -> Rollout:
    """The generate calls' outputs as one Rollout, responses right-padded to the longest."""
    width = max(p[0].shape[1] for p in parts)
    responses = torch.cat([_pad_right(p[0], width, tokenizer.pad_token_id) for p in parts])
    logp, top, entropy = (torch.cat([_pad_right(p[i], width, 0) for p in parts]) for i in (1, 2, 3))
    lengths = torch.cat([p[4] for p in parts])
    response_mask = torch.arange(width, device=responses.device) < lengths.unsqueeze(1)
    responses = responses.masked_fill(~response_mask, tokenizer.pad_token_id)
    texts = [
        tokenizer.decode(r[:n], skip_special_tokens=True)
        for r, n in zip(responses, lengths.tolist(), strict=True)
    ]
    return Rollout(
        sequences=torch.cat([prompt_ids, responses], 1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], 1),
        prompt_len=prompt_ids.shape[1],
        response_mask=response_mask,
        sampling_logp=logp.masked_fill(~response_mask, 0.0),
        topk_ids=top,
        entropy=entropy.masked_fill(~response_mask, 0.0),
        texts=texts,
        truncated=torch.cat([p[5] for p in parts]),
    )


def _pad_right(x: Tensor, width: int, value) -> Tensor:
    """Right-pad dim 1 of [N, L, ...] to `width` (torch's pad counts dims from the last)."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]), value=value)
