"""Evaluation during a run: held-out accuracy (eval/accuracy) with the task's figures, eval.kl's
KLs, the anchor's own accuracy and eval.datasets, through the run's engine and scorer."""

from __future__ import annotations

import math

from emapg import distributed
from emapg.algo import kl
from emapg.eval.evaluate import HeldOut, held_out
from emapg.eval.math import validation_metrics
from emapg.rollout import SamplingParams
from emapg.tasks.base import Example, Task
from emapg.tasks.rewards import Scored
from emapg.training.config import Config
from emapg.training.run import Run
from emapg.training.update import response_logp


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
        cfg.rollout.max_new_tokens,
        e.temperature,
        e.top_p,
        greedy=e.greedy,
        stop=tuple(cfg.rollout.stop),
        seed=cfg.train.seed + 1,
    )


SAMPLES_PER_EVAL = 4  # responses written to samples.jsonl at each evaluation


def _held_out(run: Run) -> HeldOut:
    """eval/accuracy's sampling of the held-out set with the weights the engine holds."""
    cfg = run.cfg
    return held_out(
        run.engine, run.tokenizer, run.task, run.eval_examples, run.scorer, eval_params(cfg),
        samples=cfg.eval.samples_per_problem, chat_template=cfg.model.chat_template, eos=run.eos,
    )  # fmt: skip


def eval_kls(run: Run, got: HeldOut) -> dict:
    """eval/drift_kl and eval/anchor_kl: k3 of KL(policy || reference) per response token on the
    evaluation's responses (drawn from the policy at eval.temperature, top_p 1), every rank's
    real rows; the reference is the policy's initial weights, then the anchor."""
    cfg = run.cfg
    batch = got.batch.to(next(run.model.parameters()).device)
    mask = batch.response_mask.clone()
    mask[got.real :] = False  # padding rows
    logp, _ = response_logp(cfg, run.model, batch, cfg.eval.temperature)
    out = {}
    for name, reference in (("drift_kl", run.initial), ("anchor_kl", run.anchor)):
        if reference is None:
            continue
        with reference.active() as model:
            ref_logp, _ = response_logp(cfg, model, batch, cfg.eval.temperature)
        total, tokens = distributed.sum_all(
            float((kl.sampled(logp, ref_logp, "k3") * mask).sum()), float(mask.sum())
        )
        out[f"eval/{name}"] = total / max(tokens, 1.0)
    return out


def evaluate(run: Run, step: int) -> tuple[float, dict]:
    """Held-out accuracy: mean reward over `eval.samples` responses per problem (pass@1), or
    of one greedy response (sampling: `eval_params`, rewards through training's guarded scorer),
    the task's eval/ metrics, and as configured the KLs of `eval_kls` (eval.kl) and the anchor's
    own accuracy on the same rows and noise (eval.anchor: eval/anchor/accuracy). A few responses
    go to samples.jsonl."""
    cfg = run.cfg
    run.engine.sync_weights(run.model, run.state.optimizer_steps)
    got = _held_out(run)
    real = got.real  # this rank's rows that are not padding
    texts, rewards, mine = got.batch.texts[:real], got.scored.rewards[:real], got.examples[:real]
    if run.log:
        n = cfg.eval.samples_per_problem
        run.log.log_samples(
            step,
            [
                {"prompt": e.prompt, "response": t, "reward": r, "answer": e.answer}
                for e, t, r in list(zip(mine, texts, rewards, strict=True))[::n][:SAMPLES_PER_EVAL]
            ],
        )
    metrics = {
        **reward_part_metrics(run.task, got.scored, "eval/", real),
        **task_metrics(run.task, texts, mine, "eval/"),
        **(eval_kls(run, got) if cfg.eval.kl else {}),
    }
    metrics |= validate(run, "eval/")
    if cfg.evaluates_anchor:
        with run.anchor.active() as anchor_model:
            run.engine.sync_weights(anchor_model, ("anchor", run.state.optimizer_steps))
            metrics["eval/anchor/accuracy"] = _held_out(run).accuracy
            metrics |= validate(run, "eval/anchor/")
    return got.accuracy, metrics


def validate(run: Run, prefix: str) -> dict:
    """eval.datasets with the weights the engine holds: <prefix><name>/accuracy and pass@k."""
    if run.validation is None:
        return {}
    cfg, sets = run.cfg, run.validation
    n = cfg.eval.samples_per_problem
    out = {}
    for name, examples in sets.examples.items():
        got = held_out(
            run.engine, run.tokenizer, sets.task, examples, sets.scorer, eval_params(cfg), samples=n,
            chat_template=cfg.model.chat_template, eos=run.eos,
        )  # fmt: skip
        out |= validation_metrics(got, n, f"{prefix}{name}/")
    return out
