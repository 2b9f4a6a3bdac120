"""The EMA-PG training loop: rollout, reward, advantages, anchor pass, PPO update, EMA step.

Read bottom up: `train` is the whole loop, `setup` builds what it runs on, and the helpers
above them are the passes. The algorithms themselves are pure functions in kl.py, topk.py,
advantages.py, policy_loss.py and anchor.py. Memory: between passes only per-token summaries
travel (the sampled token's log-prob, k top-k ids, k anchor log-probs); no [tokens, vocab]
tensor is ever stored.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from emapg import checkpoint, distributed, kl, lora, rollout_correction
from emapg.advantages import group_advantages
from emapg.anchor import Anchor
from emapg.config import Config, anchor_dtype, recomputes_old_logp, rollout_dtype, to_dict, validate_world
from emapg.errors import EmapgError
from emapg.evaluation import sample_and_score
from emapg.guards import step_is_finite
from emapg.lm_head import response_summary
from emapg.lora import AdapterAnchor
from emapg.metrics import MetricsLog
from emapg.models import load_model_and_tokenizer
from emapg.policy_loss import aggregate, aggregation_total, ppo_clip
from emapg.rewards import RewardScorer, Scored
from emapg.rollout import Rollout, RolloutEngine, SamplingParams, encode_prompts, eos_ids
from emapg.rollout.multiturn import sample_examples
from emapg.tasks import make_task
from emapg.tasks.base import Example, Task

# ---------------------------------------------------------------------------------------------
# Model passes


@dataclass
class AnchorView:
    """What the anchor pass leaves for the update: log-probs at the token and on the top-k set q."""

    head_ids: Tensor  # [N, L, k] the set q
    ref_logp: Tensor  # [N, L]
    ref_head_logp: Tensor  # [N, L, k]

    def select(self, rows: Tensor, width: int) -> AnchorView:
        """The rows `rows`, response columns up to `width` (a trimmed micro-batch's)."""
        return AnchorView(
            self.head_ids[rows, :width], self.ref_logp[rows, :width], self.ref_head_logp[rows, :width]
        )


@dataclass
class OldPolicy:
    """pi_old for the update: its log-prob at each sampled token, its top-k set (the reverse
    KL's q) and the rollout correction between it and mu, the engine that sampled."""

    logp: Tensor  # [N, L] log pi_old(token)
    topk_ids: Tensor  # [N, L, k]
    weight: Tensor  # [N, L] multiplies the policy-gradient loss (rollout_correction.correct)
    keep: Tensor  # [N, L] bool: response tokens that stay in the loss

    def select(self, rows: Tensor, width: int) -> OldPolicy:
        return OldPolicy(*(t[rows, :width] for t in (self.logp, self.topk_ids, self.weight, self.keep)))


@torch.no_grad()
def recompute_old_logp(cfg: Config, model, batch: Rollout, k: int) -> tuple[Tensor, Tensor]:
    """The trainer's own pi_old: a no-grad pass of the policy over the batch, before the first
    optimiser step, giving the log-prob at each sampled token and the top-k ids (k of them)."""
    n, width = batch.response_mask.shape
    logp = torch.zeros(n, width, device=batch.sequences.device)
    topk_ids = torch.zeros(n, width, k, dtype=torch.long, device=batch.sequences.device)
    for rows in micro_batches(cfg, batch, torch.arange(n)):
        idx = torch.arange(1) if rows is None else rows  # None: a padding pass, its result dropped
        part = batch.select(idx).trimmed()
        w = part.response_mask.shape[1]
        s = response_summary(
            model, part, part.responses.unsqueeze(-1), temperature=cfg.rollout.temperature, topk_self=k
        )
        if rows is not None:
            logp[rows, :w], topk_ids[rows, :w] = s.logp()[..., 0], s.topk_ids
    return logp, topk_ids


def old_policy(cfg: Config, model, batch: Rollout, k: int, timer: PhaseTimer) -> tuple[OldPolicy, dict]:
    """pi_old (recomputed, or the engine's log-probs: `config.recomputes_old_logp`), the rollout
    correction, and their metrics: mismatch/* (only when recomputed: else mu is pi_old) and
    rollout_correction/*."""
    mask = batch.response_mask
    metrics = {}
    if recomputes_old_logp(cfg):
        with timer("old_logp"):
            logp, topk_ids = recompute_old_logp(cfg, model, batch, k)
        m = rollout_correction.mismatch_metrics(logp, batch.sampling_logp, mask, topk_ids, batch.topk_ids)
        kl_sum, overlap_sum, tokens = distributed.sum_all(
            m["kl_sum"], m.get("topk_overlap_sum", 0.0), m["tokens"]
        )
        metrics = {
            "mismatch/kl": kl_sum / max(tokens, 1.0),
            "mismatch/max_abs_logp": distributed.max_one(m["max_abs_logp"]),
            **({"mismatch/topk_overlap": overlap_sum / max(tokens, 1.0)} if k else {}),
        }
    else:
        logp, topk_ids = batch.sampling_logp, batch.topk_ids
    c = rollout_correction.correct(
        logp, batch.sampling_logp, mask, cfg.algo.rollout_correction, cfg.algo.rollout_correction_cap
    )
    kept = c.keep & mask
    weight_sum, kept_n, tokens = distributed.sum_all(
        float((c.weight * kept).sum()), float(kept.sum()), float(mask.sum())
    )
    metrics |= {
        "rollout_correction/weight_mean": weight_sum / max(kept_n, 1.0),
        "rollout_correction/weight_max": distributed.max_one(
            float(c.weight[kept].max()) if kept.any() else 0.0
        ),
        "rollout_correction/masked_frac": 1.0 - kept_n / max(tokens, 1.0),
    }
    return OldPolicy(logp, topk_ids, c.weight, c.keep), metrics


def _head_ids(cfg: Config, old: OldPolicy, vocab: int) -> Tensor | None:
    """q for the KL: pi_old's top-k (reverse), the whole vocabulary (exact), none (sampled)."""
    if cfg.kl.estimator == "exact":
        return torch.arange(vocab, device=old.logp.device).expand(*old.logp.shape, vocab)
    if cfg.kl.estimator in kl.TOPK and cfg.kl.direction == "reverse":
        return old.topk_ids
    if cfg.kl.estimator in kl.TOPK:
        return None  # forward: the anchor pass picks q from its own top-k
    return old.topk_ids[..., :0]


def micro_batches(cfg: Config, batch: Rollout, rows: Tensor) -> list[Tensor | None]:
    """`rows` split for forward/backward: `algo.micro_batch_size` at a time, or packed in order
    up to `algo.micro_batch_tokens` (rows x their padded length). With several processes the
    list is padded with None up to the longest any rank has: under FSDP every rank must run
    the same number of forward passes, and a None is run on one row with weight 0."""
    if cfg.algo.micro_batch_tokens:
        lengths = batch.attention_mask.sum(-1)  # prompt + response tokens of each row
        parts, current, longest = [], [], 0
        for r in rows.tolist():
            longest_with = max(longest, int(lengths[r]))
            if current and (len(current) + 1) * longest_with > cfg.algo.micro_batch_tokens:
                parts.append(torch.tensor(current))
                current, longest_with = [], int(lengths[r])
            current.append(r)
            longest = longest_with
        parts += [torch.tensor(current)] if current else []
    else:
        parts = [part for part in rows.split(cfg.algo.micro_batch_size) if len(part)]
    return parts + [None] * (distributed.max_one(len(parts)) - len(parts))


@torch.no_grad()
def anchor_pass(
    cfg: Config, anchor: Anchor | AdapterAnchor, batch: Rollout, old: OldPolicy, vocab: int
) -> AnchorView:
    tokens = batch.responses.unsqueeze(-1)
    head_ids = _head_ids(cfg, old, vocab)
    width = batch.response_mask.shape[1]
    n, k = len(batch.texts), cfg.kl.k if head_ids is None else head_ids.shape[-1]
    device = batch.sequences.device
    view = AnchorView(
        torch.zeros(n, width, k, dtype=torch.long, device=device), torch.zeros(n, width, device=device),
        torch.zeros(n, width, k, device=device),
    )  # fmt: skip
    with anchor.active() as ref_model:  # LoRA: the anchor adapter (or none) is active meanwhile
        for rows in micro_batches(cfg, batch, torch.arange(n)):
            idx = torch.arange(1) if rows is None else rows  # None: a padding pass, its result dropped
            part = batch.select(idx).trimmed()
            w = part.response_mask.shape[1]
            if head_ids is None:  # forward top-k: q is the anchor's own top-k
                s = response_summary(
                    ref_model, part, tokens[idx, :w], temperature=cfg.rollout.temperature, topk_self=cfg.kl.k
                )
                ids, logp, head_logp = s.topk_ids, s.logp()[..., 0], s.topk_logp
            else:
                ids = head_ids[idx, :w]
                logp = response_summary(
                    ref_model,
                    part,
                    torch.cat([tokens[idx, :w], ids], -1),
                    temperature=cfg.rollout.temperature,
                ).logp()
                logp, head_logp = logp[..., 0], logp[..., 1:]
            if rows is not None:
                view.head_ids[rows, :w], view.ref_logp[rows, :w], view.ref_head_logp[rows, :w] = (
                    ids,
                    logp,
                    head_logp,
                )
    return view


def token_losses(
    cfg: Config, model, part: Rollout, advantages: Tensor, old: OldPolicy, ref: AnchorView | None
):
    """Per-token PPO-clip loss (times the rollout correction's weight), KL estimate (None
    without anchor), clip flags and log PPO ratio (no gradient) of a micro-batch. The PPO ratio divides by pi_old; the KL's
    importance weight by mu, the distribution the token was drawn from (docs/design.md, section 7)."""
    tokens = part.responses.unsqueeze(-1)
    ids = tokens if ref is None else torch.cat([tokens, ref.head_ids], -1)
    summary = response_summary(model, part, ids, temperature=cfg.rollout.temperature)
    logp = summary.logp()[..., 0]
    pg, clipped = ppo_clip(logp, old.logp, advantages, cfg.algo.clip_low, cfg.algo.clip_high)
    pg = pg * old.weight
    log_ratio = (logp - old.logp).detach()
    if ref is None:
        return pg, None, clipped, log_ratio
    kl_tok = kl.from_summary(
        summary,
        (ref.head_ids == tokens).any(-1),
        ref.ref_logp,
        ref.ref_head_logp,
        estimator=cfg.kl.estimator,
        direction=cfg.kl.direction,
        sampling_logp=part.sampling_logp if cfg.kl.importance_weight else None,
        iw_clip=tuple(cfg.kl.iw_clip) if cfg.kl.iw_clip else None,
    )
    return pg, kl_tok, clipped, log_ratio


@dataclass
class TrainerState:
    """The loop's counters and figures, saved with every checkpoint (state.json "trainer")."""

    optimizer_steps: int = 0
    skipped_steps: int = 0  # optimiser steps skipped for a non-finite loss or gradient
    bad_in_row: int = 0  # the current run of skipped steps
    accuracy_before: float | None = None
    accuracy: float | None = None

    @classmethod
    def from_dict(cls, saved: dict) -> TrainerState:
        """From a checkpoint's dict; older checkpoints may lack the newer counters."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


class PhaseTimer:
    """Wall seconds per phase of a step; a phase timed inside another counts only as itself."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._inner = [0.0]  # per open phase: seconds spent in phases nested inside it

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.seconds[phase] = self.seconds.get(phase, 0.0) + took - self._inner.pop()
            self._inner[-1] += took


def update(
    run: Run, batch: Rollout, advantages: Tensor, old: OldPolicy, ref: AnchorView | None, timer: PhaseTimer
) -> dict:
    """PPO epochs over minibatches, micro-batched; an EMA counting optimiser steps steps here.

    With several processes `batch` is this rank's slice of the global batch: the permutation is
    drawn over the global batch (the same random stream as one process), each rank takes its
    rows, and the loss is divided by the global total, so the summed gradients are one process's.
    """
    cfg, model, state = run.cfg, run.model, run.state
    sums = {"loss/policy": 0.0, "kl/value": 0.0, "clip_frac": 0.0}
    count, grad_norms = 0.0, []
    # The first minibatch is on-policy for pi_old: recomputed, its ratio is 1 and nothing clips.
    first_clipped = first_count = first_ratio_dev = 0.0
    local = len(batch.texts)
    first = distributed.rank() * local
    # Responses cut at the length limit can be left out of the loss (DAPO's overlong masking).
    loss_mask = (
        batch.response_mask & ~batch.truncated.unsqueeze(-1)
        if cfg.algo.mask_overlong
        else batch.response_mask
    ) & old.keep  # the rollout correction's dropped tokens leave the loss and its count
    for epoch in range(cfg.algo.epochs):
        for minibatch, rows_mb in enumerate(
            torch.randperm(local * distributed.world()).chunk(cfg.algo.minibatches)
        ):
            rows_mb = rows_mb[(rows_mb >= first) & (rows_mb < first + local)] - first
            total = aggregation_total(
                loss_mask[rows_mb], cfg.algo.loss_aggregation, reduce=distributed.sum_one,
                length=cfg.rollout.max_new_tokens,
            )  # fmt: skip
            run.optimizer.zero_grad(set_to_none=True)
            minibatch_loss = 0.0
            for rows in micro_batches(cfg, batch, rows_mb):
                weight = 0.0 if rows is None else 1.0  # a padding pass: the collectives, no gradient
                rows = torch.arange(1) if rows is None else rows
                part = batch.select(rows).trimmed()
                w = part.response_mask.shape[1]
                mask = loss_mask[rows, :w]
                part_ref = None if ref is None else ref.select(rows, w)
                pg, kl_tok, clipped, log_ratio = token_losses(
                    cfg, model, part, advantages[rows], old.select(rows, w), part_ref
                )
                loss_tok = pg if kl_tok is None else pg + cfg.kl.beta * kl_tok
                loss = weight * aggregate(loss_tok, mask, cfg.algo.loss_aggregation, total)
                loss.backward()
                minibatch_loss += float(loss.detach())
                mask = mask & (weight > 0)
                sums["loss/policy"] += float((pg.detach() * mask).sum())
                sums["kl/value"] += 0.0 if kl_tok is None else float((kl_tok.detach() * mask).sum())
                sums["clip_frac"] += float((clipped & mask).sum())
                count += float(mask.sum())
                if epoch == 0 and minibatch == 0:
                    first_clipped += float((clipped & mask).sum())
                    dev = torch.where(mask, (log_ratio.exp() - 1).abs(), 0.0)
                    first_ratio_dev = max(first_ratio_dev, float(dev.max()))
                    first_count += float(mask.sum())
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else math.inf
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # global over shards
            grad_norm = float(distributed.full(norm))
            minibatch_loss = distributed.sum_one(minibatch_loss)  # every rank decides alike
            if not step_is_finite(state, minibatch_loss, grad_norm, cfg.train.max_bad_steps):
                continue  # weights, optimiser moments, scheduler and anchor stay as they were
            grad_norms.append(grad_norm)
            run.optimizer.step()
            run.scheduler.step()
            state.optimizer_steps += 1
            if run.anchor is not None and cfg.anchor.period_unit == "optimizer_steps":
                with timer("ema"):
                    run.anchor.step(model, state.optimizer_steps)
    *totals, count, first_clipped, first_count = distributed.sum_all(
        *sums.values(), count, first_clipped, first_count
    )
    stats = {k: v / max(count, 1.0) for k, v in zip(sums, totals, strict=True)}
    stats["clip_frac/first_minibatch"] = first_clipped / max(first_count, 1.0)
    stats["ppo_ratio/first_minibatch_max_dev"] = distributed.max_one(first_ratio_dev)  # max |ratio - 1|
    stats["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
    return stats


# ---------------------------------------------------------------------------------------------
# Data and evaluation


class PromptSampler:
    """Shuffled passes over the training examples; its position is part of a checkpoint."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise EmapgError("the task has no training examples")
        self.examples, self.seed = examples, seed
        self.epoch, self.position = 0, 0

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            order = torch.randperm(
                len(self.examples), generator=torch.Generator().manual_seed(self.seed + self.epoch)
            )
            take = order[self.position : self.position + n - len(out)].tolist()
            out += [self.examples[i] for i in take]
            self.position += len(take)
            if self.position == len(self.examples):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def reward_part_metrics(task: Task, scored, prefix: str = "", real: int | None = None) -> dict:
    """reward/<name>/mean of each part the task's rewards carry (e.g. one per reward function):
    the mean over the responses where that part has a value (NaN where none has)."""
    names = tuple(task.reward_parts)
    if not names:
        return {}
    kept = Scored(scored.rewards[:real], parts=scored.parts[:real])
    sums = distributed.sum_all(*(x for pair in kept.part_sums(names) for x in pair))
    return {
        f"{prefix}reward/{name}/mean": sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else math.nan
        for i, name in enumerate(names)
    }


def task_metrics(task: Task, texts: list[str], examples: list[Example], prefix: str = "") -> dict:
    """Figures a task reports beside the reward (e.g. search/calls_mean): means over the
    responses, so the global figure weighs each rank's by its number of responses. A figure
    only some ranks have (their data has its kind) is the mean over those ranks."""
    found = task.metrics(texts, examples)
    keys, n = distributed.union(found), len(texts)
    totals = distributed.sum_all(*(found.get(k, 0.0) * n for k in keys), *(n * (k in found) for k in keys))
    return {
        prefix + k: s / w for k, s, w in zip(keys, totals[: len(keys)], totals[len(keys) :], strict=True) if w
    }


def rollout_params(cfg: Config, topk: int) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(r.max_new_tokens, r.temperature, r.top_p, topk=topk, stop=tuple(r.stop))


def eval_params(cfg: Config) -> SamplingParams:
    """Evaluation's own sampling (the paper validates at other settings than it trains), with
    its own seed, so evaluating never touches the training run's random stream."""
    e = cfg.eval
    return SamplingParams(
        cfg.rollout.max_new_tokens, e.temperature, e.top_p, greedy=e.greedy, stop=tuple(cfg.rollout.stop),
        seed=cfg.train.seed + 1,
    )  # fmt: skip


SAMPLES_PER_EVAL = 4  # responses written to samples.jsonl at each evaluation


def evaluate(run: Run, step: int) -> tuple[float, dict]:
    """Held-out accuracy: mean reward over `eval.samples` responses per problem (pass@1), or
    of one greedy response, and the task's eval/ metrics (sampling: `eval_params`). Rewards go
    through the same guarded scorer as training. With several processes each rank samples its slice (the
    last one padded with repeats, so all run the same forwards) and the figures are reduced
    over the real rows. A few responses go to samples.jsonl."""
    cfg = run.cfg
    n = 1 if cfg.eval.greedy else cfg.eval.samples
    examples = [e for e in run.eval_examples for _ in range(n)]
    per = -(-len(examples) // distributed.world())
    first = distributed.rank() * per
    real = max(0, min(per, len(examples) - first))  # rows of this slice that are not padding
    mine = (examples + examples[-1:] * (per * distributed.world() - len(examples)))[first : first + per]
    run.engine.sync_weights(run.model, run.state.optimizer_steps)
    batch, scored = sample_and_score(
        run.engine, run.tokenizer, run.task, mine, run.scorer,
        eval_params(cfg), chat_template=cfg.model.chat_template,
        eos=run.eos, rows=list(range(first, first + per)),
    )  # fmt: skip
    texts, rewards, mine = batch.texts[:real], scored.rewards[:real], mine[:real]
    if run.log:
        run.log.log_samples(step, [
            {"prompt": e.prompt, "response": t, "reward": r, "answer": e.answer}
            for e, t, r in list(zip(mine, texts, rewards, strict=True))[:: max(1, n)][:SAMPLES_PER_EVAL]
        ])  # fmt: skip
    correct, total = distributed.sum_all(sum(rewards), real)
    parts = reward_part_metrics(run.task, scored, "eval/", real)
    return correct / total, {**parts, **task_metrics(run.task, texts, mine, "eval/")}


# ---------------------------------------------------------------------------------------------
# Set-up


def load_policy(cfg: Config, task: Task, progress: bool):
    """The policy model and tokenizer, and the directory they load from (builtin:tiny: the
    cached warm start, built first when missing)."""
    dtype = getattr(torch, cfg.model.dtype)
    path = cfg.model.path
    if path == "builtin:tiny":
        from emapg.sft import warm_start

        task = task.warm_start_task()
        w = cfg.warmstart
        sft_kwargs = {"steps": w.steps, "batch_size": w.batch_size, "lr": w.lr, "seed": cfg.train.seed}
        with distributed.main_first():  # rank 0 builds the cached warm start, the others load it
            path = warm_start(
                Path(w.cache_dir).expanduser(),
                task=task,
                sft_kwargs=sft_kwargs,
                model_kwargs=w.model_kwargs,
                tokenizer_kwargs={"extra_chars": task.tiny_extra_chars},
                target_accuracy=w.target_accuracy or None,
                progress=progress and distributed.is_main(),
            )
    return (*load_model_and_tokenizer(path, dtype=dtype), str(path))


def check_context(cfg: Config, model, tokenizer, examples: list[Example], task: Task | None = None) -> None:
    """Stop before training when a response could outrun the model's context: the longest prompt
    plus a full response (multi-turn: one full turn) must fit, and a multi-turn environment's
    `max_context` cap, which bounds whole episodes, must not exceed the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not limit or not examples:
        return
    cap, name = limit, f"the model's context of {limit}"
    env = task.environment() if task is not None else None
    if getattr(env, "max_context", None) is not None:
        if env.max_context > limit:
            raise EmapgError(
                f"the episode cap max_context={env.max_context} (retriever.max_context for search) "
                f"exceeds the model's context of {limit}"
            )
        cap, name = env.max_context, f"the episode cap max_context={env.max_context}"
    lengths = [
        len(ids) for ids in encode_prompts(tokenizer, [e.prompt for e in examples], cfg.model.chat_template)
    ]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + cfg.rollout.max_new_tokens > cap:
        raise EmapgError(
            f"prompt {examples[longest].prompt[:40]!r}... is {lengths[longest]} tokens; with "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} it exceeds {name}"
        )


def _device(cfg: Config) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise EmapgError("train.device=cuda but no CUDA device is available")
    return torch.device(cfg.train.device)


def make_engine(cfg: Config, model, tokenizer, model_dir: str) -> RolloutEngine:
    """The rollout engine `rollout.engine` names, sampling from `model`."""
    if cfg.rollout.engine == "vllm":
        from emapg.rollout.vllm import VllmEngine  # late: only this engine imports vllm

        r = cfg.rollout
        return VllmEngine(
            model_dir, tokenizer, dtype=rollout_dtype(cfg), seed=cfg.train.seed, max_logprobs=max(cfg.kl.k, 1),
            gpu_memory_utilization=r.vllm_gpu_memory_utilization, enforce_eager=r.vllm_enforce_eager,
            max_model_len=r.vllm_max_model_len or None, sleep=r.vllm_sleep, eos_ids=eos_ids(model, tokenizer),
        )  # fmt: skip
    from emapg.rollout.hf import HFEngine

    return HFEngine(model, tokenizer, batch_size=cfg.rollout.batch_size)


CHECKPOINT_FORMAT = 2  # 2: trainer state as TrainerState; 1 (no "format" key): the same fields


@dataclass
class Run:
    """Everything the loop runs on, built once by `setup`."""

    cfg: Config
    task: Task
    train_examples: list[Example]
    eval_examples: list[Example]
    model: nn.Module
    tokenizer: object
    eos: list[int]
    vocab: int
    engine: RolloutEngine
    scorer: RewardScorer
    anchor: Anchor | AdapterAnchor | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    run_dir: Path
    log: MetricsLog | None  # rank 0 alone writes the run's files
    start: int = 0  # the step a resumed run continues after
    state: TrainerState = field(default_factory=TrainerState)

    def save(self, step: int) -> None:
        extra = {
            "format": CHECKPOINT_FORMAT,
            "trainer": asdict(self.state),
            "sampler": self.sampler.state(),
            "anchor": self.anchor.state_dict() if self.anchor else None,
        }
        checkpoint.save(
            self.run_dir / "checkpoints", step, policy=self.model, tokenizer=self.tokenizer, anchor=self.anchor,
            optimizer=self.optimizer, scheduler=self.scheduler, state=extra, keep=self.cfg.train.keep_checkpoints,
        )  # fmt: skip

    def resume(self, path: Path) -> None:
        saved = checkpoint.load(
            path, policy=self.model, anchor=self.anchor, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if saved.get("format", 1) not in (1, CHECKPOINT_FORMAT):
            raise EmapgError(
                f"checkpoint {path} has format {saved['format']}; this emapg resumes formats 1 to {CHECKPOINT_FORMAT}"
            )
        self.start, self.state = saved["step"], TrainerState.from_dict(saved["trainer"])
        self.sampler.load(saved["sampler"])
        if self.anchor is not None:
            self.anchor.load_state_dict(saved["anchor"])

    def close(self) -> None:
        if self.log:
            self.log.close()
        self.scorer.close()
        self.engine.close()


def make_anchor(cfg: Config, model: nn.Module) -> Anchor | AdapterAnchor | None:
    """No anchor model at all without a KL; an EMA with eta = 1 is the frozen reference. With
    LoRA the anchor is an adapter of the policy's own model (or its base): no copy of the base."""
    if cfg.anchor.kind == "none":
        return None
    eta = 1.0 if cfg.anchor.kind == "frozen" else cfg.anchor.eta
    if cfg.lora.r:
        return AdapterAnchor(model, eta, cfg.anchor.update_period)
    anchor = Anchor(model, eta, cfg.anchor.update_period, dtype=getattr(torch, anchor_dtype(cfg)))
    distributed.shard(anchor.model)
    return anchor


def setup(cfg: Config, resume: bool, device: torch.device) -> Run:
    """Task, policy, engine, anchor, optimiser, data and log, restored from the last
    checkpoint when resuming. Every check that can fail runs before any training."""
    validate_world(cfg, distributed.world())
    hf_logging.disable_progress_bar()  # per-save "Writing model shards" bars would bury ours
    run_dir = Path(cfg.train.output_dir) / cfg.train.name
    ckpt_dir = run_dir / "checkpoints"
    if distributed.is_main():
        checkpoint.remove_partial(ckpt_dir)
    distributed.barrier()
    last = checkpoint.list_checkpoints(ckpt_dir)[-1:] if resume else []
    if resume and not last:
        raise EmapgError(f"--resume: no complete checkpoint under {ckpt_dir}")
    if cfg.lora.r:
        lora.require_peft(cfg.lora.r)  # before the warm start
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)

    with distributed.main_first():  # rank 0 writes what a task caches (a corpus, its index) first
        task = make_task(cfg)
    train_examples, eval_examples = task.train_examples(), task.eval_examples()
    if not eval_examples:
        raise EmapgError(f"task {task.name!r} has no evaluation examples")
    scorer = RewardScorer(task, timeout_s=cfg.task.reward_timeout_s, isolation=cfg.task.reward_isolation)
    model, tokenizer, model_dir = load_policy(cfg, task, cfg.train.progress and distributed.is_main())
    check_context(cfg, model, tokenizer, train_examples + eval_examples, task)
    engine = make_engine(cfg, model, tokenizer, model_dir)  # a missing vLLM stops here, before training
    if cfg.lora.r:  # the base is frozen; the engine's model carries the adapters from here on
        model = lora.wrap(model, cfg.lora)
    model.to(device).train()
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    anchor = make_anchor(cfg, model)
    distributed.shard(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA: the policy adapter alone
        lr=cfg.lora.lr if cfg.lora.r else cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
    )
    optimizer_steps = cfg.train.steps * cfg.algo.epochs * cfg.algo.minibatches
    warmup = max(
        round(cfg.optim.warmup_ratio * optimizer_steps) if cfg.optim.warmup_ratio else cfg.optim.warmup_steps,
        1,
    )
    run = Run(
        cfg=cfg, task=task, train_examples=train_examples, eval_examples=eval_examples, model=model,
        tokenizer=tokenizer, eos=eos_ids(model, tokenizer), vocab=model.get_output_embeddings().weight.shape[0],
        engine=engine, scorer=scorer, anchor=anchor, optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)),
        sampler=PromptSampler(train_examples, cfg.train.seed), run_dir=run_dir, log=None,
    )  # fmt: skip
    if last:
        run.resume(last[0])
    if distributed.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        run.log = MetricsLog(
            run_dir, resume_step=run.start if last else None, tensorboard=cfg.train.tensorboard,
            wandb=cfg.train.wandb, config=to_dict(cfg),
        )  # fmt: skip
    return run


# ---------------------------------------------------------------------------------------------
# The loop


def train(cfg: Config, *, resume: bool = False) -> dict:
    """Run (or resume) training; returns the final record with accuracy before and after.

    Under torchrun (WORLD_SIZE > 1) every rank runs this loop on its slice of each batch, with
    policy and anchor sharded by FSDP2; rank 0 alone logs and writes the run's files."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = distributed.init(_device(cfg))
    try:
        run = setup(cfg, resume, device)
        try:
            return train_loop(run)
        finally:
            run.close()
    finally:
        distributed.close()


def train_loop(run: Run) -> dict:
    cfg, state, model = run.cfg, run.state, run.model
    if run.start == 0:
        state.accuracy_before, eval_metrics = evaluate(run, 0)
        state.accuracy = state.accuracy_before
        if run.log:
            run.log.log({"step": 0, "eval/accuracy": state.accuracy, **eval_metrics})
    reverse_topk = cfg.kl.estimator in kl.TOPK and cfg.kl.direction == "reverse" and run.anchor is not None
    params = rollout_params(cfg, topk=min(cfg.kl.k, run.vocab) if reverse_topk else 0)
    bar = tqdm(
        range(run.start + 1, cfg.train.steps + 1), desc=cfg.train.name, initial=run.start,
        total=cfg.train.steps, disable=not (cfg.train.progress and distributed.is_main()),
    )  # fmt: skip
    for step in bar:
        timer = PhaseTimer()
        with timer("rollout"):
            examples = [
                e
                for e in run.sampler.take(cfg.rollout.prompts_per_step)
                for _ in range(cfg.rollout.group_size)
            ]
            rows = distributed.shard_rows(len(examples))  # whole groups: prompts_per_step % world == 0
            examples = examples[rows]
            run.engine.sync_weights(model, state.optimizer_steps)
            batch = sample_examples(
                run.engine, run.tokenizer, run.task, examples, params, chat_template=cfg.model.chat_template,
                eos=run.eos, rows=range(rows.start, rows.stop),
            ).to(next(model.parameters()).device)  # fmt: skip
            run.engine.sleep()  # a colocated engine frees its memory for the passes below

        with timer("scoring"):
            scored = run.scorer(batch.texts, examples)
            rewards = torch.tensor(scored.rewards)
            advantages = group_advantages(rewards, cfg.rollout.group_size, cfg.algo.advantage).to(
                rewards.device
            )

        old, correction_metrics = old_policy(
            cfg, model, batch, params.topk, timer
        )  # its own phase when recomputed

        with timer("anchor"):
            ref = anchor_pass(cfg, run.anchor, batch, old, run.vocab) if run.anchor is not None else None

        with timer("update"):
            stats = update(run, batch, advantages.to(batch.sequences.device), old, ref, timer)
        if run.anchor is not None and cfg.anchor.period_unit == "training_steps":
            with timer("ema"):
                run.anchor.step(model, step)

        mask = batch.response_mask
        reward_sum, errors, timeouts, entropy_sum, tokens, n = distributed.sum_all(
            float(rewards.sum()), scored.errors, scored.timeouts, float((batch.entropy * mask).sum()),
            float(mask.sum()), len(examples),
        )  # fmt: skip
        record = {
            "step": step,
            "reward/mean": reward_sum / n,
            "reward/errors": int(errors),
            "reward/timeouts": int(timeouts),
            **reward_part_metrics(run.task, scored),
            "train/skipped_steps": state.skipped_steps,
            **stats,
            **correction_metrics,
            "entropy": entropy_sum / max(tokens, 1.0),
            "response_length/mean": tokens / n,
            **task_metrics(run.task, batch.texts, examples),
            "anchor/updates": run.anchor.updates if run.anchor else 0,
            "lr": run.scheduler.get_last_lr()[0],
            **{f"time/{k}_s": v for k, v in timer.seconds.items()},
            "time/step_s": sum(timer.seconds.values()),
        }
        if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
            state.accuracy, eval_metrics = evaluate(run, step)
            record.update({"eval/accuracy": state.accuracy, **eval_metrics})
        if run.log:
            run.log.log(record)
        bar.set_postfix(
            reward=f"{record['reward/mean']:.3f}", kl=f"{record['kl/value']:.2e}", acc=f"{state.accuracy:.3f}"
        )
        if step % cfg.train.save_every == 0 or step == cfg.train.steps:
            run.save(step)
    return {
        "run_dir": str(run.run_dir),
        "accuracy_before": state.accuracy_before,
        "accuracy_after": state.accuracy,
        "reward_range": tuple(run.task.reward_range),  # eval/accuracy is a mean reward in it
    }
