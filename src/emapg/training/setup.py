"""Building a run: the task, the policy (converted, warm-started), the engine or the async
workers, anchor, optimiser and log, restored from the last checkpoint when resuming. Every
check that can fail runs here, before any training."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from transformers.utils import logging as hf_logging

from emapg import distributed
from emapg.errors import EmapgError
from emapg.eval.math import ValidationSets
from emapg.model import lora, precision
from emapg.model.models import checkpoint_activations, load_model_and_tokenizer, model_folder
from emapg.prompts import encode_prompts
from emapg.rollout import eos_ids, make_engine
from emapg.rollout.remote.worker import WorkerSpec
from emapg.rollout.remote.workers import RolloutWorkers
from emapg.tasks import make_task, warm_start_recipe
from emapg.tasks.base import Example, Task
from emapg.tasks.rewards import RewardScorer
from emapg.training import checkpoint, run_folder
from emapg.training.config import Config
from emapg.training.metrics import MetricsLog
from emapg.training.optim import make_optimizer
from emapg.training.run import PromptSampler, Run, initial_weights, make_anchor

log = logging.getLogger("emapg")


def warm_started(cfg: Config) -> bool:
    """Whether the config's model is warm-started first: builtin:tiny always, a pretrained one
    with warmstart.pretrained."""
    return cfg.model.path == "builtin:tiny" or cfg.warmstart.pretrained


def load_policy(cfg: Config, task: Task, progress: bool):
    """The policy model and tokenizer, and the directory they load from: a GGUF file's cached
    Hugging Face folder, and the cached warm start (builtin:tiny, or warmstart.pretrained),
    each built first when missing."""
    dtype = getattr(torch, cfg.param_dtype)
    path, builtin = cfg.model.path, cfg.model.path == "builtin:tiny"
    with distributed.main_first():  # rank 0 converts and warm-starts (cached), the others load
        path = model_folder(path, cfg.model.cache_dir, progress=progress and distributed.is_main())
        if warm_started(cfg):
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


def last_checkpoint(cfg: Config, resume: bool) -> Path | None:
    """Claim the run's folder (a new run) or say what a resume changes, clear a checkpoint a
    crash left half-written, and return the one to resume from."""
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
    if not resume:
        return None
    last = checkpoint.list_checkpoints(ckpt_dir)[-1:]
    if not last:
        raise EmapgError(f"--resume: no complete checkpoint under {ckpt_dir}")
    return last[0]


class TaskParts(NamedTuple):
    """The task of a run, its examples (taken once), its guarded scorer and eval.datasets' sets."""

    task: Task
    train_examples: list[Example]
    eval_examples: list[Example]
    scorer: RewardScorer
    validation: ValidationSets | None


def task_parts(cfg: Config) -> TaskParts:
    """The task (its examples checked), its guarded scorer, and eval.datasets' sets."""
    with distributed.main_first():  # rank 0 writes what a task caches (a corpus, its index) first
        task = make_task(cfg.task, cfg.warmstart.cache_dir)
    train_examples, eval_examples = task.train_examples(), task.eval_examples()
    if not eval_examples:
        raise EmapgError(f"task {task.name!r} has no evaluation examples")
    scorer = RewardScorer(
        task,
        timeout_s=cfg.task.reward_timeout_s,
        isolation=cfg.task.reward_isolation,
        hold_warning=cfg.train.steps > 0,  # until the first step's check_first_step
    )
    prompt = getattr(cfg.task, "prompt", "") or None  # a math task's own template, else the default
    validation = ValidationSets.load(cfg.eval.datasets, prompt, cfg.task.reward_timeout_s)
    return TaskParts(task, train_examples, eval_examples, scorer, validation)


def worker_spec(cfg: Config) -> WorkerSpec:
    """What an async run's rollout workers build from: the run's sections, nothing above them."""
    return WorkerSpec(
        rollout=cfg.rollout, needs=cfg.engine_needs, task=cfg.task, cache_dir=cfg.warmstart.cache_dir,
        dtype=cfg.param_dtype, chat_template=cfg.model.chat_template, device=cfg.train.device,
        pin_kernels=cfg.model.path == "builtin:tiny",
    )  # fmt: skip


def make_run(cfg: Config, parts: TaskParts, model, tokenizer, engine, device) -> Run:
    """The Run around a loaded policy: adapters, anchor, the drift reference, optimiser."""
    if cfg.lora.r:  # the base is frozen; the engine's model carries the adapters from here on
        model = lora.wrap(model, cfg.lora)
    model.to(device).train()
    if cfg.train.gradient_checkpointing:
        checkpoint_activations(model)
    anchor = make_anchor(cfg, model)
    initial = initial_weights(cfg, model, anchor) if cfg.eval.kl else None
    distributed.shard(model, cfg.compute_dtype)
    optimizer, scheduler = make_optimizer(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA: the policy adapter alone
        cfg.optim,
        lr=cfg.lora.lr if cfg.lora.r else cfg.optim.lr,
        total_steps=cfg.train.steps * cfg.algo.epochs * cfg.algo.minibatches,
    )
    return Run(
        cfg=cfg, task=parts.task, train_examples=parts.train_examples, eval_examples=parts.eval_examples,
        model=model, tokenizer=tokenizer, eos=eos_ids(model, tokenizer),
        vocab=model.get_output_embeddings().weight.shape[0], engine=engine, scorer=parts.scorer,
        anchor=anchor, initial=initial, validation=parts.validation, optimizer=optimizer,
        scheduler=scheduler, sampler=PromptSampler(parts.train_examples, cfg.train.seed),
        run_dir=Path(cfg.train.output_dir) / cfg.train.name, log=None,
    )  # fmt: skip


def warn_engine_pi_old(cfg: Config) -> None:
    """algo.old_logp=engine where the engine is not the policy is allowed, and measured harmful."""
    if cfg.algo.old_logp == "engine" and not cfg.engine_is_policy:
        log.warning(
            "algo.old_logp=engine with rollout.engine=%s in %s beside a train.precision=%s policy: the PPO ratio's "
            "pi_old is the engine's, and its clip acts on the engine/trainer gap (SmolLM2 through a "
            "bfloat16 vLLM: 4%% of on-policy tokens clipped, 0.24 less accuracy gained; "
            "benchmarks/RESULTS.md); algo.old_logp=auto recomputes it",
            cfg.rollout.engine,
            cfg.engine_dtype,
            cfg.train.precision,
        )


def warn_emulated_bf16(cfg: Config, device: torch.device) -> None:
    """bfloat16 compute on a CPU without AVX512-BF16 or AMX is emulated: slower than fp32 there."""
    if cfg.train.precision != "fp32" and precision.native_bf16(device) is False and distributed.is_main():
        log.warning(
            "train.precision=%s on a %s without native bfloat16 (no AVX512-BF16 or AMX): bfloat16 is "
            "emulated here, slower than fp32 (the numerics are those of a GPU's bfloat16)",
            cfg.train.precision,
            "CPU" if device.type == "cpu" else device.type,
        )


def setup(cfg: Config, resume: bool, device: torch.device) -> Run:
    """Task, policy, engine, anchor, optimiser, data and log, restored from the last
    checkpoint when resuming. Every check that can fail runs before any training."""
    cfg.check_world(distributed.world())
    warn_engine_pi_old(cfg)
    warn_emulated_bf16(cfg, device)
    hf_logging.disable_progress_bar()  # per-save "Writing model shards" bars would bury ours
    last = last_checkpoint(cfg, resume)
    if cfg.lora.r:
        lora.require_peft(cfg.lora.r)  # before the warm start
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    parts = task_parts(cfg)
    model, tokenizer, model_dir = load_policy(cfg, parts.task, cfg.train.progress and distributed.is_main())
    check_context(cfg, model, tokenizer, parts.train_examples + parts.eval_examples, parts.task)
    # With LoRA the base's weights stand for the adapters', which grow to their scale.
    lr = cfg.lora.lr if cfg.lora.r else cfg.optim.lr
    precision.check_lost_updates(cfg.train.precision, model, lr, cfg.train.allow_lost_updates)
    if parts.validation is not None:
        check_context(cfg, model, tokenizer, [e for v in parts.validation.examples.values() for e in v])
    if cfg.rollout.mode == "async":  # workers start here, and load while the trainer sets up
        engine = RolloutWorkers(worker_spec(cfg), model_dir)
    else:  # a missing vLLM stops here, before training
        engine = make_engine(cfg.rollout, model, tokenizer, model_dir, cfg.engine_needs)
    try:  # a failure from here on closes the engine (an async run's workers) before it is raised
        run = make_run(cfg, parts, model, tokenizer, engine, device)
        if last:
            run.resume(last)
        if distributed.is_main():
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
            run.log = MetricsLog(
                run.run_dir, resume_step=run.start if last else None, tensorboard=cfg.train.tensorboard,
                wandb=cfg.train.wandb, config=cfg.model_dump(),
            )  # fmt: skip
        return run
    except BaseException:
        engine.close()
        raise
