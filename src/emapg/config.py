"""Dataclass configs, YAML files and dotted command-line overrides.

Every field has a default and a one-line help string (`emapg train --help` prints them).
A YAML file mirrors the sections: `kl: {estimator: topk, k: 32}`; an override names the
field with a dot: `kl.k=16`. Unknown keys, wrong types and out-of-range values stop with
one line naming the field, before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from emapg import kl
from emapg.advantages import MODES as ADVANTAGES
from emapg.anchor import KINDS as ANCHORS
from emapg.anchor import PERIOD_UNITS
from emapg.errors import EmapgError
from emapg.policy_loss import AGGREGATIONS
from emapg.rewards import ISOLATION
from emapg.rollout import ENGINES
from emapg.rollout_correction import MODES as ROLLOUT_CORRECTIONS

DTYPES = ("float32", "bfloat16", "float16")
OLD_LOGP = ("auto", "recompute", "engine")
DEVICES = ("auto", "cpu", "cuda")
# emapg.tasks.math_data.SCHEMA_NAMES, written out so that reading a config imports no SymPy
MATH_SCHEMAS = ("auto", "olympiadbench", "gsm8k", "qwen_math", "math500", "math")


def _f(default, help: str, choices: tuple[str, ...] = ()):
    """A config field: its default, one line of help, and for a name its valid values."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    path: str = _f(
        "builtin:tiny", "causal LM: a local directory or HF cache name, or builtin:tiny (warm-started)"
    )
    dtype: str = _f("float32", "parameter dtype", DTYPES)
    chat_template: bool = _f(True, "wrap prompts in the tokenizer's chat template when it has one")


@dataclass
class WarmStartConfig:
    steps: int = _f(1500, "most supervised steps that warm-start builtin:tiny (cached by settings)")
    batch_size: int = _f(64, "supervised batch size")
    lr: float = _f(2e-3, "supervised learning rate")
    target_accuracy: float = _f(0.35, "stop SFT at this held-out sampled accuracy (0: run all steps)")
    cache_dir: str = _f("~/.cache/emapg", "where warm starts are cached")
    model_kwargs: dict = _f({}, "build_tiny_model settings, e.g. {max_position_embeddings: 256}")


@dataclass
class TaskConfig:
    name: str = _f(
        "arithmetic",
        "a registered task (emapg.tasks.register_task); search's settings: the retriever section",
    )
    seed: int = _f(1234, "seed of the generated data (independent of train.seed)")
    num_train: int = _f(4000, "training problems")
    num_eval: int = _f(200, "held-out problems for eval/accuracy")
    min_digits: int = _f(1, "arithmetic: fewest digits of an operand")
    max_digits: int = _f(2, "arithmetic: most digits of an operand")
    train_files: list = _f(
        [],
        "math: training data (.jsonl/.json/.parquet, schema told by its fields), empty: shipped samples; "
        "dataset: files (also .csv), save_to_disk directories or dataset names",
    )
    eval_files: list = _f(
        [],
        "held-out data for eval/accuracy (same formats); empty: math's shipped samples, dataset's last "
        "num_eval training records",
    )
    schema: str = _f(
        "auto",
        "math: schema of the data files; auto tells it by the fields, and question+answer by the answer "
        "(a '#### n' line: gsm8k, else qwen_math)",
        MATH_SCHEMAS,
    )
    format_reward: float = _f(0.0, "math: reward of a wrong answer given in a closed \\boxed{} (0: none)")
    prompt: str = _f(
        "", "math: prompt template with {question}; empty: Qwen2.5-Math's step-by-step \\boxed{} one"
    )
    prompt_field: str = _f("prompt", "dataset: the prompt's column: text, or chat messages [{role, content}]")
    answer_field: str = _f(
        "",
        "dataset: column of reference completions; builtin:tiny warm-starts on them (empty: on arithmetic)",
    )
    reward_fns: list = _f(
        [], "dataset: reward functions module:function or path/to/file.py:function, TRL's signature"
    )
    reward_weights: list = _f([], "dataset: one weight per reward function (empty: all 1)")
    train_split: str = _f("train", "dataset: split of a dataset name or of a saved DatasetDict, for training")
    eval_split: str = _f("test", "dataset: split of a dataset name or of a saved DatasetDict, for evaluation")
    dataset_config: str = _f("", "dataset: configuration name of a dataset (e.g. main for gsm8k)")
    reward_timeout_s: float = _f(10.0, "time limit of one score call; past it the response gets reward 0")
    reward_isolation: str = _f(
        "auto", "auto: a worker process unless the task declares score_is_safe; process; inline", ISOLATION
    )


@dataclass
class RolloutConfig:
    prompts_per_step: int = _f(32, "prompts per rollout batch")
    group_size: int = _f(8, "samples per prompt (GRPO group)")
    max_new_tokens: int = _f(
        8, "response length limit in tokens; multi-turn episodes (search): per model turn"
    )
    temperature: float = _f(1.0, "sampling temperature; the policy is softmax(logits / temperature)")
    top_p: float = _f(
        1.0, "nucleus sampling; < 1 samples from a truncated policy, corrected by algo.rollout_correction"
    )
    stop: list = _f([], "stop strings that end a response (besides EOS)")
    batch_size: int = _f(256, "sequences per generate call (training and evaluation)")
    engine: str = _f("hf", "hf (transformers generate) or vllm (colocated vLLM, see docs/vllm.md)", ENGINES)
    dtype: str = _f(
        "auto",
        "the engine's dtype; auto: model.dtype. vllm only: bfloat16 beside a float32 policy is the usual GPU set-up",
        ("auto", *DTYPES),
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3, "share of GPU memory vLLM may take (engine=vllm); on CPU the share of RAM for its KV cache"
    )
    vllm_sleep: bool = _f(
        False,
        "free vLLM's GPU memory during the anchor pass and update (KV cache dropped, weights offloaded)",
    )
    vllm_enforce_eager: bool = _f(
        False, "run vLLM without CUDA graphs or compilation (faster start, slower decoding)"
    )
    vllm_max_model_len: int = _f(0, "context vLLM reserves KV cache for (0: the model's maximum)")


@dataclass
class OptimConfig:
    lr: float = _f(2e-4, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    betas: list = _f([0.9, 0.99], "AdamW betas")
    warmup_steps: int = _f(5, "linear warm-up, in optimiser steps")
    warmup_ratio: float = _f(
        0.0, "linear warm-up as a share of all optimiser steps; > 0 overrides warmup_steps"
    )
    max_grad_norm: float = _f(1.0, "gradient clipping by global norm; 0 disables")


@dataclass
class AlgoConfig:
    advantage: str = _f("grpo", "grpo (std-normalised), drgrpo (no std) or batch_std", ADVANTAGES)
    clip_low: float = _f(0.2, "PPO ratio clip below: 1 - clip_low")
    clip_high: float = _f(0.2, "PPO ratio clip above: 1 + clip_high")
    epochs: int = _f(1, "passes over each rollout batch")
    minibatches: int = _f(1, "optimiser steps per epoch (the batch is split this many ways)")
    micro_batch_size: int = _f(64, "sequences per forward/backward (gradient accumulation)")
    micro_batch_tokens: int = _f(
        0, "pack micro-batches up to this many tokens (rows x padded length) instead; 0: by micro_batch_size"
    )
    mask_overlong: bool = _f(
        False, "leave responses cut at the length limit (no EOS or stop) out of the loss"
    )
    loss_aggregation: str = _f("token_mean", "every token weighs the same, or every sequence", AGGREGATIONS)
    old_logp: str = _f(
        "auto",
        "pi_old of the PPO ratio and the KL's top-k set: recompute (a no-grad pass of the policy), engine "
        "(the sampling engine's); auto: engine only where it is the policy itself (hf, same dtype, top_p=1)",
        OLD_LOGP,
    )
    rollout_correction: str = _f(
        "token_tis",
        "weight or drop tokens by pi_old/mu (mu: the engine that sampled). token_tis, verl's default, "
        "never drops data and does not grow with length; seq_mask (TRL's) drops most long sequences",
        ROLLOUT_CORRECTIONS,
    )
    rollout_correction_cap: float = _f(
        2.0, "C of algo.rollout_correction: weights truncated at C, masks keep ratios in [1/C, C]"
    )


@dataclass
class KLConfig:
    beta: float = _f(1e-3, "KL coefficient; 0 turns the KL off and builds no anchor")
    estimator: str = _f("topk", "token-level KL estimator (docs/design.md has the table)", kl.ESTIMATORS)
    direction: str = _f("reverse", "reverse KL(pi||ref) or forward KL(ref||pi)", kl.DIRECTIONS)
    k: int = _f(32, "top-k set size for the top-k estimators")
    importance_weight: bool = _f(
        True,
        "multiply the sampled estimate (top-k: its tail only) by s = pi/mu, mu the engine that drew the token: "
        "unbiased whenever pi != mu (later minibatches, an engine whose numbers differ); s = 1 on-policy. "
        "false reproduces recipes without it (verl, the paper's DeepScaleR scripts)",
    )
    iw_clip: list = _f(
        [], "optional [s_min, s_max] bounds on the importance weight; null: no bound on that side"
    )


@dataclass
class AnchorConfig:
    kind: str = _f("ema", "ema, frozen (eta = 1) or none (needs kl.beta = 0)", ANCHORS)
    dtype: str = _f(
        "auto", "the anchor's dtype; auto: model.dtype (docs/training.md: bf16 EMA drift)", ("auto", *DTYPES)
    )
    eta: float = _f(0.9, "EMA decay: anchor <- eta * anchor + (1 - eta) * policy")
    update_period: int = _f(10, "steps between EMA updates, counted in anchor.period_unit")
    period_unit: str = _f(
        "training_steps",
        "what update_period counts: rollout batches (the paper's) or optimiser steps",
        PERIOD_UNITS,
    )


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    r: int = _f(0, "LoRA rank; 0 trains every weight. > 0 needs peft (pip install 'emapg[lora]')")
    alpha: float = _f(32.0, "LoRA scale numerator: the adapter adds (alpha / r) * B @ A to each weight")
    dropout: float = _f(0.0, "dropout on the adapter's input while training (0: log-probs match sampling)")
    target_modules: list = _f(
        LORA_TARGETS, "modules that get adapters (Llama/Qwen names); [all-linear]: every linear but the head"
    )
    lr: float = _f(2e-3, "AdamW learning rate when lora.r > 0 (in place of optim.lr)")


@dataclass
class TrainConfig:
    name: str = _f("quickstart", "run name: outputs go to <output_dir>/<name>")
    output_dir: str = _f("runs", "where runs are written")
    seed: int = _f(0, "seed of sampling, shuffling and initialisation")
    steps: int = _f(40, "rollout batches (training steps)")
    eval_every: int = _f(10, "evaluate every this many steps (and at the start and end)")
    save_every: int = _f(20, "checkpoint every this many steps (and at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept; older ones are deleted")
    max_bad_steps: int = _f(
        5, "stop after this many optimiser steps in a row with a non-finite loss/gradient"
    )
    threads: int = _f(0, "torch CPU threads; 0 leaves torch's default")
    device: str = _f("auto", "auto: cuda when available, else cpu", DEVICES)
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass (less memory)")
    tensorboard: bool = _f(True, "write TensorBoard events when tensorboard is installed")
    wandb: bool = _f(False, "log to Weights & Biases (needs wandb)")
    progress: bool = _f(True, "show a progress bar")


@dataclass
class RetrieverConfig:
    corpus: str = _f(
        "", "search: jsonl corpus (id, contents = title line + text); empty: the built-in world's"
    )
    url: str = _f("", "search: a Search-R1 retrieval server (http://host:port/retrieve) instead of BM25")
    max_queries_per_request: int = _f(
        512,
        "search: most queries per POST to retriever.url; bigger batches are split into several "
        "requests (emapg serve-retriever accepts 4096 by default: --max-queries)",
    )
    topk: int = _f(3, "search: passages returned per query")
    max_turns: int = _f(
        4, "search: rounds with the environment (search or invalid-action message), then one final turn"
    )
    max_observation_tokens: int = _f(
        500, "search: inserted text (passages, messages) cut to this many tokens"
    )
    max_context: int = _f(
        4096, "search: prompt + episode tokens cap; a turn gets at most the room left, a full episode ends"
    )
    format_reward: float = _f(0.0, "search: reward of a well-formed but wrong <answer>")
    train_file: str = _f("", "search: Search-R1 parquet training data; empty: the built-in world")
    eval_file: str = _f("", "search: Search-R1 parquet evaluation data (needed with train_file)")
    world_people: int = _f(100, "built-in world: people (two questions each)")
    world_cities: int = _f(10, "built-in world: cities")


@dataclass
class EvalConfig:
    greedy: bool = _f(
        False, "greedy decoding for eval/accuracy (default: sampled at the rollout temperature)"
    )
    samples: int = _f(4, "sampled responses per held-out problem; eval/accuracy is their mean (pass@1)")
    temperature: float = _f(1.0, "sampling temperature of evaluation (its own, not the rollout's)")
    top_p: float = _f(1.0, "nucleus sampling of evaluation")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)


CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def _suggest(name: str, options) -> str:
    """The option that extends `name` (a renamed value: seq_mean -> seq_mean_token_mean), else the
    closest spelling, as a hint."""
    longer = [o for o in options if str(o).startswith(name)] if name else []
    close = longer or difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(where: str, value, typ):
    """Check `value` against the field type; ints are accepted for floats."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if typ is list and isinstance(value, tuple):
        return list(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise EmapgError(f"{where}: expected {typ.__name__}, got {value!r:.80}")
    if typ is float and not math.isfinite(value):  # YAML reads .nan and .inf as floats
        raise EmapgError(f"{where}: expected a finite number, got {value}")
    return value


def _set(cfg: Config, dotted: str, value) -> None:
    section_name, _, key = dotted.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections or not key:
        raise EmapgError(f"unknown config section {section_name!r}{_suggest(section_name, sections)}")
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        raise EmapgError(f"unknown config key {dotted!r}{_suggest(key, hints)}")
    setattr(section, key, _coerce(dotted, value, hints[key]))


def _from_mapping(cfg: Config, data: dict, source: str) -> None:
    if not isinstance(data, dict):
        raise EmapgError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise EmapgError(f"{source}: section {section!r} must be a mapping, got {values!r}")
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)


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


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file (default: the quickstart), then `key=value` overrides."""
    cfg = Config()
    file = resolve_config_path(path or "quickstart")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise EmapgError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
    _from_mapping(cfg, data, str(file))
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> None:
    """Set each `key=value` (the value read as YAML) on `cfg`; validate afterwards."""
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq:
            raise EmapgError(f"override {item!r}: expected key=value, e.g. kl.k=16")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set(cfg, key.strip(), value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise EmapgError(message)


def rollout_dtype(cfg: Config) -> str:
    """The engine's dtype: rollout.dtype, or the policy's for auto."""
    return cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def anchor_dtype(cfg: Config) -> str:
    """The anchor's dtype: anchor.dtype, or the policy's for auto."""
    return cfg.model.dtype if cfg.anchor.dtype == "auto" else cfg.anchor.dtype


def recomputes_old_logp(cfg: Config) -> bool:
    """Whether pi_old comes from a no-grad pass of the trainer's policy rather than the engine.

    auto skips the pass only where the engine is the policy itself: the hf engine samples with
    the live module in model.dtype, so at top_p = 1 its recorded log-probs are pi_old already
    (the same weights and kernels, up to the KV cache's rounding) and a pass would change nothing.
    vLLM has kernels (and on a GPU a dtype) of its own, and top_p < 1 samples from a truncated
    distribution: there the engine's log-probs are mu, not pi_old."""
    if cfg.algo.old_logp != "auto":
        return cfg.algo.old_logp == "recompute"
    return not (
        cfg.rollout.engine == "hf" and rollout_dtype(cfg) == cfg.model.dtype and cfg.rollout.top_p == 1
    )


def _check_engine(cfg: Config) -> None:
    """What each engine and the off-policy settings support, checked before any import."""
    r = cfg.rollout
    _check(
        r.engine == "vllm" or rollout_dtype(cfg) == cfg.model.dtype,
        f"rollout.dtype={r.dtype} needs rollout.engine=vllm: the hf engine samples with the policy itself, "
        f"in model.dtype={cfg.model.dtype}",
    )
    _check(
        cfg.algo.old_logp != "engine" or r.top_p == 1,
        "algo.old_logp=engine with rollout.top_p < 1 would take the nucleus-truncated sampling "
        "distribution for pi_old; use algo.old_logp=recompute (or auto)",
    )
    _check(
        cfg.algo.rollout_correction_cap > 1,
        f"algo.rollout_correction_cap must be > 1; got {cfg.algo.rollout_correction_cap}",
    )
    _check(
        not cfg.lora.r or anchor_dtype(cfg) == cfg.model.dtype,
        f"anchor.dtype={cfg.anchor.dtype}: with LoRA the anchor is an adapter of the policy's own model, "
        f"in model.dtype={cfg.model.dtype}",
    )
    if r.engine != "vllm":
        return
    _check(0 < r.vllm_gpu_memory_utilization < 1, "rollout.vllm_gpu_memory_utilization must be in (0, 1)")
    _check(r.vllm_max_model_len >= 0, "rollout.vllm_max_model_len must be >= 0 (0: the model's maximum)")


def _check_lora(cfg: Config) -> None:
    lo = cfg.lora
    _check(lo.r >= 0, f"lora.r must be >= 0 (0: no LoRA); got {lo.r}")
    _check(lo.alpha > 0, f"lora.alpha must be > 0; got {lo.alpha}")
    _check(0 <= lo.dropout < 1, f"lora.dropout must be in [0, 1); got {lo.dropout}")
    _check(
        bool(lo.target_modules) and all(isinstance(m, str) and m for m in lo.target_modules),
        f"lora.target_modules must be a non-empty list of module names; got {lo.target_modules!r:.80}",
    )
    _check(lo.lr > 0, f"lora.lr must be > 0; got {lo.lr}")


def _numbers(values: list) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _exists(path: str, file: bool = False) -> bool:
    try:  # "~nobody/x" (unknown user) raises instead of answering False
        found = Path(path).expanduser()
    except RuntimeError:
        return False
    return found.is_file() if file else found.exists()


def _check_choices(cfg: Config) -> None:
    """Every field with named values holds one of them."""
    for section in dataclasses.fields(Config):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            choices = f.metadata["choices"]
            value = getattr(values, f.name)
            _check(
                not choices or value in choices,
                f"{section.name}.{f.name}: unknown {value!r}{_suggest(str(value), choices)}; "
                f"expected one of {', '.join(choices)}",
            )


def validate(cfg: Config) -> None:
    """Ranges and combinations, each failure one line naming the field."""
    from emapg.tasks import task_names  # late: user code may register tasks after importing config

    _check_choices(cfg)
    _check(
        _numbers(cfg.optim.betas) and len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas),
        f"optim.betas must be two numbers in [0, 1); got {cfg.optim.betas!r:.80}",
    )
    _check(cfg.rollout.group_size >= 1, "rollout.group_size must be >= 1")
    _check(cfg.rollout.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1")
    _check(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    _check(cfg.rollout.temperature > 0, "rollout.temperature must be > 0")
    _check(0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]")
    _check(all(isinstance(s, str) and s for s in cfg.rollout.stop), "rollout.stop must be non-empty strings")
    _check_engine(cfg)
    _check(
        cfg.algo.advantage == "drgrpo" or cfg.rollout.group_size >= 2,
        f"rollout.group_size=1 has no group std for algo.advantage={cfg.algo.advantage!r}; use drgrpo",
    )
    _check(
        cfg.algo.clip_low >= 0 and cfg.algo.clip_high >= 0, "algo.clip_low and algo.clip_high must be >= 0"
    )
    _check(cfg.algo.clip_low < 1, "algo.clip_low must be < 1")
    _check(
        cfg.algo.epochs >= 1 and cfg.algo.minibatches >= 1, "algo.epochs and algo.minibatches must be >= 1"
    )
    _check(cfg.algo.micro_batch_size >= 1, "algo.micro_batch_size must be >= 1")
    _check(cfg.algo.micro_batch_tokens >= 0, "algo.micro_batch_tokens must be >= 0 (0: by micro_batch_size)")
    _check(0 <= cfg.optim.warmup_ratio < 1, "optim.warmup_ratio must be in [0, 1)")
    _check(cfg.eval.temperature > 0, "eval.temperature must be > 0")
    _check(0 < cfg.eval.top_p <= 1, "eval.top_p must be in (0, 1]")
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    _check(
        batch % cfg.algo.minibatches == 0,
        f"algo.minibatches={cfg.algo.minibatches} must divide the {batch} sequences",
    )
    _check(cfg.kl.beta >= 0, "kl.beta must be >= 0")
    kl.check_estimator(cfg.kl.estimator, cfg.kl.direction)
    _check(cfg.kl.k >= 0, "kl.k must be >= 0")
    bounds = [b for b in cfg.kl.iw_clip if b is not None]  # null: no bound on that side
    _check(_numbers(bounds), f"kl.iw_clip must hold numbers; got {cfg.kl.iw_clip!r:.80}")
    _check(
        cfg.kl.iw_clip == []
        or (len(cfg.kl.iw_clip) == 2 and all(b >= 0 for b in bounds) and bounds == sorted(bounds)),
        f"kl.iw_clip must be [] or [s_min, s_max] with 0 <= s_min <= s_max (null: no bound); got {cfg.kl.iw_clip}",
    )
    _check(0 <= cfg.anchor.eta <= 1, f"anchor.eta must be in [0, 1]; got {cfg.anchor.eta}")
    _check(cfg.anchor.update_period >= 1, "anchor.update_period must be >= 1")
    _check(
        (cfg.anchor.kind == "none") == (cfg.kl.beta == 0),
        "anchor.kind=none goes with kl.beta=0 and only then (a KL needs an anchor)",
    )
    _check_lora(cfg)
    _check(0 <= cfg.warmstart.target_accuracy <= 1, "warmstart.target_accuracy must be in [0, 1]")
    _check_tiny_model_kwargs(cfg.warmstart.model_kwargs)
    _check(cfg.train.steps >= 0, "train.steps must be >= 0")
    _check(
        cfg.train.eval_every >= 1 and cfg.train.save_every >= 1,
        "train.eval_every, train.save_every must be >= 1",
    )
    _check(cfg.eval.samples >= 1, "eval.samples must be >= 1")
    _check(cfg.train.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1")
    _check(cfg.train.max_bad_steps >= 1, "train.max_bad_steps must be >= 1")
    _check(cfg.task.reward_timeout_s > 0, "task.reward_timeout_s must be > 0")
    r = cfg.retriever
    _check(r.topk >= 1 and r.max_turns >= 1, "retriever.topk and retriever.max_turns must be >= 1")
    _check(0 <= r.format_reward < 1, "retriever.format_reward must be in [0, 1)")
    _check(r.max_queries_per_request >= 1, "retriever.max_queries_per_request must be >= 1")
    _check(
        r.max_observation_tokens >= 1 and r.max_context >= 1,
        "retriever.max_observation_tokens and retriever.max_context must be >= 1",
    )
    _check(
        bool(r.train_file) == bool(r.eval_file), "retriever.train_file and retriever.eval_file go together"
    )
    _check(r.world_people >= 2 and r.world_cities >= 1, "retriever.world_people >= 2, world_cities >= 1")
    _check(not r.train_file or bool(r.corpus or r.url), "retriever.train_file needs retriever.corpus or .url")
    for key in ("train_file", "eval_file", "corpus"):
        f = getattr(r, key)
        _check(not f or Path(f).expanduser().is_file(), f"retriever.{key}: {f!r} does not exist")
    _check(
        cfg.task.name in task_names(),
        f"task.name: unknown {cfg.task.name!r}{_suggest(cfg.task.name, task_names())}; "
        f"registered: {', '.join(task_names())}",
    )
    for key in ("train_files", "eval_files"):
        for f in getattr(cfg.task, key):
            _check(isinstance(f, str), f"task.{key}: expected paths or names, got {f!r:.60}")
            # dataset: directories and dataset names too, checked when the task loads its data
            _check(cfg.task.name == "dataset" or _exists(f, file=True), f"task.{key}: {f!r} does not exist")
    _check(bool(cfg.task.prompt_field), "task.prompt_field must name a column")
    _check(
        _numbers(cfg.task.reward_weights),
        f"task.reward_weights must be numbers; got {cfg.task.reward_weights!r:.80}",
    )
    _check(0 <= cfg.task.format_reward < 1, "task.format_reward must be in [0, 1)")
    _check(not cfg.task.prompt or "{question}" in cfg.task.prompt, "task.prompt must contain {question}")
    path = cfg.model.path  # a path (not a hub name) must exist: catches the placeholder of math_qwen
    _check(
        not path.startswith(("/", ".", "~")) or _exists(path),
        f"model.path {path!r} does not exist; set model.path=DIR to a local model directory",
    )


def _check_tiny_model_kwargs(kwargs) -> None:
    """warmstart.model_kwargs: a mapping of build_tiny_model's settings (e.g. {hidden_size: 64})."""
    _check(isinstance(kwargs, dict), f"warmstart.model_kwargs must be a mapping; got {kwargs!r}")
    if kwargs:
        import inspect

        from emapg.models import build_tiny_model

        known = sorted(n for n in inspect.signature(build_tiny_model).parameters if n != "tokenizer")
        unknown = sorted(set(kwargs) - set(known))
        _check(
            not unknown,
            f"warmstart.model_kwargs: unknown settings {unknown} (write {{name: value}}, a space after "
            f"the colon); expected some of {known}",
        )


def validate_world(cfg: Config, world: int) -> None:
    """What multi-process training (torchrun, `world` processes) supports; one line each."""
    if world == 1:
        return
    _check(
        cfg.rollout.prompts_per_step % world == 0,
        f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the {world} "
        "processes (each rank takes whole groups)",
    )
    _check(
        cfg.lora.r == 0,
        f"lora.r={cfg.lora.r}: LoRA runs in one process (FSDP2 sharding of peft adapters is not supported); "
        f"torchrun started {world}",
    )


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def help_text() -> str:
    """Every field with its default and meaning, for `emapg train --help`."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f" [{' | '.join(f.metadata['choices'])}]" if f.metadata["choices"] else ""
            lines.append(f"  {section.name}.{f.name} = {default!r}  -- {f.metadata['help']}{choices}")
    return "\n".join(lines)


# Section introductions of the generated reference (docs/configuration.md).
SECTION_INTROS = {
    "model": "The policy model: where it comes from and in which dtype it trains.",
    "warmstart": "The supervised warm start that makes the built-in tiny model able to answer at all.",
    "task": "Which task supplies prompts and rewards, its data and how rewards are computed safely.",
    "rollout": "How responses are sampled: batch shape, length, temperature and the engine.",
    "optim": "The AdamW optimiser and its schedule.",
    "algo": "The policy-gradient algorithm: advantages, PPO clipping, epochs and batching.",
    "kl": "The KL regulariser: its coefficient, estimator, direction and top-k set size.",
    "anchor": "The KL anchor: frozen reference or an EMA of the policy.",
    "lora": "LoRA (through peft): adapters instead of every weight; the anchor is an adapter too (docs/training.md).",
    "train": "The run: name, length, evaluation and checkpoint cadence, logging and device.",
    "eval": "Held-out evaluation during training (eval/accuracy).",
    "retriever": "The search task: retriever, corpus, data and episode limits.",
}

REGENERATE = "python -m emapg.config > docs/configuration.md"


def _md_value(value) -> str:
    """A default as one would write it in a YAML file or an override, in a code span."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if value else '""'
    elif isinstance(value, list | dict):
        text = yaml.safe_dump(value, default_flow_style=True).strip()
    else:
        text = repr(value)
    return "`" + text.replace("|", "\\|") + "`"


def _md_text(text: str) -> str:
    """Help text in a table cell: no raw |, <, > or * for the markdown renderer to take."""
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def markdown_reference() -> str:
    """docs/configuration.md: every config section as a table of field, default and meaning."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from src/emapg/config.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "This page is generated from the dataclasses in `src/emapg/config.py` (each field's",
        f"default and help string). Regenerate it with `{REGENERATE}`;",
        "`tests/test_docs.py` fails when it is stale.",
        "",
        "A run's config is built in three layers: the dataclass defaults below, then a YAML file",
        "(`--config NAME` for a shipped config in `src/emapg/configs/`, or a path), then dotted",
        "overrides on the command line (`kl.k=16 anchor.eta=0.95`). A YAML file mirrors the",
        "sections (`kl: {estimator: topk, k: 32}`); override values are read as YAML",
        "(`task.train_files=[a.jsonl,b.jsonl]`). An unknown key, a wrong type or an out-of-range",
        "value stops with one line naming the field. `emapg train --help` prints the same list.",
        "",
    ]
    for section in dataclasses.fields(Config):
        lines += [f"## {section.name}", ""]
        if section.name in SECTION_INTROS:
            lines += [SECTION_INTROS[section.name], ""]
        lines += ["| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(
                f"| `{section.name}.{f.name}` | {_md_value(default)} | {_md_text(f.metadata['help'])} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_reference(), end="")
