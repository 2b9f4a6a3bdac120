"""The PPO update of one rollout batch: the `algo` section, and the passes it runs.

Before the first optimiser step: pi_old (a no-grad pass of the policy, or the engine's
log-probs) with the rollout correction, then the anchor pass; then epochs of minibatches, each
micro-batched forward and backward through the clipped policy term and the KL estimate. Between
passes only per-token summaries travel (the sampled token's log-prob, k top-k ids, k anchor
log-probs); no [tokens, vocab] tensor is ever stored. docs/design.md, sections 4 and 7.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from emapg import distributed
from emapg.algo import kl, rollout_correction
from emapg.algo.guards import step_is_finite
from emapg.algo.policy_loss import (
    aggregate,
    aggregation_total,
    cispo,
    log_ratio,
    ppo_clip,
)
from emapg.batch import Rollout
from emapg.model.anchor import Anchor
from emapg.model.lm_head import response_summary
from emapg.model.lora import AdapterAnchor
from emapg.model.precision import autocast, outside_autocast
from emapg.training.config import Config
from emapg.training.metrics import PhaseTimer
from emapg.training.run import Run


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
def response_logp(
    cfg: Config, model, batch: Rollout, temperature: float, k: int = 0
) -> tuple[Tensor, Tensor]:
    """A no-grad pass of `model` over the batch at `temperature`, micro-batch by micro-batch: the
    log-prob of each sampled token [N, L] and the model's top-k ids there [N, L, k]. Before the
    first optimiser step, at the rollout's temperature, it is the trainer's own pi_old."""
    n, width = batch.response_mask.shape
    logp = torch.zeros(n, width, device=batch.sequences.device)
    topk_ids = torch.zeros(n, width, k, dtype=torch.long, device=batch.sequences.device)
    with autocast(cfg.train.precision, batch.sequences.device):
        for rows, part, w in each_micro_batch(cfg, batch):
            s = response_summary(
                model, part, part.responses.unsqueeze(-1), temperature=temperature, topk_self=k,
                share_prompts=cfg.algo.share_prompts,
            )  # fmt: skip
            if rows is not None:
                logp[rows, :w], topk_ids[rows, :w] = s.logp()[..., 0], s.topk_ids
    return logp, topk_ids


def old_policy(cfg: Config, model, batch: Rollout, k: int, timer: PhaseTimer) -> tuple[OldPolicy, dict]:
    """pi_old (recomputed, or the engine's log-probs: `Config.recomputes_old_logp`), the rollout
    correction, and their metrics: mismatch/* (only when recomputed: else mu is pi_old) and
    rollout_correction/*."""
    mask = batch.response_mask
    metrics = {}
    if cfg.recomputes_old_logp:
        with timer("old_logp"):
            logp, topk_ids = response_logp(cfg, model, batch, cfg.rollout.temperature, k)
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
    """q for the KL (kl.q_source): pi_old's top-k, the whole vocabulary, none (a sampled
    estimator), or None for the anchor pass to take the anchor's own top-k."""
    source = kl.q_source(cfg.kl.estimator, cfg.kl.direction)
    if source == "vocab":
        return torch.arange(vocab, device=old.logp.device).expand(*old.logp.shape, vocab)
    if source == "sampling":
        return old.topk_ids
    return None if source == "anchor" else old.topk_ids[..., :0]


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


def rows_run(rows: Tensor | None) -> Tensor:
    """The rows a micro-batch's pass runs on: a padding pass (None) runs on row 0."""
    return torch.arange(1) if rows is None else rows


def each_micro_batch(cfg: Config, batch: Rollout) -> Iterator[tuple[Tensor | None, Rollout, int]]:
    """(rows, the micro-batch trimmed of padding, its response width) for every micro-batch of
    the whole batch; rows None: a padding pass on one row (`micro_batches`), its result dropped."""
    for rows in micro_batches(cfg, batch, torch.arange(len(batch.texts))):
        part = batch.select(rows_run(rows)).trimmed()
        yield rows, part, part.response_mask.shape[1]


@torch.no_grad()
def anchor_pass(
    cfg, anchor: Anchor | AdapterAnchor, batch: Rollout, old: OldPolicy, vocab: int
) -> AnchorView:
    tokens = batch.responses.unsqueeze(-1)
    head_ids = _head_ids(cfg, old, vocab)
    width = batch.response_mask.shape[1]
    n, k = len(batch.texts), cfg.kl.k if head_ids is None else head_ids.shape[-1]
    device = batch.sequences.device
    view = AnchorView(
        torch.zeros(n, width, k, dtype=torch.long, device=device),
        torch.zeros(n, width, device=device),
        torch.zeros(n, width, k, device=device),
    )
    with anchor.active() as ref_model, autocast(cfg.train.precision, device):
        # LoRA: the anchor adapter (or none) is active meanwhile
        for rows, part, w in each_micro_batch(cfg, batch):
            idx = rows_run(rows)
            if head_ids is None:  # forward top-k: q is the anchor's own top-k
                s = response_summary(
                    ref_model, part, tokens[idx, :w], temperature=cfg.rollout.temperature, topk_self=cfg.kl.k,
                    share_prompts=cfg.algo.share_prompts,
                )  # fmt: skip
                ids, logp, head_logp = s.topk_ids, s.logp()[..., 0], s.topk_logp
            else:
                ids = head_ids[idx, :w]
                logp = response_summary(
                    ref_model,
                    part,
                    torch.cat([tokens[idx, :w], ids], -1),
                    temperature=cfg.rollout.temperature,
                    share_prompts=cfg.algo.share_prompts,
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
    """Per-token policy loss (`algo.loss`, times the rollout correction's weight), KL estimate
    (None without anchor), clip flags and log-ratio to pi_old (`algo.ratio_level`, no gradient) of
    a micro-batch. The ratio divides by pi_old; the KL's importance weight by mu, the
    distribution the token was drawn from (docs/design.md, section 7)."""
    tokens = part.responses.unsqueeze(-1)
    ids = tokens if ref is None else torch.cat([tokens, ref.head_ids], -1)
    summary = response_summary(
        model, part, ids, temperature=cfg.rollout.temperature, share_prompts=cfg.algo.share_prompts
    )
    logp = summary.logp()[..., 0]
    a = cfg.algo
    ratio = log_ratio(logp, old.logp, part.response_mask, a.ratio_level)
    if a.loss == "cispo":
        pg, clipped = cispo(ratio, logp, advantages, a.clip_low, a.clip_high)
    else:
        pg, clipped = ppo_clip(ratio, advantages, a.clip_low, a.clip_high, a.dual_clip)
    pg, ratio = pg * old.weight, ratio.detach()
    if ref is None:
        return pg, None, clipped, ratio
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
    return pg, kl_tok, clipped, ratio


class _Stats:
    """The update's per-token sums (this rank's), the first minibatch's on their own: on-policy
    for pi_old, a recomputed pi_old gives it a ratio of 1, so nothing there clips. Kept as float64
    tensors on the model's device and read once per update: on a GPU each read waits for the
    queued work (the sums themselves are those of Python floats, bit for bit)."""

    def __init__(self, device: torch.device):
        # policy loss, KL, clipped tokens, tokens; clipped tokens and tokens of the first minibatch
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)
        self.first_ratio_dev = torch.zeros((), dtype=torch.float64, device=device)  # max |ratio - 1|
        self.grad_norms: list[float] = []

    def add(
        self, mask: Tensor, pg: Tensor, kl_tok: Tensor | None, clipped: Tensor, log_ratio: Tensor, first: bool
    ):
        def total(x: Tensor) -> Tensor:
            return x.sum().double()

        zero = self.sums.new_zeros(())
        kl_sum = zero if kl_tok is None else total(kl_tok.detach() * mask)
        clipped_n, count = total(clipped & mask), total(mask)
        firsts = [clipped_n, count] if first else [zero, zero]
        self.sums += torch.stack([total(pg.detach() * mask), kl_sum, clipped_n, count, *firsts])
        if first:
            dev = torch.where(mask, (log_ratio.exp() - 1).abs(), 0.0).max().double()
            self.first_ratio_dev = torch.maximum(self.first_ratio_dev, dev)

    def reduced(self, anchored: bool) -> dict:
        """Means over every process's tokens; without an anchor there is no KL to log (not 0)."""
        policy, kl_sum, clipped, count, first_clipped, first_count = distributed.sum_all(*self.sums.tolist())
        tokens = max(count, 1.0)
        return {
            "loss/policy": policy / tokens,
            **({"kl/value": kl_sum / tokens} if anchored else {}),
            "clip_frac": clipped / tokens,
            "clip_frac/first_minibatch": first_clipped / max(first_count, 1.0),
            "ppo_ratio/first_minibatch_max_dev": distributed.max_one(float(self.first_ratio_dev)),
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else math.nan,
        }


def update(
    run: Run, batch: Rollout, advantages: Tensor, old: OldPolicy, ref: AnchorView | None, timer: PhaseTimer
) -> dict:
    """PPO epochs over minibatches, micro-batched; an EMA counting optimiser steps steps here.
    `run` is the trainer's Run: its cfg, model, state, optimizer, scheduler and anchor.

    With several processes `batch` is this rank's slice of the global batch: the permutation is
    drawn over the global batch (the same random stream as one process), each rank takes its
    rows, and the loss is divided by the global total, so the summed gradients are one process's.
    """
    cfg, stats = run.cfg, _Stats(batch.sequences.device)
    local = len(batch.texts)
    first = distributed.rank() * local
    # Responses cut at the length limit can be left out of the loss (DAPO's overlong masking).
    loss_mask = (
        batch.response_mask & ~batch.truncated.unsqueeze(-1)
        if cfg.algo.mask_overlong
        else batch.response_mask
    ) & old.keep  # the rollout correction's dropped tokens leave the loss and its count
    for epoch in range(cfg.algo.epochs):
        permutation = torch.randperm(local * distributed.world()).chunk(cfg.algo.minibatches)
        for minibatch, rows in enumerate(permutation):
            rows = rows[(rows >= first) & (rows < first + local)] - first
            if cfg.algo.share_prompts:  # a group's rows side by side: its prompt is computed once
                rows = rows.sort().values
            run.optimizer.zero_grad(set_to_none=True)
            loss = _backward(
                cfg, run.model, batch, rows, loss_mask, advantages, old, ref, stats, epoch + minibatch == 0
            )
            _optimizer_step(run, loss, stats, timer)
    return stats.reduced(anchored=ref is not None)


def _backward(
    cfg: Config, model, batch, rows_mb, loss_mask, advantages, old, ref, stats: _Stats, first: bool
) -> float:
    """Forward and backward of one minibatch, micro-batch by micro-batch (the gradients add up to
    the minibatch's); returns its loss summed over processes, which every rank then agrees on."""
    total = aggregation_total(
        loss_mask[rows_mb],
        cfg.algo.loss_aggregation,
        reduce=distributed.sum_one,
        length=cfg.rollout.max_new_tokens,
    )
    minibatch_loss = 0.0  # a float64 tensor on the loss's device once added to
    device = batch.sequences.device
    # bf16-mixed: the forwards under autocast, each weight cast once for the whole minibatch (its
    # cache lives as long as the outer region), the backwards outside it.
    with autocast(cfg.train.precision, device):
        for rows in micro_batches(cfg, batch, rows_mb):
            weight = 0.0 if rows is None else 1.0  # a padding pass: the collectives, no gradient
            rows = rows_run(rows)
            part = batch.select(rows).trimmed()
            w = part.response_mask.shape[1]
            part_ref = None if ref is None else ref.select(rows, w)
            pg, kl_tok, clipped, log_ratio = token_losses(
                cfg, model, part, advantages[rows], old.select(rows, w), part_ref
            )
            loss_tok = pg if kl_tok is None else pg + cfg.kl.beta * kl_tok
            loss = weight * aggregate(loss_tok, loss_mask[rows, :w], cfg.algo.loss_aggregation, total)
            with outside_autocast(device):
                loss.backward()
            minibatch_loss = minibatch_loss + loss.detach().double()
            stats.add(loss_mask[rows, :w] & (weight > 0), pg, kl_tok, clipped, log_ratio, first)
    return distributed.sum_one(float(minibatch_loss))


def _optimizer_step(run: Run, loss: float, stats: _Stats, timer: PhaseTimer) -> None:
    """Clip the gradient and step, unless loss or gradient is not finite (then weights, optimiser
    moments, scheduler and anchor stay as they were); an EMA counting optimiser steps steps here."""
    cfg, state = run.cfg, run.state
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)  # global over shards
    grad_norm = float(distributed.full(norm))
    if not step_is_finite(state, loss, grad_norm, cfg.train.max_bad_steps):
        return
    stats.grad_norms.append(grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    state.optimizer_steps += 1
    if run.anchor is not None and cfg.anchor.period_unit == "optimizer_steps":
        with timer("ema"):
            run.anchor.step(run.model, state.optimizer_steps)
