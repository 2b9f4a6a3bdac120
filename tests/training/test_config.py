"""Config files, overrides and validation (emapg.training.config): each bad input is one line naming
the field; property tests of the overrides (none may raise but EmapgError, none may hang); the
off-policy settings: when pi_old is recomputed, and their one-line errors."""

import re
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from emapg.cli import main
from emapg.errors import EmapgError
from emapg.training.config import load_config
from emapg.training.config_reference import help_text, reference


def test_defaults_file_and_overrides_compose(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl:\n  k: 8\nanchor:\n  eta: 0.5\n")
    cfg = load_config(
        str(path), ["kl.k=16", "optim.lr=1", "optim.weight_decay=1e-2", 'rollout.stop=["\\n", "."]']
    )
    assert cfg.kl.k == 16 and cfg.anchor.eta == 0.5
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.stop == ["\n", "."]
    assert cfg.optim.weight_decay == 0.01
    assert cfg.train.name == "c"  # a run the file does not name is named after the file


def test_grpo_and_ema_pg_differ_only_in_anchor_kl_and_name():
    grpo, ema = load_config("grpo"), load_config("ema_pg")
    assert (grpo.anchor.kind, grpo.kl.estimator) == ("frozen", "k3")
    assert (ema.anchor.kind, ema.anchor.eta, ema.anchor.update_period) == ("ema", 0.9, 10)
    assert (ema.kl.estimator, ema.kl.direction, ema.kl.k, ema.kl.importance_weight) == (
        "topk",
        "reverse",
        32,
        True,
    )
    assert grpo.kl.beta == ema.kl.beta == 1e-3
    for section in ("model", "task", "rollout", "optim", "algo", "eval", "warmstart"):
        assert getattr(grpo, section) == getattr(ema, section), section
    assert grpo.train.steps == ema.train.steps


BAD = [
    (["kl.kk=3"], "unknown config key 'kl.kk' (did you mean 'kl.k'?)"),  # the key as it is typed
    (["kll.k=3"], "unknown config section 'kll' (did you mean 'kl'?)"),
    (["kl.k=abc"], "kl.k: input should be a valid integer; got 'abc'"),
    (["kl.k=-1"], "kl.k: input should be greater than or equal to 0; got -1"),
    (["anchor.eta=1.5"], "anchor.eta: input should be less than or equal to 1; got 1.5"),
    (["kl.estimator=k7"], "kl.estimator: unknown 'k7'"),
    (["kl.estimator=k5"], "kl estimator 'k5' estimates forward KL; got direction='reverse'"),
    (["rollout.group_size=1"], "rollout.group_size=1 has no groups for algo.advantage=grpo"),
    (["kl.beta=0"], "anchor.kind=none goes with kl.beta=0"),
    (["train.steps"], "override 'train.steps': expected key=value"),
    (
        ["output_dir=runs"],
        "override 'output_dir=runs': expected section.key=value (did you mean 'train.output_dir'?)",
    ),
    (["seed=1"], "(did you mean 'task.seed' or 'train.seed'?)"),
    (["train_files=x.jsonl"], "(did you mean 'task.train_files'?)"),
    (["dtype=bfloat16"], "(did you mean 'rollout.dtype' or 'anchor.dtype'?)"),
    (["model.dtype=bfloat16"], "config key 'model.dtype' moved: the training dtype is train.precision now"),
    (["train.precision=bf16"], "train.precision: unknown 'bf16'"),
    (["train.precision=fp16-mixed"], "train.precision: unknown 'fp16-mixed'"),
    (["algo.minibatches=3"], "algo.minibatches=3 must divide the 256 sequences"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_config_is_one_line_exit_2(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("emapg: error: ") and message in err
    assert "\n" not in err


def test_iw_clip_accepts_one_sided_bounds():
    assert load_config(None, ["kl.iw_clip=[null, 5]"]).kl.iw_clip == [None, 5]
    assert load_config(None, ["kl.iw_clip=[0.2, null]"]).kl.iw_clip == [0.2, None]
    assert load_config(None, ["kl.iw_clip=[null, null]"]).kl.iw_clip == [None, None]
    assert load_config(None, ["kl.iw_clip=[0.5, 2]"]).kl.iw_clip == [0.5, 2]
    assert load_config(None, []).kl.iw_clip == []


@pytest.mark.parametrize(
    "value,message",
    [
        ("[5, 1]", "kl.iw_clip must be [] or [s_min, s_max] with 0 <= s_min <= s_max"),
        ("[-1, null]", "kl.iw_clip must be [] or [s_min, s_max] with 0 <= s_min <= s_max"),
        ("[null, -1]", "kl.iw_clip must be [] or [s_min, s_max] with 0 <= s_min <= s_max"),
        ("[1]", "kl.iw_clip must be [] or [s_min, s_max]"),
        ("[1, 2, 3]", "kl.iw_clip must be [] or [s_min, s_max]"),
        ("[null, .inf]", "kl.iw_clip[1]: input should be a finite number"),
        ("[null, b]", "kl.iw_clip[1]: input should be a valid number"),
    ],
)
def test_iw_clip_bad_bounds_raise_one_line(value, message):
    with pytest.raises(EmapgError, match=re.escape(message)) as info:
        load_config(None, [f"kl.iw_clip={value}"])
    assert "\n" not in str(info.value)


def test_missing_config_file_and_bad_yaml(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        "not found (shipped configs: " in err
        and "grpo, " in err
        and "paper/deepscaler_r1_distill_1.5b_8k" in err
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl: [1, 2\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_missing_model_path_fails_before_work(tmp_path, capsys):
    code = main(["train", f"model.path={tmp_path / 'absent'}", f"train.output_dir={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "absent" in err and "does not exist" in err
    assert not (tmp_path / "quickstart").exists()


@pytest.mark.slow
def test_help_lists_every_field_with_default():
    text = help_text()
    assert "kl.k = 32  -- top-k set size" in text
    assert "anchor.eta = 0.9" in text
    out = subprocess.run(
        [sys.executable, "-m", "emapg", "train", "--help"], capture_output=True, text=True, check=True
    )
    assert "train.steps = " in out.stdout and "rollout.group_size = 8" in out.stdout


def test_a_renamed_value_suggests_its_new_name():
    with pytest.raises(EmapgError, match=r"unknown 'seq_mean' \(did you mean 'seq_mean_token_mean'\?\)"):
        load_config(None, ["algo.loss_aggregation=seq_mean"])


KEYS = sorted({name for _, _, rows in reference() for name, _, _ in rows})  # every task's, every engine's


# Values YAML reads as other types, and paths that make pathlib raise ("~nobody": unknown user).
ODD_VALUES = st.sampled_from(
    ["~nobody/x", "[~nobody]", "[a, 1]", ".nan", "-.inf", "[]", "{}", "null", "1e400"]
)


@pytest.mark.slow
@settings(max_examples=300, deadline=1000)
@example("model.path", "~nobody/x", True)  # once a RuntimeError from Path.expanduser
@example("task.train_files", "[~nobody]", True)
@example("rollout.engine", "[~nobody]", True)  # once a TypeError: a list as a registry key
@given(st.sampled_from(KEYS) | st.text(max_size=20), ODD_VALUES | st.text(max_size=30), st.booleans())
def test_overrides_load_or_fail_with_emapg_error(key, value, with_equals):
    try:
        load_config(None, [f"{key}={value}" if with_equals else key])
    except EmapgError as e:
        assert "\n" not in str(e)


@settings(max_examples=50, deadline=1000)
@given(st.integers(-(10**6), 10**6))
def test_integer_override_is_parsed_exactly(k):
    if k < 0:
        with pytest.raises(EmapgError, match="kl.k: input should be greater than or equal to 0"):
            load_config(None, [f"kl.k={k}"])
    else:
        assert load_config(None, [f"kl.k={k}"]).kl.k == k


@pytest.mark.parametrize(
    "overrides, recompute",
    [
        ([], False),
        (["rollout.top_p=0.9"], True),
        (["rollout.engine=vllm"], True),
        (["rollout.engine=vllm", "algo.old_logp=engine"], False),
        (["algo.old_logp=recompute"], True),
        # bfloat16 rounds the KV cache's decode and the update's pass over whole rows differently
        (["train.precision=bf16-mixed"], True),
        (["train.precision=bf16-true"], True),
    ],
)
def test_when_pi_old_is_recomputed(overrides, recompute):
    assert load_config(None, overrides).recomputes_old_logp is recompute


@pytest.mark.parametrize(
    "precision, params, compute, engine, anchor",
    [
        ("fp32", "float32", torch.float32, "float32", "float32"),
        # float32 master weights and anchor (a bfloat16 EMA loses its updates), a bfloat16 engine
        ("bf16-mixed", "float32", torch.bfloat16, "bfloat16", "float32"),
        ("bf16-true", "bfloat16", torch.bfloat16, "bfloat16", "bfloat16"),
    ],
)
def test_precision_sets_every_dtype_it_implies(precision, params, compute, engine, anchor):
    cfg = load_config(None, [f"train.precision={precision}", "rollout.engine=vllm"])
    assert (cfg.param_dtype, cfg.compute_dtype, cfg.engine_dtype, cfg.anchor_dtype) == (
        params,
        compute,
        engine,
        anchor,
    )
    own = load_config(None, [f"train.precision={precision}", "rollout.engine=vllm", "rollout.dtype=float32",
                             "anchor.dtype=bfloat16"])  # fmt: skip
    assert (own.engine_dtype, own.anchor_dtype) == ("float32", "bfloat16")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.dtype=bfloat16"],
            r"^unknown config key 'rollout.dtype': a setting of rollout.engine=vllm",
        ),
        (["algo.old_logp=engine", "rollout.top_p=0.9"], r"^algo.old_logp=engine with rollout.top_p < 1"),
        (["algo.rollout_correction_cap=1"], r"^algo.rollout_correction_cap: input should be greater than 1"),
        (["algo.rollout_correction=tis"], r"^algo.rollout_correction: unknown 'tis'"),
        (["algo.old_logp=trainer"], r"^algo.old_logp: unknown 'trainer'"),
        (["lora.r=8", "anchor.dtype=bfloat16"], r"^anchor.dtype=bfloat16: with LoRA"),
    ],
)
def test_off_policy_config_errors_are_one_line(overrides, message):
    with pytest.raises(EmapgError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
