"""Bad inputs found while a run is set up (emapg.training.setup: data, model, context, checkpoint):
each stops the CLI with exit code 2 and one stderr line naming the problem, before any training
step; the search task's episode cap must fit the model's context."""

import shutil

import pytest
import yaml

from emapg.cli import main
from emapg.errors import EmapgError
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.base import Example
from emapg.tasks.search.task import TINY_EXTRA_CHARS, SearchTask
from emapg.training.config import load_config
from helpers import DictRetriever


def _missing_data(tmp, model):
    return ["task.name=math", f"task.train_files=[{tmp / 'absent.jsonl'}]"], "absent.jsonl' does not exist"


def _empty_data(tmp, model):
    (tmp / "empty.jsonl").write_text("")
    return ["task.name=math", f"task.train_files=[{tmp / 'empty.jsonl'}]"], "empty.jsonl: no records"


def _malformed_record(tmp, model):
    (tmp / "bad.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n{"problem": \n')
    return ["task.name=math", f"task.train_files=[{tmp / 'bad.jsonl'}]"], "bad.jsonl: line 2: not valid JSON"


def _prompt_too_long(tmp, model):  # the tiny model's context is 64 positions
    return [
        "rollout.max_new_tokens=60"
    ], "with rollout.max_new_tokens=60 it exceeds the model's context of 64"


def _no_eos(tmp, model):
    tok = build_tiny_tokenizer()
    build_tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(tmp / "m")
    tok.eos_token = None
    tok.save_pretrained(tmp / "m")
    return [f"model.path={tmp / 'm'}"], "the tokenizer has no eos_token"


def _corrupt_weights(tmp, model):
    shutil.copytree(model, tmp / "m")
    (tmp / "m" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return [f"model.path={tmp / 'm'}"], "expected a causal LM with safetensors weights"


def _corrupt_checkpoint(tmp, model):
    step = tmp / "quickstart" / "checkpoints" / "step_2"
    shutil.copytree(model, step / "policy")
    config = load_config(None, [f"model.path={model}", f"train.output_dir={tmp}"])  # as the run saved it
    (tmp / "quickstart" / "config.yaml").write_text(yaml.safe_dump(config.model_dump()))
    (step / "policy" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return ["--resume"], "checkpoint " + str(step) + " cannot be loaded"


def _iw_clip_strings(tmp, model):
    return ["kl.iw_clip=[a, b]"], "kl.iw_clip[0]: input should be a valid number; got 'a'"


def _betas_wrong(tmp, model):
    return [
        "optim.betas=[0.9]"
    ], "optim.betas: list should have at least 2 items after validation, not 1; got [0.9]"


def _tiny_model_setting_misspelt(tmp, model):
    # YAML reads {hidden_size:64} (no space) as one key "hidden_size:64"
    message = "warmstart.model_kwargs: build_tiny_model: unknown settings ['hidden_size:64']"
    return ["warmstart.model_kwargs={hidden_size:64}"], message


CASES = [_missing_data, _empty_data, _malformed_record, _prompt_too_long, _no_eos, _corrupt_weights,
         _corrupt_checkpoint, _iw_clip_strings, _betas_wrong, _tiny_model_setting_misspelt]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_bad_input_is_one_line_exit_2_before_training(tmp_path, tiny_model_dir, case, capsys):
    extra, message = case(tmp_path, tiny_model_dir)
    base = [f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", "train.progress=false"]
    args = [a for a in extra if a.startswith("--")] + base + [a for a in extra if not a.startswith("--")]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("emapg: error: ") and message in err, err
    assert "\n" not in err
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()  # no step ran


def test_the_episode_cap_must_fit_the_models_context():
    from types import SimpleNamespace

    from emapg.training.setup import check_context

    cfg = load_config("search_tiny")
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256))
    examples = [Example("who?\n", "a", {})]
    task = SearchTask(DictRetriever({}), [], [], max_context=320)
    with pytest.raises(EmapgError, match=r"max_context=320 \(task.max_context .* context of 256$"):
        check_context(cfg, model, tok, examples, task)
    task.max_context = 60  # a 6-token prompt and a 64-token turn do not fit
    with pytest.raises(EmapgError, match="max_new_tokens=64 it exceeds the episode cap max_context=60$"):
        check_context(cfg, model, tok, examples, task)
    task.max_context = 70
    check_context(cfg, model, tok, examples, task)


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["rollout.engine=vllm", "rollout.dtype=bfloat16", "algo.old_logp=engine"], True),
        (["rollout.engine=vllm", "algo.old_logp=engine"], True),  # vLLM's kernels, even in float32
        (["algo.old_logp=engine"], False),  # hf in the policy's dtype: the engine is the policy
        (["rollout.engine=vllm", "rollout.dtype=bfloat16"], False),  # auto recomputes
    ],
)
def test_the_engines_pi_old_beside_another_policy_is_warned_about(caplog, overrides, warned):
    from emapg.training.setup import warn_engine_pi_old

    warn_engine_pi_old(load_config(None, overrides))
    assert ("algo.old_logp=engine with rollout.engine=" in caplog.text) == warned


@pytest.mark.slow
def test_bf16_true_at_the_papers_lr_is_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    """The paper's recipes ran bfloat16 weights at lr 1e-6: refused with the share of one step's
    updates their bfloat16 weights would keep, measured on the model, and the way out."""
    args = ["train", f"model.path={tiny_model_dir}", f"train.output_dir={tmp_path}", "train.precision=bf16-true",
            "optim.lr=1e-6", "train.progress=false", "train.tensorboard=false"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "emapg: error: train.precision=bf16-true at optim.lr=1e-06: bfloat16 weights would keep "
    )
    share = float(err.split("would keep ")[1].split("%")[0])
    assert share < 10 and "train.precision=bf16-mixed" in err and "\n" not in err
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()  # no step, no log


@pytest.mark.parametrize("native, precision, warned", [(False, "bf16-mixed", True), (True, "bf16-mixed", False),
                                                       (False, "fp32", False), (None, "bf16-true", False)])  # fmt: skip
def test_bfloat16_on_a_cpu_without_it_says_so_first(monkeypatch, caplog, native, precision, warned):
    import torch

    from emapg.model import precision as precision_module
    from emapg.training.setup import warn_emulated_bf16

    monkeypatch.setattr(precision_module, "native_bf16", lambda device: native)
    warn_emulated_bf16(load_config(None, [f"train.precision={precision}"]), torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records]
    assert bool(said) == warned
    if warned:
        assert "emulated here, slower than fp32" in said[0] and "train.precision=bf16-mixed" in said[0]
