"""The EMA-PG training loop: rollout, reward, advantages, anchor pass, PPO update, EMA step.

Read top to bottom: `train` is the whole loop; the helpers above it are the passes. The
algorithms themselves are pure functions in kl.py, topk.py, advantages.py, policy_loss.py
and anchor.py. Memory: between passes only per-token summaries travel (the sampled token's
log-prob, k top-k ids, k anchor log-probs); no [tokens, vocab] tensor is ever stored.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import Tensor
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from emapg import checkpoint, distributed, kl
from emapg.advantages import group_advantages
from emapg.anchor import Anchor
from emapg.config import Config, to_dict, validate_world
from emapg.errors import EmapgError
from emapg.guards import step_is_finite
from emapg.lm_head import response_summary
from emapg.metrics import MetricsLog
from emapg.models import load_model_and_tokenizer
from emapg.policy_loss import aggregate, aggregation_total, ppo_clip
from emapg.rewards import RewardScorer
from emapg.rollout import Rollout, format_prompts
from emapg.rollout.hf import generate
from emapg.tasks.base import Example, Task

# ---------------------------------------------------------------------------------------------
# Model passes


@dataclass
class AnchorView:
    """What the anchor pass leaves for the update: log-probs at the token and on the top-k set q."""

    head_ids: Tensor  # [N, L, k] the set q
    ref_logp: Tensor  # [N, L]
    ref_head_logp: Tensor  # [N, L, k]


def _slice(batch: Rollout, rows: Tensor) -> Rollout:
    return Rollout(
        sequences=batch.sequences[rows],
        attention_mask=batch.attention_mask[rows],
        prompt_len=batch.prompt_len,
        response_mask=batch.response_mask[rows],
        sampling_logp=batch.sampling_logp[rows],
        topk_ids=batch.topk_ids[rows],
        entropy=batch.entropy[rows],
        texts=[batch.texts[i] for i in rows.tolist()],
    )


def _head_ids(cfg: Config, batch: Rollout, vocab: int) -> Tensor | None:
    """q for the KL: sampling top-k (reverse), the whole vocabulary (exact), none (sampled)."""
    if cfg.kl.estimator == "exact":
        return torch.arange(vocab, device=batch.sequences.device).expand(*batch.response_mask.shape, vocab)
    if cfg.kl.estimator in kl.TOPK and cfg.kl.direction == "reverse":
        return batch.topk_ids
    if cfg.kl.estimator in kl.TOPK:
        return None  # forward: the anchor pass picks q from its own top-k
    return batch.topk_ids[..., :0]


@torch.no_grad()
def anchor_pass(cfg: Config, anchor: Anchor, batch: Rollout, vocab: int) -> AnchorView:
    tokens = batch.responses.unsqueeze(-1)
    head_ids = _head_ids(cfg, batch, vocab)
    views = []
    for rows in torch.arange(len(batch.texts)).split(cfg.algo.micro_batch_size):
        part = _slice(batch, rows)
        if head_ids is None:  # forward top-k: q is the anchor's own top-k
            s = response_summary(
                anchor.model, part, tokens[rows], temperature=cfg.rollout.temperature, topk_self=cfg.kl.k
            )
            views.append((s.topk_ids, s.logp()[..., 0], s.topk_logp))
        else:
            ids = torch.cat([tokens[rows], head_ids[rows]], -1)
            logp = response_summary(anchor.model, part, ids, temperature=cfg.rollout.temperature).logp()
            views.append((head_ids[rows], logp[..., 0], logp[..., 1:]))
    return AnchorView(*(torch.cat(v) for v in zip(*views, strict=True)))


def token_losses(cfg: Config, model, part: Rollout, advantages: Tensor, ref: AnchorView | None):
    """Per-token PPO-clip loss, KL estimate (None without anchor) and clip flags of a micro-batch."""
    tokens = part.responses.unsqueeze(-1)
    ids = tokens if ref is None else torch.cat([tokens, ref.head_ids], -1)
    summary = response_summary(model, part, ids, temperature=cfg.rollout.temperature)
    logp = summary.logp()[..., 0]
    pg, clipped = ppo_clip(logp, part.sampling_logp, advantages, cfg.algo.clip_low, cfg.algo.clip_high)
    if ref is None:
        return pg, None, clipped
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
    return pg, kl_tok, clipped


def update(
    cfg: Config, model, optimizer, scheduler, anchor: Anchor | None, batch: Rollout, advantages, ref, state
):
    """PPO epochs over minibatches, micro-batched; the EMA anchor steps after optimiser steps.

    With several processes `batch` is this rank's slice of the global batch: the permutation is
    drawn over the global batch (the same random stream as one process), each rank takes its
    rows, and the loss is divided by the global total, so the summed gradients are one process's.
    """
    sums = {"loss/policy": 0.0, "kl/value": 0.0, "clip_frac": 0.0}
    count, grad_norms, ema_seconds = 0.0, [], 0.0
    local = len(batch.texts)
    first = distributed.rank() * local
    for _ in range(cfg.algo.epochs):
        for rows_mb in torch.randperm(local * distributed.world()).chunk(cfg.algo.minibatches):
            rows_mb = rows_mb[(rows_mb >= first) & (rows_mb < first + local)] - first
            mask_mb = batch.response_mask[rows_mb]
            total = aggregation_total(mask_mb, cfg.algo.loss_aggregation, reduce=distributed.sum_one)
            optimizer.zero_grad(set_to_none=True)
            minibatch_loss = 0.0
            for rows in rows_mb.split(cfg.algo.micro_batch_size):
                mask = batch.response_mask[rows]
                ref_part = None if ref is None else AnchorView(*(t[rows] for t in vars(ref).values()))
                pg, kl_tok, clipped = token_losses(
                    cfg, model, _slice(batch, rows), advantages[rows], ref_part
                )
                loss_tok = pg if kl_tok is None else pg + cfg.kl.beta * kl_tok
                loss = aggregate(loss_tok, mask, cfg.algo.loss_aggregation, total)
                loss.backward()
                minibatch_loss += float(loss.detach())
                sums["loss/policy"] += float((pg.detach() * mask).sum())
                sums["kl/value"] += 0.0 if kl_tok is None else float((kl_tok.detach() * mask).sum())
                sums["clip_frac"] += float((clipped & mask).sum())
                count += float(mask.sum())
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else math.inf
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # global over shards
            grad_norm = float(distributed.full(norm))
            minibatch_loss = distributed.sum_one(minibatch_loss)  # every rank decides alike
            if not step_is_finite(state, minibatch_loss, grad_norm, cfg.train.max_bad_steps):
                continue  # weights, optimiser moments, scheduler and anchor stay as they were
            grad_norms.append(grad_norm)
            optimizer.step()
            scheduler.step()
            state["optimizer_steps"] += 1
            if anchor is not None:
                t = time.perf_counter()
                anchor.step(model, state["optimizer_steps"])
                ema_seconds += time.perf_counter() - t
    *totals, count = distributed.sum_all(*sums.values(), count)
    stats = {k: v / max(count, 1.0) for k, v in zip(sums, totals, strict=True)}
    stats["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
    return stats, ema_seconds


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


def rollout_engine(task: Task, cfg: Config):
    """The task's own rollout function when it has one (multi-turn search), else rollout.engine."""
    if hasattr(task, "generate"):
        return task.generate
    if cfg.rollout.engine == "vllm":
        from emapg.rollout.vllm import engine_for  # late: only this engine imports vllm

        return engine_for(cfg)
    return generate


def task_metrics(task: Task, texts: list[str], examples: list[Example], prefix: str = "") -> dict:
    """Figures a task reports beside the reward (e.g. search/calls_mean), when it has any: means
    over the responses, so the global figure weighs each rank's by its number of responses."""
    found = task.metrics(texts, examples) if hasattr(task, "metrics") else {}
    *sums, n = distributed.sum_all(*(v * len(texts) for v in found.values()), len(texts))
    return {prefix + k: v / n for k, v in zip(found, sums, strict=True)}


def evaluate(
    cfg: Config, model, tokenizer, task: Task, examples: list[Example], scorer: RewardScorer
) -> tuple[float, dict]:
    """Held-out accuracy: mean reward over `eval.samples` responses per problem (pass@1), or
    of one greedy response, and the task's eval/ metrics. Sampling draws from a private
    generator, so evaluating never changes the training run's random stream. Rewards go
    through the same guarded `scorer` as training, so a hostile reward cannot crash it.
    With several processes each rank samples its slice (the last one padded with repeats, so
    all run the same forwards) and the figures are reduced over the real rows."""
    n = 1 if cfg.eval.greedy else cfg.eval.samples
    examples = [e for e in examples for _ in range(n)]
    per = -(-len(examples) // distributed.world())
    first = distributed.rank() * per
    real = max(0, min(per, len(examples) - first))  # rows of this slice that are not padding
    mine = (examples + examples[-1:] * (per * distributed.world() - len(examples)))[first : first + per]
    prompts, special = format_prompts(tokenizer, [e.prompt for e in mine], cfg.model.chat_template)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.train.seed + 1)
        out = rollout_engine(task, cfg)(
            model,
            tokenizer,
            prompts,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            greedy=cfg.eval.greedy,
            stop=cfg.rollout.stop,
            batch_size=cfg.eval.batch_size,
            add_special_tokens=special,
            first_row=first,
        )
    texts, mine = out.texts[:real], mine[:real]
    correct, total = distributed.sum_all(sum(scorer(texts, mine).rewards), real)
    return correct / total, task_metrics(task, texts, mine, "eval/")


# ---------------------------------------------------------------------------------------------
# Set-up


def make_task(cfg: Config) -> Task:
    from emapg.tasks.arithmetic import ArithmeticTask

    t = cfg.task
    if t.name == "search":
        from emapg.tasks import search

        return search.from_config(cfg)
    if t.name == "math":
        from emapg.tasks import math as math_task  # not the stdlib math this module uses

        return math_task.from_config(cfg)
    return ArithmeticTask(
        seed=t.seed,
        num_train=t.num_train,
        num_eval=t.num_eval,
        min_digits=t.min_digits,
        max_digits=t.max_digits,
    )


def load_policy(cfg: Config, task: Task, progress: bool):
    dtype = getattr(torch, cfg.model.dtype)
    path = cfg.model.path
    if path == "builtin:tiny":
        from emapg.sft import warm_start

        w = cfg.warmstart
        sft_kwargs = {"steps": w.steps, "batch_size": w.batch_size, "lr": w.lr, "seed": cfg.train.seed}
        with distributed.main_first():  # rank 0 builds the cached warm start, the others load it
            path = warm_start(
                Path(w.cache_dir).expanduser(),
                task=task,
                sft_kwargs=sft_kwargs,
                model_kwargs=w.model_kwargs,
                tokenizer_kwargs={"extra_chars": getattr(task, "tiny_extra_chars", "")},
                target_accuracy=w.target_accuracy or None,
                progress=progress and distributed.is_main(),
            )
    return load_model_and_tokenizer(path, dtype=dtype)


def check_context(cfg: Config, model, tokenizer, examples: list[Example]) -> None:
    """Stop before training when the longest prompt plus a full response exceeds the context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not limit or not examples:
        return
    prompts, special = format_prompts(tokenizer, [e.prompt for e in examples], cfg.model.chat_template)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=special)["input_ids"]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + cfg.rollout.max_new_tokens > limit:
        raise EmapgError(
            f"prompt {examples[longest].prompt[:40]!r}... is {lengths[longest]} tokens; with "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} it exceeds the model's context of {limit}"
        )


def _device(cfg: Config) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise EmapgError("train.device=cuda but no CUDA device is available")
    return torch.device(cfg.train.device)


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
        return _train(cfg, resume, device)
    finally:
        distributed.close()


def _train(cfg: Config, resume: bool, device: torch.device) -> dict:
    validate_world(cfg, distributed.world())
    main = distributed.is_main()
    hf_logging.disable_progress_bar()  # per-save "Writing model shards" bars would bury ours
    run_dir = Path(cfg.train.output_dir) / cfg.train.name
    ckpt_dir = run_dir / "checkpoints"
    if main:
        checkpoint.remove_partial(ckpt_dir)
    distributed.barrier()
    last = checkpoint.list_checkpoints(ckpt_dir)[-1:] if resume else []
    if resume and not last:
        raise EmapgError(f"--resume: no complete checkpoint under {ckpt_dir}")
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    show = cfg.train.progress and main

    task = make_task(cfg)
    train_examples, eval_examples = task.train_examples(), task.eval_examples()
    if not eval_examples:
        raise EmapgError(f"task {task.name!r} has no evaluation examples")
    rollout_engine(task, cfg)  # builds a vLLM engine now: a missing vLLM or GPU stops before any work
    scorer = RewardScorer(task, timeout_s=cfg.task.reward_timeout_s, isolation=cfg.task.reward_isolation)
    model, tokenizer = load_policy(cfg, task, show)
    check_context(cfg, model, tokenizer, train_examples + eval_examples)
    model.to(device).train()
    # No anchor model at all without a KL; an EMA with eta = 1 is the frozen reference.
    anchor = None
    if cfg.anchor.kind != "none":
        eta = 1.0 if cfg.anchor.kind == "frozen" else cfg.anchor.eta
        anchor = Anchor(model, eta, cfg.anchor.update_period)
        distributed.shard(anchor.model)
    distributed.shard(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    warmup = max(cfg.optim.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    sampler = PromptSampler(train_examples, cfg.train.seed)
    state = {
        "optimizer_steps": 0,
        "skipped_steps": 0,
        "bad_in_row": 0,
        "accuracy_before": None,
        "accuracy": None,
    }
    start = 0
    if last:
        saved = checkpoint.load(
            last[0], policy=model, anchor=anchor, optimizer=optimizer, scheduler=scheduler
        )
        start, state = saved["step"], saved["trainer"]
        sampler.load(saved["sampler"])
        if anchor is not None:
            anchor.load_state_dict(saved["anchor"])
    log = None  # rank 0 writes the run's files
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        log = MetricsLog(
            run_dir,
            resume_step=start if last else None,
            tensorboard=cfg.train.tensorboard,
            wandb=cfg.train.wandb,
            config=to_dict(cfg),
        )
    vocab = model.get_output_embeddings().weight.shape[0]

    def save(step: int) -> None:
        extra = {
            "trainer": state,
            "sampler": sampler.state(),
            "anchor": anchor.state_dict() if anchor else None,
        }
        checkpoint.save(
            ckpt_dir, step, policy=model, tokenizer=tokenizer, anchor=anchor, optimizer=optimizer,
            scheduler=scheduler, state=extra, keep=cfg.train.keep_checkpoints,
        )  # fmt: skip

    if start == 0:
        state["accuracy_before"], eval_metrics = evaluate(cfg, model, tokenizer, task, eval_examples, scorer)
        state["accuracy"] = state["accuracy_before"]
        if log:
            log.log({"step": 0, "eval/accuracy": state["accuracy"], **eval_metrics})
    bar = tqdm(
        range(start + 1, cfg.train.steps + 1),
        desc=cfg.train.name,
        disable=not show,
        initial=start,
        total=cfg.train.steps,
    )
    for step in bar:
        times = {}
        t = time.perf_counter()
        examples = [
            e for e in sampler.take(cfg.rollout.prompts_per_step) for _ in range(cfg.rollout.group_size)
        ]
        rows = distributed.shard_rows(len(examples))  # whole groups: prompts_per_step % world == 0
        examples = examples[rows]
        prompts, special = format_prompts(tokenizer, [e.prompt for e in examples], cfg.model.chat_template)
        reverse_topk = cfg.kl.estimator in kl.TOPK and cfg.kl.direction == "reverse" and anchor is not None
        batch = rollout_engine(task, cfg)(
            model, tokenizer, prompts, max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, topk=min(cfg.kl.k, vocab) if reverse_topk else 0, stop=cfg.rollout.stop,
            batch_size=cfg.rollout.batch_size, add_special_tokens=special, first_row=rows.start,
        )  # fmt: skip
        times["rollout"], t = time.perf_counter() - t, time.perf_counter()

        scored = scorer(batch.texts, examples)
        rewards = torch.tensor(scored.rewards)
        advantages = group_advantages(rewards, cfg.rollout.group_size, cfg.algo.advantage).to(device)
        times["scoring"], t = time.perf_counter() - t, time.perf_counter()

        ref = anchor_pass(cfg, anchor, batch, vocab) if anchor is not None else None
        times["anchor"], t = time.perf_counter() - t, time.perf_counter()

        stats, times["ema"] = update(cfg, model, optimizer, scheduler, anchor, batch, advantages, ref, state)
        times["update"] = time.perf_counter() - t - times["ema"]

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
            "train/skipped_steps": state.get("skipped_steps", 0),  # absent in older checkpoints
            **stats,
            "entropy": entropy_sum / max(tokens, 1.0),
            "response_length/mean": tokens / n,
            **task_metrics(task, batch.texts, examples),
            "anchor/updates": anchor.updates if anchor else 0,
            "lr": scheduler.get_last_lr()[0],
            **{f"time/{k}_s": v for k, v in times.items()},
            "time/step_s": sum(times.values()),
        }
        if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
            state["accuracy"], eval_metrics = evaluate(cfg, model, tokenizer, task, eval_examples, scorer)
            record.update({"eval/accuracy": state["accuracy"], **eval_metrics})
        if log:
            log.log(record)
        bar.set_postfix(
            reward=f"{record['reward/mean']:.3f}",
            kl=f"{record['kl/value']:.2e}",
            acc=f"{state['accuracy']:.3f}",
        )
        if step % cfg.train.save_every == 0 or step == cfg.train.steps:
            save(step)
    if log:
        log.close()
    scorer.close()
    return {
        "run_dir": str(run_dir),
        "accuracy_before": state["accuracy_before"],
        "accuracy_after": state["accuracy"],
    }
