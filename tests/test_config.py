"""Config files, overrides and validation: each bad input is one line naming the field."""

import re
import subprocess
import sys

import pytest

from emapg.cli import main
from emapg.errors import EmapgError
from emapg.training.config import load_config
from emapg.training.config_reference import help_text


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
    (["kl.kk=3"], "unknown config key 'kl.kk' (did you mean 'k'?)"),
    (["kll.k=3"], "unknown config section 'kll' (did you mean 'kl'?)"),
    (["kl.k=abc"], "kl.k: input should be a valid integer; got 'abc'"),
    (["kl.k=-1"], "kl.k: input should be greater than or equal to 0; got -1"),
    (["anchor.eta=1.5"], "anchor.eta: input should be less than or equal to 1; got 1.5"),
    (["kl.estimator=k7"], "kl.estimator: unknown 'k7'"),
    (["kl.estimator=k5"], "kl estimator 'k5' estimates forward KL; got direction='reverse'"),
    (["rollout.group_size=1"], "rollout.group_size=1 has no groups for algo.advantage=grpo"),
    (["kl.beta=0"], "anchor.kind=none goes with kl.beta=0"),
    (["train.steps"], "override 'train.steps': expected key=value"),
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
