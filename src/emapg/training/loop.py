"""The EMA-PG training loop: rollout, reward, advantages, old-policy and anchor passes, PPO
update, EMA step.

Read bottom up: `train` is the whole loop, `training_step` one step, and the helpers above
them feed it. setup.py builds the Run it runs on, evaluation.py evaluates it, update.py is the
update and its passes; the algorithms themselves are pure functions in emapg.algo."""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm.auto import tqdm

from emapg import distributed
from emapg.algo import kl
from emapg.algo.advantages import advantages, overlong_shaping
from emapg.errors import EmapgError
from emapg.model.models import pin_cpu_kernels
from emapg.rollout import Rollout, SamplingParams
from emapg.rollout.multiturn import sample_examples
from emapg.tasks.base import Example
from emapg.tasks.rewards import Scored
from emapg.training import dynamic_sampling
from emapg.training.config import Config
from emapg.training.dynamic_sampling import Round, uniform_groups
from emapg.training.evaluation import evaluate, reward_part_metrics, rollout_params, task_metrics
from emapg.training.metrics import PhaseTimer, device_memory
from emapg.training.run import Requested, Run, device_of
from emapg.training.setup import setup
from emapg.training.update import anchor_pass, old_policy, update


def train(cfg: Config, *, resume: bool = False) -> dict:
    """Run (or resume) training; returns the final record with accuracy before and after.

    Under torchrun (WORLD_SIZE > 1) every rank runs this loop on its slice of each batch, with
    policy and anchor sharded by FSDP2; rank 0 alone logs and writes the run's files."""
    if cfg.model.path == "builtin:tiny":
        pin_cpu_kernels()  # before any CPU kernel runs: the default run is the same on any x86-64 CPU
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = distributed.init(device_of(cfg))
    try:
        run = setup(cfg, resume, device)
        try:
            return train_loop(run)
        finally:
            run.close()
    finally:
        distributed.close()


def step_examples(run: Run) -> list[Example]:
    """The next step's prompts from the sampler, each repeated for its group."""
    r = run.cfg.rollout
    return [e for e in run.sampler.take(r.prompts_per_step) for _ in range(r.group_size)]


def sample_batch(run: Run, params: SamplingParams) -> tuple[list[Example], Rollout]:
    """This step's prompts, each repeated for its group, and the responses sampled for this
    rank's rows (whole groups) with the policy's current weights."""
    examples = step_examples(run)
    rows = distributed.shard_rows(len(examples))  # whole groups: prompts_per_step % world == 0
    examples = examples[rows]
    run.engine.sync_weights(run.model, run.state.optimizer_steps)
    batch = sample_examples(
        run.engine,
        run.tokenizer,
        run.task,
        examples,
        params,
        chat_template=run.cfg.model.chat_template,
        eos=run.eos,
        rows=range(rows.start, rows.stop),
    ).to(next(run.model.parameters()).device)
    run.engine.sleep()  # a colocated engine frees its memory for the passes below
    return examples, batch


def request_ahead(run: Run, step: int, params: SamplingParams, timer: PhaseTimer) -> None:
    """Async: ask the workers for every batch up to step + rollout.max_staleness (and the run's
    last) not yet asked for, drawn with the weights this step starts from (after step - 1
    steps), pushed first."""
    cfg = run.cfg
    while run.next_request <= min(step + cfg.rollout.max_staleness, cfg.train.steps):
        with timer("weight_sync"):
            run.engine.sync_weights(run.model, run.state.optimizer_steps)
        state = run.sampler.state()
        examples = step_examples(run)
        ticket = run.engine.request(examples, params, rows=range(len(examples)))
        run.requested.append(
            Requested(run.next_request, examples, step - 1, run.engine.version, state, ticket)
        )
        run.next_request += 1


def requested_batch(run: Run, step: int, timer: PhaseTimer) -> tuple[list[Example], Rollout, dict]:
    """Async: this step's batch, asked for up to rollout.max_staleness steps ago (waited for if
    its worker has not finished), and its metrics: the version of the weights that drew it, its
    staleness in steps and the worker's throughput."""
    asked = run.requested.popleft()
    with timer("wait_for_rollout"):
        answer = run.engine.result(asked.ticket)
    staleness = step - 1 - asked.drawn_at
    if asked.step != step or answer["version"] != asked.version or staleness > run.cfg.rollout.max_staleness:
        raise EmapgError(
            f"async rollout: step {step} got the batch of step {asked.step}, drawn with weights "
            f"{answer['version']!r} (asked: {asked.version!r}, staleness {staleness})"
        )
    batch = answer["rollout"].to(next(run.model.parameters()).device)
    tokens = int(batch.response_mask.sum())
    return (
        asked.examples,
        batch,
        {
            "rollout/version": asked.drawn_at,
            "rollout/staleness_mean": float(staleness),  # one request per step: every row shares it
            "rollout/staleness_max": staleness,
            "rollout/worker_tokens_per_s": tokens / max(answer["seconds"], 1e-9),
        },
    )


def sampled_groups(run: Run, params: SamplingParams, timer: PhaseTimer, step: int) -> tuple[Round, dict]:
    """This step's groups (this rank's rows, on the policy's device) with their task rewards, and
    the sampling metrics: one round, dynamic sampling's rounds (dynamic_sampling.py), or (async)
    the batch a worker drew ahead."""
    cfg, counts, extra = run.cfg, {"errors": 0, "timeouts": 0, "failures": 0, "responses": 0}, {}
    problems: list[str] = []  # this rank's first problem of each round, for the first step's check

    def one_round() -> Round:
        if cfg.rollout.mode == "async":
            request_ahead(run, step, params, timer)
            examples, batch, async_metrics = requested_batch(run, step, timer)
            extra.update(async_metrics)
        else:
            with timer("rollout"):
                examples, batch = sample_batch(run, params)
        with timer("scoring"):
            scored = run.scorer(batch.texts, examples)
        counts["errors"] += scored.errors
        counts["timeouts"] += scored.timeouts
        counts["failures"] += scored.failures
        counts["responses"] += len(scored.rewards)
        problems.extend(scored.problems[:1])
        return Round(examples, batch, scored.rewards, scored.parts)

    if cfg.algo.dynamic_sampling:
        got, metrics = dynamic_sampling.collect(
            one_round, cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.algo.max_sampling_rounds,
            run.tokenizer.pad_token_id,
        )  # fmt: skip
        got.batch = got.batch.to(next(run.model.parameters()).device)
    else:
        got, metrics = one_round(), {}
    uniform = sum(uniform_groups(torch.tensor(got.rewards), cfg.rollout.group_size))
    uniform, groups, errors, timeouts, failures, responses = distributed.sum_all(
        uniform,
        len(got.rewards) / cfg.rollout.group_size,
        counts["errors"],
        counts["timeouts"],
        counts["failures"],
        counts["responses"],
    )
    if step == run.start + 1:  # before the update: a run whose every reward failed stops here
        run.scorer.check_first_step(problems, int(failures), int(responses), step)
    return got, {
        **metrics,
        **extra,
        "sampling/uniform_frac": uniform / groups,
        "reward/errors": int(errors),
        "reward/timeouts": int(timeouts),
    }


def step_advantages(cfg: Config, rewards: Tensor, lengths: Tensor) -> Tensor:
    """This rank's advantages, computed on the whole batch (every rank's rows, in order), so that
    batch statistics (batch_std, reinforce_pp) are those of one process."""
    every = distributed.all_gather((rewards.tolist(), lengths.tolist()))
    whole_rewards = torch.tensor([r for rank_rewards, _ in every for r in rank_rewards])
    whole_lengths = torch.tensor([n for _, rank_lengths in every for n in rank_lengths])
    whole = advantages(cfg.algo.advantage, whole_rewards, cfg.rollout.group_size, whole_lengths)
    return whole[distributed.shard_rows(len(whole))]


def training_step(run: Run, step: int, params: SamplingParams) -> dict:
    """One step: rollout, rewards and advantages, pi_old and the anchor pass, the update, the
    EMA; returns the step's metrics."""
    cfg, model, timer = run.cfg, run.model, PhaseTimer()
    got, sampling_metrics = sampled_groups(run, params, timer, step)
    batch, examples = got.batch, got.examples
    lengths = batch.response_mask.sum(-1).cpu()
    with timer("scoring"):
        task_rewards = torch.tensor(got.rewards)
        shaping = cfg.algo.overlong_penalty * overlong_shaping(
            lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer
        )
        advantage = step_advantages(cfg, task_rewards + shaping, lengths)
    old, correction_metrics = old_policy(cfg, model, batch, params.topk, timer)  # timed when recomputed
    with timer("anchor"):
        ref = anchor_pass(cfg, run.anchor, batch, old, run.vocab) if run.anchor is not None else None
    with timer("update"):
        stats = update(run, batch, advantage.to(batch.sequences.device), old, ref, timer)
    if run.anchor is not None and cfg.anchor.period_unit == "training_steps":
        with timer("ema"):
            run.anchor.step(model, step)
    mask = batch.response_mask
    reward_sum, shaping_sum, entropy_sum, tokens, n = distributed.sum_all(
        float(task_rewards.sum()), float(shaping.sum()), float((batch.entropy * mask).sum()), float(mask.sum()),
        len(examples),
    )  # fmt: skip
    return {
        "step": step,
        "reward/mean": reward_sum / n,
        **({"reward/overlong/mean": shaping_sum / n} if cfg.algo.overlong_buffer else {}),
        **reward_part_metrics(run.task, Scored(got.rewards, parts=got.parts)),
        **sampling_metrics,
        "train/skipped_steps": run.state.skipped_steps,
        **stats,
        **correction_metrics,
        "entropy": entropy_sum / max(tokens, 1.0),
        "response_length/mean": tokens / n,
        **task_metrics(run.task, batch.texts, examples),
        "anchor/updates": run.anchor.updates if run.anchor else 0,
        "lr": run.scheduler.get_last_lr()[0],
        **{f"time/{k}_s": v for k, v in timer.seconds.items()},
        "time/step_s": sum(timer.seconds.values()),
        **device_memory(batch.sequences.device),
    }


def training_params(run: Run) -> SamplingParams:
    """The sampling parameters of training rollouts. The engine records the top-k ids of what it
    samples only where they may form q (a recomputed pi_old brings its own)."""
    cfg = run.cfg
    sampling_q = kl.q_source(cfg.kl.estimator, cfg.kl.direction) == "sampling" and run.anchor is not None
    return rollout_params(cfg, topk=min(cfg.kl.k, run.vocab) if sampling_q else 0)


def train_loop(run: Run) -> dict:
    cfg, state = run.cfg, run.state
    if run.start == 0:
        state.accuracy_before, eval_metrics = evaluate(run, 0)
        state.accuracy = state.accuracy_before
        if run.log:
            run.log.log({"step": 0, "eval/accuracy": state.accuracy, **eval_metrics})
    params = training_params(run)
    run.next_request = run.start + 1
    bar = tqdm(
        range(run.start + 1, cfg.train.steps + 1),
        desc=cfg.train.name,
        initial=run.start,
        total=cfg.train.steps,
        disable=not (cfg.train.progress and distributed.is_main()),
    )
    for step in bar:
        record = training_step(run, step, params)
        if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
            state.accuracy, eval_metrics = evaluate(run, step)
            record.update({"eval/accuracy": state.accuracy, **eval_metrics})
        if run.log:
            run.log.log(record)
        kl = record.get("kl/value")  # absent without an anchor
        bar.set_postfix(
            reward=f"{record['reward/mean']:.3f}",
            kl="-" if kl is None else f"{kl:.2e}",
            acc=f"{state.accuracy:.3f}",
        )
        if step % cfg.train.save_every == 0 or step == cfg.train.steps:
            run.save(step)
    return {
        "run_dir": str(run.run_dir),
        "accuracy_before": state.accuracy_before,
        "accuracy_after": state.accuracy,
        "reward_range": tuple(run.task.reward_range),  # eval/accuracy is a mean reward in it
    }
