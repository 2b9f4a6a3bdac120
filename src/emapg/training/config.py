"""The run's config: every part's section composed, read from YAML and dotted overrides.

Each section is declared next to the part it configures (`kl.KLSettings`, `anchor.AnchorSettings`
...); the `task` section is the settings class that `task.name` registered, the `rollout`
section the one `rollout.engine` registered. This module composes them into `Config`, holds the
rules that join sections and the run-level `train` section, and reads a config: defaults, then
a YAML file (`kl: {estimator: topk, k: 32}`), then `kl.k=16` overrides. Unknown keys, wrong
types and out-of-range values stop with one line naming the field, before any work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
import yaml
from pydantic import Field, SerializeAsAny, ValidationError, model_validator

from emapg.algo.advantages import NEEDS_GROUPS
from emapg.algo.kl import KLSettings
from emapg.algo.settings import AlgoSettings
from emapg.errors import EmapgError
from emapg.eval.evaluate import EvalSettings
from emapg.model.anchor import AnchorSettings
from emapg.model.lora import LoraSettings
from emapg.model.models import ModelSettings
from emapg.model.precision import Precision, compute_dtype, param_dtype
from emapg.rollout import ENGINES, EngineNeeds, RolloutSettings
from emapg.settings import Registry, Section, check, one_line, setting, suggest, validated
from emapg.tasks import TASKS, TaskSettings
from emapg.tasks.arithmetic import ArithmeticSettings
from emapg.training.optim import OptimSettings
from emapg.training.run_folder import saved_config
from emapg.training.sft import WarmStartSettings

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MOVED = {"retriever": "the retriever settings moved under task (e.g. task.topk, with task.name=search)"}
MOVED_KEYS = {
    "model.dtype": "the training dtype is train.precision now: fp32, bf16-mixed (float32 weights, "
    "bfloat16 compute) or bf16-true (model.dtype=bfloat16 was bf16-true)"
}


class TrainSettings(Section):
    """The `train` section: the run as a whole: name, length, evaluation and checkpoint cadence,
    logging and device."""

    key: ClassVar[str] = "train"
    name: str = setting(
        "run", "run name: outputs go to <output_dir>/<name>; from the command line, the config file's name"
    )
    output_dir: str = setting("runs", "where runs are written")
    seed: int = setting(0, "seed of sampling, shuffling and initialisation")
    steps: int = setting(40, "rollout batches (training steps)", ge=0)
    eval_every: int = setting(10, "evaluate every this many steps (and at the start and end)", ge=1)
    save_every: int = setting(20, "checkpoint every this many steps (and at the end)", ge=1)
    keep_checkpoints: int = setting(2, "checkpoints kept; older ones are deleted", ge=1)
    max_bad_steps: int = setting(
        5, "stop after this many optimiser steps in a row with a non-finite loss/gradient", ge=1
    )
    threads: int = setting(0, "torch CPU threads; 0 leaves torch's default", ge=0)
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: cuda when available, else cpu")
    precision: Precision = setting(
        "fp32",
        "fp32; bf16-mixed: float32 weights, gradients and AdamW state, bfloat16 compute (GPU trainers' "
        "way); bf16-true: all bfloat16 (small lr updates round away: refused, see allow_lost_updates)",
    )
    allow_lost_updates: bool = setting(
        False, "run bf16-true even where its bfloat16 weights would round most of a step's updates away"
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass (less memory)")
    tensorboard: bool = setting(True, "write TensorBoard events when tensorboard is installed")
    wandb: bool = setting(False, "log to Weights & Biases (needs wandb)")
    progress: bool = setting(True, "show a progress bar")


# The sections a registry picks: the `task` section is the class `task.name` registered.
SELECTED: dict[str, tuple[Registry, str]] = {"task": (TASKS, "name"), "rollout": (ENGINES, "engine")}


class Config(Section):
    """Every section of a run, and the rules that join sections."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    warmstart: WarmStartSettings = Field(default_factory=WarmStartSettings)
    task: SerializeAsAny[TaskSettings] = Field(default_factory=ArithmeticSettings)
    rollout: SerializeAsAny[RolloutSettings] = Field(default_factory=RolloutSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)
    algo: AlgoSettings = Field(default_factory=AlgoSettings)
    kl: KLSettings = Field(default_factory=KLSettings)
    anchor: AnchorSettings = Field(default_factory=AnchorSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)

    @model_validator(mode="after")
    def _across_sections(self):
        r, a = self.rollout, self.algo
        needs = [f"algo.advantage={a.advantage}"] * (a.advantage in NEEDS_GROUPS) + [
            "algo.dynamic_sampling"
        ] * a.dynamic_sampling
        check(
            r.group_size >= 2 or not needs,
            f"rollout.group_size=1 has no groups for {' and '.join(needs)} (drgrpo and reinforce_pp need none)",
        )
        check(
            a.overlong_buffer <= r.max_new_tokens,
            f"algo.overlong_buffer={a.overlong_buffer} exceeds rollout.max_new_tokens={r.max_new_tokens}",
        )
        batch = r.prompts_per_step * r.group_size
        check(
            batch % a.minibatches == 0, f"algo.minibatches={a.minibatches} must divide the {batch} sequences"
        )
        check(
            a.old_logp != "engine" or r.top_p == 1,
            "algo.old_logp=engine with rollout.top_p < 1 would take the nucleus-truncated sampling "
            "distribution for pi_old; use algo.old_logp=recompute (or auto)",
        )
        check(
            (self.anchor.kind == "none") == (self.kl.beta == 0),
            "anchor.kind=none goes with kl.beta=0 and only then (a KL needs an anchor)",
        )
        check(
            self.eval.anchor is not True or self.anchor.kind != "none",
            "eval.anchor=true evaluates the anchor, and anchor.kind=none has none",
        )
        check(
            self.eval.anchor is not True or not (self.lora.r and self.rollout.engine == "vllm"),
            "eval.anchor=true with LoRA and rollout.engine=vllm: the engine takes merged policy weights "
            "only; evaluate the anchor with rollout.engine=hf",
        )
        if r.mode == "async":
            check(
                a.old_logp != "engine",
                "algo.old_logp=engine with rollout.mode=async: a worker's log-probs are of the weights it "
                "sampled with, not those the update starts from; use algo.old_logp=recompute (or auto)",
            )
            for ok, what in ((not a.dynamic_sampling, "algo.dynamic_sampling"), (not self.lora.r, "lora.r")):
                check(ok, f"{what} is not supported with rollout.mode=async yet; use rollout.mode=sync")
        check(
            not self.lora.r or self.anchor_dtype == self.param_dtype,
            f"anchor.dtype={self.anchor.dtype}: with LoRA the anchor is an adapter of the policy's own "
            f"model, whose parameters are {self.param_dtype} (train.precision={self.train.precision})",
        )
        return self

    @property
    def engine_needs(self) -> EngineNeeds:
        """What the rollout engine is asked for besides its section."""
        return EngineNeeds(
            dtype=self.engine_dtype,
            seed=self.train.seed,
            max_logprobs=max(self.kl.k, 1),
            share_prompts=self.algo.share_prompts,
        )

    @property
    def param_dtype(self) -> str:
        """The policy's parameter dtype (and its gradients' and AdamW's): train.precision's."""
        return str(param_dtype(self.train.precision)).removeprefix("torch.")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the passes compute in (train.precision's): bfloat16 under bf16-mixed."""
        return compute_dtype(self.train.precision)

    @property
    def engine_dtype(self) -> str:
        """The rollout engine's dtype: its own `rollout.dtype` where it has one, else the dtype the
        policy computes in (bfloat16 under bf16-mixed: a bfloat16 engine beside float32 weights)."""
        dtype = getattr(self.rollout, "dtype", "auto")
        return str(self.compute_dtype).removeprefix("torch.") if dtype == "auto" else dtype

    @property
    def anchor_dtype(self) -> str:
        """The anchor's parameter dtype: its own `anchor.dtype`, else the policy's parameters' (float32
        under bf16-mixed, where a bfloat16 EMA would lose its small updates; its forward computes in
        bfloat16 like the policy's)."""
        return self.param_dtype if self.anchor.dtype == "auto" else self.anchor.dtype

    @property
    def evaluates_anchor(self) -> bool:
        """eval.anchor resolved: auto evaluates an EMA anchor (a frozen one is the initial policy,
        whose accuracy is eval/accuracy at step 0), except a LoRA anchor through vLLM."""
        if self.eval.anchor != "auto":
            return self.eval.anchor
        return self.anchor.kind == "ema" and not (self.lora.r and self.rollout.engine == "vllm")

    @property
    def recomputes_old_logp(self) -> bool:
        """Whether pi_old comes from a no-grad pass of the trainer's policy rather than the engine.

        auto skips the pass only where the engine is the policy itself: the hf engine of an fp32
        run samples with the live module, so at top_p = 1 its recorded log-probs are pi_old already
        (the same weights and kernels, up to the KV cache's rounding) and a pass would change
        nothing. vLLM has kernels (and on a GPU a dtype) of its own, and top_p < 1 samples from a
        truncated distribution: there the engine's log-probs are mu, not pi_old. An async worker
        samples with weights up to rollout.max_staleness steps older than the update's."""
        if self.algo.old_logp != "auto":
            return self.algo.old_logp == "recompute"
        return not self.engine_is_policy

    @property
    def engine_is_policy(self) -> bool:
        """Whether the engine's log-probs are the policy's own: the hf engine of an fp32 run, at
        top_p = 1, sampling synchronously (see recomputes_old_logp). Not in bfloat16: there the KV
        cache's decode and the update's pass over whole rows round differently enough to matter."""
        r = self.rollout
        return r.engine == "hf" and self.train.precision == "fp32" and r.top_p == 1 and r.mode == "sync"

    def check_world(self, world: int) -> None:
        """What multi-process training (torchrun, `world` processes) supports; one line each."""
        if world == 1:
            return
        if self.rollout.prompts_per_step % world:
            raise EmapgError(
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} must be divisible by the {world} "
                "processes (each rank takes whole groups)"
            )
        if self.rollout.mode == "async":
            raise EmapgError(
                f"rollout.mode=async trains in one process (its workers are separate); torchrun started {world}"
            )
        if self.lora.r:
            raise EmapgError(
                f"lora.r={self.lora.r}: LoRA runs in one process (FSDP2 sharding of peft adapters is not "
                f"supported); torchrun started {world}"
            )


def section_class(name: str, values: dict) -> type[Section]:
    """The class of section `name` for its given `values` (a registry's pick for task, rollout)."""
    if name in SELECTED:
        registry, key = SELECTED[name]
        return registry[
            values.get(key, Config.model_fields[name].default_factory.model_fields[key].default)
        ].config
    return Config.model_fields[name].default_factory


def _unknown_key(name: str, values: dict, cls: type[Section], key: str) -> EmapgError:
    """A key `cls` lacks: named with the closest valid key, or with the choice it belongs to."""
    where = f"{name}.{key}"
    if where in MOVED_KEYS:
        return EmapgError(f"config key {where!r} moved: {MOVED_KEYS[where]}")
    if name in SELECTED:
        registry, pick = SELECTED[name]
        owners = [n for n, e in registry.items() if key in e.config.model_fields]
        if owners:
            chosen = f"{name}.{pick}={values.get(pick, cls.model_fields[pick].default)}"
            return EmapgError(
                f"unknown config key {where!r}: a setting of {name}.{pick}={owners[0]}, not of {chosen}"
            )
    return EmapgError(f"unknown config key {where!r}{suggest(key, cls.model_fields, prefix=f'{name}.')}")


def build(raw: dict) -> Config:
    """A Config from a mapping of section -> {key: value} (what a YAML file holds)."""
    sections = {}
    for name, values in raw.items():
        if name not in Config.model_fields:
            hint = f": {MOVED[name]}" if name in MOVED else suggest(name, Config.model_fields)
            raise EmapgError(f"unknown config section {name!r}{hint}")
        values = {} if values is None else values
        if not isinstance(values, dict):
            raise EmapgError(f"section {name!r} must be a mapping, got {values!r:.80}")
        cls = section_class(name, values)
        for key in values:
            if key not in cls.model_fields:
                raise _unknown_key(name, values, cls, key)
        sections[name] = validated(cls, values, name)
    try:
        return Config.model_validate(sections)
    except ValidationError as e:
        raise one_line(e, "") from None


def resolve_config_path(name: str) -> Path:
    """A path, or the name of a ready config shipped with the package ("grpo", "ema_pg")."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    shipped = CONFIG_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")  # e.g. paper/<run>
    if shipped.is_file():
        return shipped
    names = sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))
    raise EmapgError(f"config file {name!r} not found (shipped configs: {', '.join(names)})")


def _sections_of(key: str) -> str:
    """A bare key (`output_dir=runs`) named with the sections that have it, as a hint: a setting
    of any task or engine counts (`train_files` belongs to task.name=math and dataset)."""

    def classes(name: str) -> list[type[Section]]:
        return (
            [e.config for _, e in SELECTED[name][0].items()]
            if name in SELECTED
            else [section_class(name, {})]
        )

    owners = [name for name in Config.model_fields if any(key in c.model_fields for c in classes(name))]
    return f" (did you mean {' or '.join(repr(f'{name}.{key}') for name in owners)}?)" if owners else ""


def with_overrides(raw: dict, overrides: list[str]) -> dict:
    """`raw` (section -> values) with each `section.key=value` set (the value read as YAML)."""
    raw = {name: dict(values or {}) for name, values in raw.items()}
    for item in overrides:
        key, eq, text = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not eq:
            raise EmapgError(f"override {item!r}: expected key=value, e.g. kl.k=16")
        if not dot or not field:
            raise EmapgError(
                f"override {item!r}: expected section.key=value{_sections_of(section)}, e.g. kl.k=16"
            )
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        raw.setdefault(section, {})[field] = value
    return raw


def read_config(path: str | None = None) -> dict:
    """What a YAML file (default: the quickstart) sets: a mapping of section -> {key: value}."""
    file = resolve_config_path(path or "quickstart")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise EmapgError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise EmapgError(f"{file}: expected a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | None = None, overrides: list[str] = (), task_name: str | None = None) -> Config:
    """Defaults, then the YAML file (default: the quickstart), then `key=value` overrides. A run
    the file does not name is named after the file (my_data.yaml -> runs/my_data). `task_name`:
    the run trains a task given as an object, and of the file's task section only the settings
    every task has carry over."""
    raw = with_overrides(given_task(read_config(path), task_name), list(overrides))
    raw.setdefault("train", {}).setdefault("name", Path(path or "quickstart").stem)
    return build(raw)


def given_task(raw: dict, task_name: str | None) -> dict:
    """`raw` with its task section cut to what every task has and named `task_name` (if given)."""
    if task_name is None:
        return raw
    kept = {k: v for k, v in (raw.get("task") or {}).items() if k in TaskSettings.model_fields}
    return {**raw, "task": {**kept, "name": task_name}}


def resume_config(path: str | None = None, overrides: list[str] = (), task_name: str | None = None) -> Config:
    """`--resume`: the run's saved config, then the `key=value` overrides. The config file and
    its train.* overrides only name the run (train.output_dir, train.name); the file's other values
    are not applied, so a resumed run keeps the settings it ran under unless the command line
    changes them."""
    naming = [o for o in overrides if o.partition("=")[0].strip().startswith("train.")]
    named = load_config(path, naming, task_name).train
    run_dir = Path(named.output_dir) / named.name
    saved = saved_config(run_dir)
    try:  # a setting emapg no longer has, or an override the saved config's task does not take
        return build(with_overrides(saved, list(overrides)))
    except EmapgError as e:
        raise EmapgError(f"--resume: {run_dir / 'config.yaml'}: {e}") from None


def run_config(
    config: Config | str | None = None, overrides: list[str] = (), *, resume: bool = False,
    task_name: str | None = None,
) -> Config:  # fmt: skip
    """The one way a run's config is made, for `emapg.train` and `emapg train` alike: a Config as
    given or a YAML file (load_config; resume_config when resuming), then the overrides."""
    if isinstance(config, Config):
        raw = given_task(config.model_dump(exclude_unset=True), task_name)
        return build(with_overrides(raw, list(overrides)))
    return (resume_config if resume else load_config)(config, overrides, task_name)
