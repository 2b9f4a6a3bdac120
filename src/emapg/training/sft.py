"""Supervised fine-tuning, and the cached warm start of the built-in tiny model.

RL needs a policy that already succeeds sometimes: a short SFT on prompt+answer pairs gives a
tiny model that is right on part of the held-out problems, so GRPO-style groups carry signal.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import field_validator
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from emapg.errors import EmapgError
from emapg.eval.evaluate import sample_and_score
from emapg.model.models import DEFAULT_CACHE, build_tiny_model, build_tiny_tokenizer, load_model_and_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams, eos_ids
from emapg.rollout.hf import HFEngine
from emapg.settings import Float, Section, check, setting
from emapg.tasks.base import Example, WarmStartRecipe
from emapg.tasks.rewards import RewardScorer

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF models) skip
# Bump when the warm-start recipe changes, so stale caches are not reused.
# 3: keyed by the CPU kernels it ran on (models.pin_cpu_kernels); 2: the stopping test samples
# through the rollout engine.
WARM_START_VERSION = 3


class WarmStartSettings(Section):
    """The `warmstart` section: the supervised warm start that makes builtin:tiny able to answer at
    all, and that teaches a pretrained model (warmstart.pretrained) the task's answer format."""

    key: ClassVar[str] = "warmstart"
    steps: int = setting(
        1500, "most supervised steps that warm-start builtin:tiny (cached by settings)", ge=1
    )
    batch_size: int = setting(64, "supervised batch size", ge=1)
    lr: Float = setting(2e-3, "supervised learning rate", gt=0)
    target_accuracy: Float = setting(
        0.35, "stop SFT at this held-out sampled accuracy (0: run all steps)", ge=0, le=1
    )
    cache_dir: str = setting(DEFAULT_CACHE, "where warm starts are cached")
    pretrained: bool = setting(
        False, "warm-start a pretrained model.path too (builtin:tiny always is), e.g. on the answer format"
    )
    model_kwargs: dict = setting({}, "build_tiny_model settings, e.g. {max_position_embeddings: 256}")

    @field_validator("model_kwargs")
    @classmethod
    def _known(cls, kwargs: dict) -> dict:
        try:
            _with_defaults(build_tiny_model, kwargs, skip=("tokenizer",))
        except TypeError as e:
            check(False, f"{e} (write {{name: value}}, a space after the colon)")
        return kwargs


def sft_batch(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask`, `labels` for prompt + answer + EOS.

    Labels are IGNORE_INDEX on prompt and padding positions: the loss is on the answer and the
    EOS token only, so the model learns to answer and to stop, not to write prompts. An example
    with `meta["segments"]`, a list of (text, learn) pairs, has that as its response instead:
    text the environment inserted (learn False, e.g. retrieved passages) is masked out too.
    """
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise EmapgError("sft: the tokenizer needs an eos_token and a pad_token")
    all_ids, all_labels = [], []
    for ex, p in zip(examples, encode_prompts(tokenizer, [ex.prompt for ex in examples]), strict=True):
        ids, labels = list(p), [IGNORE_INDEX] * len(p)
        for text, learn in ex.meta.get("segments", [(ex.answer, True)]):
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += part
            labels += part if learn else [IGNORE_INDEX] * len(part)
        all_ids.append(torch.tensor(ids + [tokenizer.eos_token_id]))
        all_labels.append(torch.tensor(labels + [tokenizer.eos_token_id]))
    return {
        "input_ids": pad_sequence(all_ids, batch_first=True, padding_value=tokenizer.pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in all_ids], batch_first=True),
        "labels": pad_sequence(all_labels, batch_first=True, padding_value=IGNORE_INDEX),
    }


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    warmup_steps: int = 20,
    min_lr_ratio: float = 1.0,
    seed: int = 0,
    stop: Callable[[int], bool] | None = None,
    stop_every: int = 50,
    progress: bool = True,
) -> list[float]:
    """Teacher-forced SFT with AdamW; returns the loss of every step run.

    `stop(step)`, when given, is called every `stop_every` steps; training ends early when it
    returns True (`steps` is then a cap).

    Examples are visited in seeded random order, epoch after epoch. The learning rate warms up
    linearly, then follows a cosine down to `min_lr_ratio * lr`; the default 1.0 keeps it
    constant, which suits a warm start that is meant to stop mid-way, not converge.
    """
    if not examples:
        raise EmapgError("sft: expected at least one example")
    if steps < 1 or batch_size < 1:
        raise EmapgError(f"sft: expected steps >= 1 and batch_size >= 1, got {steps}, {batch_size}")
    device = next(model.parameters()).device
    batches = _shuffled_batches(len(examples), batch_size, torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    sched = _lr_schedule(opt, steps, warmup_steps, min_lr_ratio)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc="sft", disable=not progress, dynamic_ncols=True)
    for step in bar:
        idx = next(batches)
        batch = {k: v.to(device) for k, v in sft_batch(tokenizer, [examples[i] for i in idx]).items()}
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if stop is not None and (step + 1) % stop_every == 0 and stop(step + 1):
            break
    bar.close()
    model.eval()
    return losses


def _shuffled_batches(n: int, batch_size: int, gen: torch.Generator) -> Iterator[list[int]]:
    """Endless batches of `batch_size` indices into n examples, in seeded random order reshuffled
    each epoch (an epoch's remainder too small for a batch is dropped)."""
    order, pos = torch.randperm(n, generator=gen), 0
    while True:
        if pos + batch_size > len(order):  # new epoch: reshuffle
            order, pos = torch.randperm(n, generator=gen), 0
        yield order[pos : pos + batch_size].tolist()
        pos += batch_size


def _lr_schedule(
    opt: torch.optim.Optimizer, steps: int, warmup_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_steps`, then a cosine from lr down to `min_lr_ratio * lr` at `steps`."""

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def _default_max_new_tokens(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example]) -> int:
    # Room for the longest answer, its EOS and one token of slack; longer output cannot score.
    longest = max(len(tokenizer(ex.answer, add_special_tokens=False)["input_ids"]) for ex in examples)
    return longest + 2


DEFAULT_MODEL_KWARGS: dict[str, Any] = {}
# `steps` is a cap: the warm start normally stops at its target accuracy well before it.
DEFAULT_SFT_KWARGS: dict[str, Any] = {
    "steps": 1500,
    "batch_size": 64,
    "lr": 2e-3,  # as warmstart.lr
    "seed": 0,
    "stop_every": 25,
}


def warm_start(
    cache_dir: str | os.PathLike[str],
    *,
    recipe: WarmStartRecipe,
    model_kwargs: dict[str, Any] | None = None,
    sft_kwargs: dict[str, Any] | None = None,
    target_accuracy: float | None = 0.35,
    num_val: int = 200,
    base: str | None = None,
    progress: bool = True,
) -> Path:
    """Build the tiny tokenizer and model (or load the model folder `base`), SFT them on the
    recipe's examples, cache the result.

    SFT stops once the sampled accuracy (temperature 1, two samples per prompt) on `num_val`
    training problems held out from SFT reaches `target_accuracy`, checked every
    `sft_kwargs["stop_every"]` steps (None: run all `steps`). Why: a tiny model learns
    arithmetic in an abrupt jump whose timing varies with the seed (575-1150 steps), so a fixed
    step count gives anything from 5% to 70%; a target gives a policy that is reliably
    mediocre, the regime where RL has signal (groups with some right answers) and room to climb.

    The directory under `cache_dir` is keyed by a hash of every setting and of the training
    examples, so a changed task or recipe never reuses a stale model. It is written to a temp
    directory and renamed into place, so a killed run never leaves a half-written cache. Returns
    the directory (loadable with `emapg.model.models.load_model_and_tokenizer`).
    """
    model_kwargs = {**DEFAULT_MODEL_KWARGS, **(model_kwargs or {})}
    sft_kwargs = {**DEFAULT_SFT_KWARGS, **(sft_kwargs or {})}
    settings = _settings(recipe, model_kwargs, sft_kwargs, target_accuracy, num_val, base)
    examples = recipe.examples
    if target_accuracy is not None and len(examples) <= num_val:
        raise EmapgError(
            f"the warm start measures warmstart.target_accuracy on {num_val} training examples held out "
            f"from it, and the task has {len(examples)} (after task.num_eval for evaluation): give more "
            "training data, a smaller task.num_eval, or warmstart.target_accuracy=0 (warmstart.steps, no target)"
        )
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    final = cache_dir / f"warm-start-{recipe.task.name}-{key}"
    if (final / "warm_start.json").is_file():
        return final

    cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, tokenizer = _initial_model(base, settings, model_kwargs)
    losses, val_history = _sft_to_target(
        model, tokenizer, recipe.task, examples, sft_kwargs, target_accuracy, num_val, progress
    )
    record = {
        **settings,
        "steps_run": len(losses),
        "final_loss": losses[-1],
        "val_accuracy": val_history[-1][1] if val_history else None,
        "val_history": val_history,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _publish(model, tokenizer, record, final)
    return final


def _initial_model(base: str | None, settings: dict, model_kwargs: dict[str, Any]):
    """The model and tokenizer the warm start trains: the tiny ones built from scratch (with the
    tokenizer settings the cache key records), or those of the model folder `base`."""
    if base is None:
        tokenizer = build_tiny_tokenizer(**settings.get("tokenizer_kwargs", {}))
        return build_tiny_model(tokenizer, **model_kwargs), tokenizer
    return load_model_and_tokenizer(base)


def _sft_to_target(
    model, tokenizer, task, examples, sft_kwargs: dict, target_accuracy, num_val: int, progress: bool
) -> tuple[list[float], list[tuple[int, float]]]:
    """`sft` on `examples`, stopped once the sampled accuracy on their last `num_val` (held out
    from SFT) reaches `target_accuracy` (None: all steps, no hold-out); returns the losses and
    the accuracy checks as (step, accuracy)."""
    val_history: list[tuple[int, float]] = []
    with contextlib.ExitStack() as stack:
        stop = None
        if target_accuracy is not None:
            examples, val = examples[:-num_val], examples[-num_val:]
            scorer = stack.enter_context(RewardScorer(task, timeout_s=10.0))
            stop = _accuracy_stop(model, tokenizer, task, val, scorer, target_accuracy, val_history)
        losses = sft(model, tokenizer, examples, stop=stop, progress=progress, **sft_kwargs)
    if progress and val_history:
        tqdm.write(
            f"warm start: {len(losses)} SFT steps, held-out sampled accuracy {val_history[-1][1]:.2f} "
            f"(target {target_accuracy})"
        )
    return losses, val_history


def _settings(recipe: WarmStartRecipe, model_kwargs, sft_kwargs, target_accuracy, num_val, base) -> dict:
    """What the cached warm start is keyed by: every setting, defaults included (so changing a
    default never reuses a stale model), a hash of the examples, and the base model's files."""
    data_hash = hashlib.sha256()
    for ex in recipe.examples:
        data_hash.update(f"{ex.prompt}\0{ex.answer}\0".encode())
    skip_sft = ("model", "tokenizer", "examples", "stop", "progress")
    if base is None:
        model = {"model_kwargs": _with_defaults(build_tiny_model, model_kwargs, skip=("tokenizer",))}
        # Only when set, so the keys of existing caches stay valid.
        model |= {"tokenizer_kwargs": {"extra_chars": recipe.extra_chars}} if recipe.extra_chars else {}
    else:
        model = {"base": _folder_identity(base)}
    return {
        "version": WARM_START_VERSION,
        "task": recipe.task.name,
        "train_examples_sha256": data_hash.hexdigest(),
        **model,
        "sft_kwargs": _with_defaults(sft, sft_kwargs, skip=skip_sft),
        "target_accuracy": target_accuracy,
        "num_val": num_val if target_accuracy is not None else 0,
        # The kernels decide the model too (models.pin_cpu_kernels): AVX2 and AVX-512 give two.
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
    }


def _folder_identity(folder: str) -> dict:
    """A model folder as a cache key: its path and every file's size and modification time (a
    converted GGUF's folder name already carries the file's digest)."""
    path = Path(folder).resolve()
    return {"path": str(path),
            "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.iterdir()) if f.is_file()}}  # fmt: skip


def _accuracy_stop(
    model, tokenizer, task, val, scorer, target: float, history: list
) -> Callable[[int], bool]:
    """SFT's stopping test: the sampled accuracy on `val` (two samples each) reached `target`;
    each check is appended to `history` as (step, accuracy)."""
    val = [e for e in val for _ in range(2)]
    engine, eos = HFEngine(model, tokenizer, batch_size=512), eos_ids(model, tokenizer)
    params = SamplingParams(max_new_tokens=_default_max_new_tokens(tokenizer, val), seed=0)

    def stop(step: int) -> bool:
        _, scored = sample_and_score(
            engine, tokenizer, task, val, scorer, params, chat_template=True, eos=eos
        )
        history.append((step, sum(scored.rewards) / len(val)))
        return history[-1][1] >= target

    return stop


def _publish(model, tokenizer, record: dict, final: Path) -> None:
    """Write model, tokenizer and `record` to a temporary directory beside `final`, then rename it
    into place: the record is written last, so its presence marks a complete directory."""
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-warm-start-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "warm_start.json").write_text(json.dumps(record, indent=2, default=str))
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first; its result is identical
            if not (final / "warm_start.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_defaults(fn: Any, kwargs: dict[str, Any], skip: Sequence[str]) -> dict[str, Any]:
    """`kwargs` completed with `fn`'s keyword defaults; raises TypeError on an unknown name."""
    params = {n: p for n, p in inspect.signature(fn).parameters.items() if n not in skip}
    unknown = set(kwargs) - set(params)
    if unknown:
        raise TypeError(
            f"{fn.__name__}: unknown settings {sorted(unknown)}; expected some of {sorted(params)}"
        )
    return {n: kwargs.get(n, p.default) for n, p in params.items()}
