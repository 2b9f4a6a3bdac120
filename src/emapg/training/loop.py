"""The EMA-PG training loop: rollout, reward, advantages, old-policy and anchor passes, PPO
update, EMA step.

Read bottom up: `train` is the whole loop, `setup` builds what it runs on, and the helpers above
them feed it. The update and its passes are in update.py; the algorithms themselves are pure
functions in kl.py, topk.py, advantages.py, policy_loss.py, rollout_correction.py and anchor.py.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from emapg import distributed
from emapg.algo import kl
from emapg.algo.advantages import advantages, overlong_shaping
from emapg.errors import EmapgError
from emapg.eval.evaluate import HeldOut, held_out
from emapg.eval.math import ValidationSets, validation_metrics
from emapg.model import lora
from emapg.model.anchor import Anchor
from emapg.model.lora import AdapterAnchor
from emapg.model.models import checkpoint_activations, load_model_and_tokenizer, model_folder, pin_cpu_kernels
from emapg.prompts import encode_prompts
from emapg.rollout import Rollout, RolloutEngine, SamplingParams, eos_ids, make_engine
from emapg.rollout.multiturn import sample_examples
from emapg.rollout.remote.workers import RolloutWorkers
from emapg.tasks import make_task, warm_start_recipe
from emapg.tasks.base import Example, Task
from emapg.tasks.math import PROMPT
from emapg.tasks.rewards import RewardScorer, Scored
from emapg.training import checkpoint, dynamic_sampling, run_folder
from emapg.training.config import Config
from emapg.training.dynamic_sampling import Round, uniform_groups
from emapg.training.metrics import MetricsLog, PhaseTimer
from emapg.training.optim import make_optimizer
from emapg.training.update import anchor_pass, old_policy, response_logp, update


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
        samples=1 if cfg.eval.greedy else cfg.eval.samples, chat_template=cfg.model.chat_template, eos=run.eos,
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
        n = 1 if cfg.eval.greedy else cfg.eval.samples
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
    n = 1 if cfg.eval.greedy else cfg.eval.samples
    out = {}
    for name, examples in sets.examples.items():
        got = held_out(
            run.engine, run.tokenizer, sets.task, examples, sets.scorer, eval_params(cfg), samples=n,
            chat_template=cfg.model.chat_template, eos=run.eos,
        )  # fmt: skip
        out |= validation_metrics(got, n, f"{prefix}{name}/")
    return out


# ---------------------------------------------------------------------------------------------
# Set-up


def load_policy(cfg: Config, task: Task, progress: bool):
    """The policy model and tokenizer, and the directory they load from: a GGUF file's cached
    Hugging Face folder, and the cached warm start (builtin:tiny, or warmstart.pretrained),
    each built first when missing."""
    dtype = getattr(torch, cfg.model.dtype)
    path, builtin = cfg.model.path, cfg.model.path == "builtin:tiny"
    with distributed.main_first():  # rank 0 converts and warm-starts (cached), the others load
        path = model_folder(path, cfg.model.cache_dir, progress=progress and distributed.is_main())
        if builtin or cfg.warmstart.pretrained:
            from emapg.training.sft import warm_start

            w = cfg.warmstart
            path = warm_start(
                Path(w.cache_dir).expanduser(),
                recipe=warm_start_recipe(cfg.task.name, task),
                sft_kwargs={"steps": w.steps, "batch_size": w.batch_size, "lr": w.lr, "seed": cfg.train.seed},
                model_kwargs=w.model_kwargs,
                target_accuracy=w.target_accuracy or None,
                base=None if builtin else path,
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
                f"the episode cap max_context={env.max_context} (task.max_context for search) "
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


def device_of(cfg: Config) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise EmapgError("train.device=cuda but no CUDA device is available")
    return torch.device(cfg.train.device)


@dataclass
class Requested:
    """An async batch asked of a worker: for which step, its rows, and the weights it is drawn with."""

    step: int
    examples: list[Example]
    drawn_at: int  # training steps done when it was asked for: the version of its weights
    version: object  # the engine's name for those weights (as pushed; the worker reports it back)
    sampler_state: dict  # the prompt sampler before this batch's prompts
    ticket: tuple[int, int]  # (worker, request), for RolloutWorkers.result


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
    initial: Anchor | AdapterAnchor | None  # the policy's initial weights, for eval.kl's drift
    validation: ValidationSets | None  # eval.datasets
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    run_dir: Path
    log: MetricsLog | None  # rank 0 alone writes the run's files
    start: int = 0  # the step a resumed run continues after
    state: TrainerState = field(default_factory=TrainerState)
    requested: deque[Requested] = field(default_factory=deque)  # async: batches asked for, oldest first
    next_request: int = 1  # async: the step whose batch is asked for next

    def save(self, step: int) -> None:
        extra = {
            "format": CHECKPOINT_FORMAT,
            "trainer": asdict(self.state),
            # async: the prompts of batches asked for but not trained on are taken again on resume
            "sampler": self.requested[0].sampler_state if self.requested else self.sampler.state(),
            "anchor": self.anchor.state_dict() if self.anchor else None,
        }
        checkpoint.save(
            self.run_dir / "checkpoints",
            step,
            policy=self.model,
            tokenizer=self.tokenizer,
            anchor=self.anchor,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=extra,
            keep=self.cfg.train.keep_checkpoints,
        )

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
        if self.validation is not None:
            self.validation.close()
        self.engine.close()


def make_anchor(cfg: Config, model: nn.Module) -> Anchor | AdapterAnchor | None:
    """No anchor model at all without a KL; an EMA with eta = 1 is the frozen reference. With
    LoRA the anchor is an adapter of the policy's own model (or its base): no copy of the base."""
    if cfg.anchor.kind == "none":
        return None
    eta = 1.0 if cfg.anchor.kind == "frozen" else cfg.anchor.eta
    if cfg.lora.r:
        return AdapterAnchor(model, eta, cfg.anchor.update_period)
    anchor = Anchor(model, eta, cfg.anchor.update_period, dtype=getattr(torch, cfg.anchor_dtype))
    distributed.shard(anchor.model)
    return anchor


def initial_weights(cfg: Config, model: nn.Module, anchor) -> Anchor | AdapterAnchor:
    """eval.kl's reference for drift: the policy as it starts. A frozen anchor is that already;
    with LoRA it is the base (the adapters start at zero); else a frozen copy, taken before a
    resumed run loads its checkpoint."""
    if cfg.anchor.kind == "frozen":
        return anchor
    if cfg.lora.r:
        return AdapterAnchor(model, 1.0, 1)
    initial = Anchor(model, 1.0, 1)
    distributed.shard(initial.model)
    return initial


def setup(cfg: Config, resume: bool, device: torch.device) -> Run:
    """Task, policy, engine, anchor, optimiser, data and log, restored from the last
    checkpoint when resuming. Every check that can fail runs before any training."""
    cfg.check_world(distributed.world())
    hf_logging.disable_progress_bar()  # per-save "Writing model shards" bars would bury ours
    run_dir = Path(cfg.train.output_dir) / cfg.train.name
    ckpt_dir = run_dir / "checkpoints"
    if not resume:
        run_folder.claim(run_dir)
    else:
        changes = run_folder.resume_changes(run_folder.saved_config(run_dir), cfg.model_dump())
        if distributed.is_main():
            print("".join(f"--resume: {change}\n" for change in changes), end="", flush=True)
    distributed.barrier()  # every rank has looked at the folder before rank 0 changes it
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
    scorer = RewardScorer(
        task,
        timeout_s=cfg.task.reward_timeout_s,
        isolation=cfg.task.reward_isolation,
        hold_warning=cfg.train.steps > 0,  # until the first step's check_first_step
    )
    validation = ValidationSets.load(cfg.eval.datasets, getattr(cfg.task, "prompt", "") or PROMPT,
                                     cfg.task.reward_timeout_s)  # fmt: skip
    model, tokenizer, model_dir = load_policy(cfg, task, cfg.train.progress and distributed.is_main())
    check_context(cfg, model, tokenizer, train_examples + eval_examples, task)
    if validation is not None:
        check_context(cfg, model, tokenizer, [e for v in validation.examples.values() for e in v])
    if cfg.rollout.mode == "async":  # workers start here, and load while the trainer sets up
        engine = RolloutWorkers(cfg, model_dir)
    else:
        engine = make_engine(cfg, model, tokenizer, model_dir)  # a missing vLLM stops here, before training
    try:  # a failure from here on closes the engine (an async run's workers) before it is raised
        if cfg.lora.r:  # the base is frozen; the engine's model carries the adapters from here on
            model = lora.wrap(model, cfg.lora)
        model.to(device).train()
        if cfg.train.gradient_checkpointing:
            checkpoint_activations(model)
        anchor = make_anchor(cfg, model)
        initial = initial_weights(cfg, model, anchor) if cfg.eval.kl else None
        distributed.shard(model)
        optimizer, scheduler = make_optimizer(
            [p for p in model.parameters() if p.requires_grad],  # with LoRA: the policy adapter alone
            cfg.optim,
            lr=cfg.lora.lr if cfg.lora.r else cfg.optim.lr,
            total_steps=cfg.train.steps * cfg.algo.epochs * cfg.algo.minibatches,
        )
        run = Run(
            cfg=cfg,
            task=task,
            train_examples=train_examples,
            eval_examples=eval_examples,
            model=model,
            tokenizer=tokenizer,
            eos=eos_ids(model, tokenizer),
            vocab=model.get_output_embeddings().weight.shape[0],
            engine=engine,
            scorer=scorer,
            anchor=anchor,
            initial=initial,
            validation=validation,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=PromptSampler(train_examples, cfg.train.seed),
            run_dir=run_dir,
            log=None,
        )
        if last:
            run.resume(last[0])
        if distributed.is_main():
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
            run.log = MetricsLog(
                run_dir,
                resume_step=run.start if last else None,
                tensorboard=cfg.train.tensorboard,
                wandb=cfg.train.wandb,
                config=cfg.model_dump(),
            )
        return run
    except BaseException:
        engine.close()
        raise


# ---------------------------------------------------------------------------------------------
# The loop


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


def step_advantages(cfg, rewards: Tensor, lengths: Tensor) -> Tensor:
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
