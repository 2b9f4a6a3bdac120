"""Rollouts through a colocated vLLM engine (`rollout.engine=vllm`, `pip install emapg[vllm]`).

Pinned to vLLM >= 0.10.2, < 0.12 (the `vllm` extra), for two things this file relies on:
- `LLM(logprobs_mode="processed_logprobs")` (added in 0.10.2). vLLM's default, "raw_logprobs",
  returns log-probs of the RAW model logits, before any processor (temperature, top-k/top-p,
  penalties); the processed mode returns them after all of them (engine-args docs), so also
  after top-p renormalisation, which is why `rollout.engine=vllm` needs `rollout.top_p=1`. So with top_p = 1 every returned value is log softmax(logits / T), the
  sampling policy the trainer's PPO ratio and reverse top-k KL expect: no recompute is needed.
  From raw log-probs the tempered log-prob of a token cannot be derived (its normaliser needs
  the whole vocabulary), so a raw mode would need the trainer's own forward pass instead.
- the V1 engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode does),
  so `llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights`
  reaches the model, followed by `llm.reset_prefix_cache()` (cached KV is of old weights).

What differs from the HF engine (rollout/hf.py, the reference):
- the top-k ids come from vLLM's returned top-k (ranks 1..k). They are the same for any
  temperature (dividing logits by T keeps their order).
- entropy is a metric only (the trainer logs it, never differentiates it). vLLM returns k
  log-probs per token, not the vocabulary, so the entropy recorded here is that of the top-k
  plus one bucket holding the rest of the mass: a lower bound on the true entropy (merging
  outcomes never raises entropy), exact at k = V.
- vLLM's kernels differ from the trainer's forward, so the update pass's log-probs equal these
  only up to bf16-level rounding; benchmarks/gpu_check_vllm.py prints the gap.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from emapg.errors import EmapgError
from emapg.rollout.base import Rollout


def to_rollout(outputs: list, prompt_ids: list[list[int]], *, topk: int, pad_id: int, tokenizer) -> Rollout:
    """vLLM RequestOutputs -> Rollout, one row per sample, in prompt order then sample order.

    `outputs[i].outputs[j].token_ids` holds the response (EOS / stop token included) and
    `.logprobs[t]` a dict token id -> Logprob(logprob, rank) with the sampled token and the
    ranks 1..topk of the sampling distribution. `prompt_ids[i]` is request i's prompt.
    """
    rows = [(prompt_ids[i], s) for i, out in enumerate(outputs) for s in out.outputs]
    prompt_len = max(len(p) for p, _ in rows)
    width = max(len(s.token_ids) for _, s in rows)
    n = len(rows)
    sequences = torch.full((n, prompt_len + width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(n, prompt_len + width, dtype=torch.long)
    response_mask = torch.zeros(n, width, dtype=torch.bool)
    sampling_logp = torch.zeros(n, width)
    entropy = torch.zeros(n, width)
    topk_ids = torch.zeros(n, width, topk, dtype=torch.long)
    for r, (prompt, sample) in enumerate(rows):
        tokens, length = list(sample.token_ids), len(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != length:
            raise EmapgError("vLLM returned no log-probs per token; was SamplingParams.logprobs set?")
        sequences[r, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[r, prompt_len - len(prompt) : prompt_len + length] = 1
        sequences[r, prompt_len : prompt_len + length] = torch.tensor(tokens, dtype=torch.long)
        response_mask[r, :length] = True
        for t, (token, step) in enumerate(zip(tokens, sample.logprobs, strict=True)):
            sampling_logp[r, t] = step[token].logprob
            head = sorted((lp.rank, tid, lp.logprob) for tid, lp in step.items() if lp.rank <= topk)
            if topk:
                topk_ids[r, t] = torch.tensor([tid for _, tid, _ in head[:topk]], dtype=torch.long)
            entropy[r, t] = _bucket_entropy([lp for _, _, lp in head] or [step[token].logprob])
    texts = [tokenizer.decode(list(s.token_ids), skip_special_tokens=True) for _, s in rows]
    return Rollout(
        sequences=sequences,
        attention_mask=attention_mask,
        prompt_len=prompt_len,
        response_mask=response_mask,
        sampling_logp=sampling_logp,
        topk_ids=topk_ids,
        entropy=entropy,
        texts=texts,
    )


def _bucket_entropy(logps: list[float]) -> float:
    """Entropy of the known probabilities plus one bucket for the missing mass (a lower bound)."""
    probs = [math.exp(lp) for lp in logps]
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * lp for p, lp in zip(probs, logps, strict=True)) - (
        rest * math.log(rest) if rest > 0 else 0.0
    )


def group_requests(prompt_ids: list[list[int]]) -> list[tuple[list[int], int]]:
    """Runs of identical consecutive prompts -> (prompt, n): one vLLM request with n samples each,
    whose outputs come back in the same row order as the repeated prompts the trainer passes."""
    runs: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if runs and runs[-1][0] == ids:
            runs[-1] = (ids, runs[-1][1] + 1)
        else:
            runs.append((ids, 1))
    return runs


def weights_to_push(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor in the engine's dtype) for every parameter of the policy.

    `named_parameters` yields a tied parameter once, under its first name (embed_tokens for a
    tied lm_head); vLLM's loaders re-tie lm_head themselves, and skip it when given. The names
    are the HF checkpoint names, which vLLM's `load_weights` maps to its own modules.
    """
    for name, param in model.named_parameters():
        yield name, param.detach().to(dtype)


def push_weights(engine, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Load the weights into the colocated model, then drop KV cached under the old weights."""
    runner = engine.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.model.load_weights(weights)
    engine.reset_prefix_cache()


class VllmEngine:
    """A colocated vLLM engine with the call signature of rollout.hf.generate."""

    def __init__(self, cfg):
        try:
            import vllm
        except ImportError:
            raise EmapgError("rollout.engine=vllm needs vLLM: pip install 'emapg[vllm]'") from None
        if not torch.cuda.is_available():
            raise EmapgError("rollout.engine=vllm needs a CUDA GPU; none is visible")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # model in this process
        self._vllm = vllm
        self.dtype = getattr(torch, cfg.model.dtype)
        self.llm = vllm.LLM(
            model=cfg.model.path,
            dtype=cfg.model.dtype,
            seed=cfg.train.seed,
            gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
            max_logprobs=max(cfg.kl.k, 1),
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
        )

    def __call__(self, model, tokenizer, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0,
                 greedy=False, topk=0, stop=(), batch_size=0, add_special_tokens=True, first_row=0) -> Rollout:  # fmt: skip
        """Push the policy's current weights, then sample (batch_size: vLLM batches on its own;
        first_row: vLLM samples with its own generator, one process only)."""
        push_weights(self.llm, weights_to_push(model, self.dtype))
        ids = tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]
        runs = group_requests(ids)
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=0.0 if greedy else temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=topk,
                stop=list(stop),
                include_stop_str_in_output=True,
            )
            for _, n in runs
        ]
        requests = [{"prompt_token_ids": p} for p, _ in runs]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        rollout = to_rollout(
            outputs, [p for p, _ in runs], topk=topk, pad_id=tokenizer.pad_token_id, tokenizer=tokenizer
        )
        device = next(model.parameters()).device
        for field in ("sequences", "attention_mask", "response_mask", "sampling_logp", "topk_ids", "entropy"):
            setattr(rollout, field, getattr(rollout, field).to(device))
        return rollout


_ENGINES: dict[str, VllmEngine] = {}


def engine_for(cfg) -> VllmEngine:
    """One colocated engine per model path per process (it holds GPU memory for its lifetime)."""
    if cfg.model.path not in _ENGINES:
        _ENGINES[cfg.model.path] = VllmEngine(cfg)
    return _ENGINES[cfg.model.path]
