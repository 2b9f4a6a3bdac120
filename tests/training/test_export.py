"""`emapg export`: a checkpoint's policy or EMA anchor as a Hugging Face folder that
from_pretrained loads to the very model emapg's own checkpoint loader restores."""

import shutil

import pytest
import torch
from safetensors.torch import load_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from emapg import cli
from emapg.errors import EmapgError
from emapg.model.anchor import Anchor
from emapg.model.models import build_tiny_model, build_tiny_tokenizer, load_model_and_tokenizer
from emapg.training import checkpoint
from emapg.training import loop as trainer
from emapg.training.config import load_config
from emapg.training.export import export
from emapg.training.optim import OptimSettings, make_optimizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}="
ETA = 0.5
STEPS = ("task.num_train=16", "task.num_eval=4", "eval.samples=1", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "rollout.max_new_tokens=4", "algo.micro_batch_size=8",
         "train.progress=false", "train.tensorboard=false", "train.steps=2", "train.eval_every=100",
         "train.save_every=1", "train.keep_checkpoints=5", "task.reward_isolation=inline",
         "kl.estimator=k1", "kl.beta=1.0")  # fmt: skip
# k1: its sampled gradient moves the weights even where the random model earns no reward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model (tied embedding) with a chat template, which the export must carry."""
    path = tmp_path_factory.mktemp("model")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train(model_dir, out, *extra):
    overrides = [f"model.path={model_dir}", f"train.output_dir={out}", "train.name=run", *STEPS, *extra]
    trainer.train(load_config(None, overrides))
    return out / "run"


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    # An EMA halfway to the policy every step: anchor, policy and start are three models.
    return train(model_dir, tmp_path_factory.mktemp("runs"), f"anchor.eta={ETA}", "anchor.update_period=1",
                 "optim.lr=0.01")  # fmt: skip


def restored(model_dir, path):
    """Policy and anchor of checkpoint `path` as resuming restores them (checkpoint.load)."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    anchor = Anchor(policy, ETA, 1)
    optimizer, scheduler = make_optimizer(policy.parameters(), OptimSettings(), 0.01, 2)
    checkpoint.load(path, policy=policy, anchor=anchor, optimizer=optimizer, scheduler=scheduler)
    return policy, anchor.model


def logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits, dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 2])
def test_exported_policy_and_anchor_load_as_the_checkpoint(run, model_dir, tmp_path, step):
    ids = torch.arange(4, 40).reshape(2, 18)
    policy, anchor = restored(model_dir, run / "checkpoints" / f"step_{step}")
    start = logprobs(AutoModelForCausalLM.from_pretrained(model_dir), ids)
    for which, want in (("policy", policy), ("anchor", anchor)):
        out = tmp_path / which
        export(run, out, step if step == 1 else None, anchor=which == "anchor")  # None: the last
        got = AutoModelForCausalLM.from_pretrained(out)
        assert got.lm_head.weight is got.model.embed_tokens.weight  # tied again, as the run's model
        # Same float32 weights, same code: the log-probs are equal bit for bit.
        assert torch.equal(logprobs(got, ids), logprobs(want, ids))
        assert not torch.equal(logprobs(got, ids), start)  # trained: the check can tell models apart
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer.chat_template == TEMPLATE
        assert tokenizer("12+3")["input_ids"] == build_tiny_tokenizer()("12+3")["input_ids"]
    assert not torch.equal(logprobs(policy, ids), logprobs(anchor, ids))


@pytest.mark.slow
def test_command_exports_in_the_models_own_dtype_or_the_one_asked_for(model_dir, tmp_path, capsys):
    # An anchor kept in bfloat16 beside the float32 policy: exported in the model's own float32 (the
    # bfloat16 values widened exactly), or with --dtype bfloat16 as they are.
    run16 = train(model_dir, tmp_path, "anchor.dtype=bfloat16", "optim.lr=0.01", "train.save_every=2")
    saved = load_model_and_tokenizer(run16 / "checkpoints" / "step_2" / "policy", dtype=torch.bfloat16)[0]
    load_model(saved, str(run16 / "checkpoints" / "step_2" / "anchor.safetensors"))
    for flags, dtype in (([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)):
        out = tmp_path / f"exported-{dtype}"
        out.mkdir()  # an empty folder is taken
        assert cli.main(["export", str(run16), "--anchor", "--out", str(out), *flags]) == 0
        said = capsys.readouterr().out
        assert (
            f"exported the anchor of {run16 / 'checkpoints' / 'step_2'} to {out} in {str(dtype)[6:]}" in said
        )
        got = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        assert got.dtype == dtype
        for a, b in zip(got.parameters(), saved.parameters(), strict=True):
            assert torch.equal(a, b.to(dtype))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_the_models_own_dtype_is_what_its_path_holds(tmp_path):
    from emapg.training.export import own_dtype

    tokenizer = build_tiny_tokenizer()
    for dtype in (torch.bfloat16, torch.float32):
        model_dir = tmp_path / str(dtype)
        build_tiny_model(tokenizer, hidden_size=32, num_layers=1).to(dtype).save_pretrained(model_dir)
        run_dir = tmp_path / f"run-{dtype}"
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(f"model:\n  path: {model_dir}\n")
        assert own_dtype(run_dir, torch.float16) == dtype
    (run_dir / "config.yaml").write_text(f"model:\n  path: {tmp_path / 'gone'}\n")
    assert own_dtype(run_dir, torch.float16) == torch.float16  # the model is gone: the checkpoint's
    (run_dir / "config.yaml").write_text("model:\n  path: builtin:tiny\n")
    assert own_dtype(run_dir, torch.float16) == torch.float32


@pytest.mark.slow
def test_refusals_name_what_is_wrong(run, model_dir, tmp_path, capsys):
    with pytest.raises(EmapgError, match="no such run directory"):
        export(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(EmapgError, match=r"no checkpoint step_7; saved: step_1, step_2"):
        export(run, tmp_path / "out", 7)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(EmapgError, match="exists and is not an empty folder; export never overwrites"):
        export(run, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    weights = damaged / "checkpoints" / "step_2" / "anchor.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(EmapgError, match="anchor.safetensors cannot be read"):
        export(damaged, tmp_path / "out", anchor=True)
    # A run without an anchor, and a LoRA run, whose anchor is an adapter on a base not saved.
    bare = train(model_dir, tmp_path / "bare", "anchor.kind=none", "kl.beta=0", "train.steps=1")
    assert cli.main(["export", str(bare), "--anchor", "--out", str(tmp_path / "out")]) == 2
    assert "emapg: error: " in capsys.readouterr().err
    with pytest.raises(EmapgError, match="no anchor.safetensors"):
        export(bare, tmp_path / "out", anchor=True)
    lora = train(model_dir, tmp_path / "lora", "lora.r=4", "train.steps=1")
    with pytest.raises(EmapgError, match="LoRA run's anchor is an adapter"):
        export(lora, tmp_path / "out", anchor=True)
    assert not (tmp_path / "out").exists()
    # Its policy is saved merged: exported as any other.
    export(lora, tmp_path / "out")
    merged = load_model_and_tokenizer(lora / "checkpoints" / "step_1" / "policy")[0]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(got.parameters(), merged.parameters(), strict=True))
