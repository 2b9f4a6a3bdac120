"""Multi-process training (torchrun, FSDP2, gloo on CPU) against one process.

One 2-process run (checkpoint every step; 5 eval problems, so rank 1's eval slice is padded;
two minibatches per step, split unevenly between the ranks, so their micro-batch counts differ
and the shorter rank runs padding passes)
serves three checks: its parameters and metrics equal
a 1-process run on the same global batch, its sharded EMA anchor equals the formula applied to
its gathered policy trajectory, and a 2-process run stopped at step 2 and resumed equals it.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from emapg import cli
from emapg.errors import EmapgError
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.arithmetic import ArithmeticTask
from emapg.tasks.search.task import TINY_EXTRA_CHARS
from emapg.training.config import load_config
from emapg.training.sft import sft
from helpers import SEARCH_ARGS, torchrun

ETA, PERIOD, STEPS = 0.5, 2, 4
TASK = ["task.num_train=40", "task.num_eval=5", "task.min_digits=1", "task.max_digits=1"]
ARGS = ["eval.samples=1", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "algo.micro_batch_size=3", "algo.minibatches=2", "train.progress=false",
        "train.tensorboard=false", "train.eval_every=2", "train.save_every=1", "train.keep_checkpoints=10",
        "train.threads=1", "optim.lr=1e-2", "kl.beta=0.1", "kl.k=4", f"anchor.eta={ETA}",
        f"anchor.update_period={PERIOD}"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny 2-layer Llama briefly fine-tuned on 1-digit sums: about a quarter of its samples
    are right, so groups have reward variance and the updates are not zero."""
    task = ArithmeticTask(seed=1234, num_train=40, num_eval=5, min_digits=1, max_digits=1)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    sft(model, tokenizer, task.train_examples(), steps=60, batch_size=32, lr=1e-2, progress=False)
    path = tmp_path_factory.mktemp("sft-model")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _torchrun(nproc: int, *args: str) -> None:
    torchrun(nproc, "-m", "emapg", "train", *args)


def _args(model_dir, out, *extra, task=TASK):
    return [f"model.path={model_dir}", f"train.output_dir={out}", *task, *ARGS, *extra]


def _records(out: Path) -> list[dict]:
    lines = (out / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]


def _step(out: Path, step: int) -> Path:
    return out / "quickstart" / "checkpoints" / f"step_{step}"


def _policy(out: Path, step: int) -> dict:
    return load_file(str(_step(out, step) / "policy" / "model.safetensors"))


def _sharded(out: Path, step: int, tmp_path: Path) -> dict:
    """The DCP checkpoint read whole, without a process group."""
    dest = tmp_path / f"step_{step}.pt"
    dcp_to_torch_save(_step(out, step) / "sharded", dest)
    return torch.load(dest, weights_only=False)


@pytest.fixture(scope="module")
def two(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    _torchrun(2, *_args(model_dir, out, f"train.steps={STEPS}"))
    return out


TIED = {"lm_head.weight", "model.embed_tokens.weight"}  # one tensor; files may name either or both


def _close(a, b, what):
    assert a.keys() - TIED == b.keys() - TIED and a.keys() & b.keys() & TIED, what
    for k in a.keys() & b.keys():
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (what, k, float((a[k] - b[k]).abs().max()))


@pytest.mark.slow
def test_two_processes_equal_one_process(model_dir, two, tmp_path):
    assert cli.main(["train", *_args(model_dir, tmp_path, f"train.steps={STEPS}")]) == 0
    one_records, two_records = _records(tmp_path), _records(two)
    assert [r["step"] for r in two_records] == list(range(STEPS + 1))
    assert one_records[1]["grad_norm"] > 0 and one_records[-1]["kl/value"] > 0  # real updates, real KL
    assert one_records[-1]["anchor/updates"] == STEPS // PERIOD
    for a, b in zip(one_records, two_records, strict=True):
        assert a.keys() == b.keys()
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    _close(_policy(tmp_path, STEPS), _policy(two, STEPS), "policy")
    anchor = load_file(str(_step(tmp_path, STEPS) / "anchor.safetensors"))
    _close(anchor, _sharded(two, STEPS, tmp_path)["anchor"], "anchor")


@pytest.mark.slow
def test_dynamic_sampling_and_batch_statistics_in_two_processes_equal_one_process(model_dir, tmp_path):
    """Dynamic sampling chooses on the whole round's rewards and hands every rank its slice of the
    kept groups, and reinforce_pp whitens over the whole batch: 2 processes run what 1 does."""
    extra = [
        "train.steps=2",
        "algo.dynamic_sampling=true",
        "algo.max_sampling_rounds=3",
        "algo.advantage=reinforce_pp",
    ]
    _torchrun(2, *_args(model_dir, tmp_path / "two", *extra))
    assert cli.main(["train", *_args(model_dir, tmp_path / "one", *extra)]) == 0
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert any(r.get("sampling/filtered_frac", 0) > 0 for r in one)  # groups without signal were dropped
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_sharded_ema_anchor_equals_the_formula_on_gathered_weights(model_dir, two, tmp_path):
    """anchor <- eta * anchor + (1 - eta) * policy after optimiser steps 2 and 4, from the initial
    policy; every other step leaves it as it was. Policies are the gathered HF exports."""
    want = load_file(str(model_dir / "model.safetensors"))
    for step in range(1, STEPS + 1):
        if step % PERIOD == 0:
            policy = _policy(two, step)
            want = {k: ETA * v + (1 - ETA) * policy[k] for k, v in want.items()}
        _close(want, _sharded(two, step, tmp_path)["anchor"], f"anchor at step {step}")


@pytest.mark.slow
def test_bf16_mixed_gathers_bfloat16_and_keeps_float32_shards(model_dir, tmp_path):
    """FSDP2's MixedPrecisionPolicy: the passes run on bfloat16 copies of the weights (their
    engine/trainer gap is bfloat16's, not float32's 1e-6), while the shards of the policy, its AdamW
    moments and the EMA anchor stay float32, the anchor lerped exactly as the formula says."""
    _torchrun(2, *_args(model_dir, tmp_path, f"train.steps={PERIOD}", "train.precision=bf16-mixed"))
    records = _records(tmp_path)
    assert records[1]["grad_norm"] > 0 and records[-1]["anchor/updates"] == 1
    assert max(r["mismatch/max_abs_logp"] for r in records[1:]) > 1e-4
    saved = _sharded(tmp_path, PERIOD, tmp_path)
    moments = [t for state in saved["optimizer"]["state"].values() for t in state.values() if t.dim()]
    assert moments and {t.dtype for part in ("policy", "anchor") for t in saved[part].values()} | {
        t.dtype for t in moments
    } == {torch.float32}
    start, policy = load_file(str(model_dir / "model.safetensors")), _policy(tmp_path, PERIOD)
    assert {t.dtype for t in policy.values()} == {torch.float32}
    _close({k: ETA * v + (1 - ETA) * policy[k] for k, v in start.items()}, saved["anchor"], "anchor")


@pytest.mark.slow
def test_sharded_checkpoint_resumes_in_two_processes(model_dir, two, tmp_path):
    """The run stopped after step 2: its files as they were then (later checkpoints gone, the
    metrics file as long; --resume truncates it), resumed by 2 processes to step 4."""
    shutil.copytree(two, tmp_path, dirs_exist_ok=True)
    for step in range(3, STEPS + 1):
        shutil.rmtree(_step(tmp_path, step))
    _torchrun(2, "--resume", *_args(model_dir, tmp_path, f"train.steps={STEPS}"))
    assert _records(tmp_path) == _records(two)
    for name, got in _policy(tmp_path, STEPS).items():
        assert torch.equal(got, _policy(two, STEPS)[name]), name
    resumed, straight = _sharded(tmp_path, STEPS, tmp_path), _sharded(two, STEPS, tmp_path)
    for part in ("policy", "anchor"):
        for name, got in resumed[part].items():
            assert torch.equal(got, straight[part][name]), (part, name)


@pytest.mark.slow
def test_sharded_checkpoint_does_not_resume_in_one_process(model_dir, two, capsys):
    assert cli.main(["train", "--resume", *_args(model_dir, two)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("emapg: error: checkpoint") and "several processes (torchrun)" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "section,key,value,message",
    [
        ("rollout", "prompts_per_step", 3, "rollout.prompts_per_step=3 must be divisible by the 2 processes"),
        ("lora", "r", 8, "lora.r=8: LoRA runs in one process"),
    ],
)
def test_what_multi_process_training_cannot_do_stops_with_one_line(section, key, value, message):
    cfg = load_config(None, [])
    setattr(getattr(cfg, section), key, value)
    cfg.check_world(1)  # one process: not this check's business
    with pytest.raises(EmapgError) as raised:
        cfg.check_world(2)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def search_model_dir(tmp_path_factory):
    """A random tiny Llama whose tokenizer has the search tags' characters."""

    tokenizer = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = build_tiny_model(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=128
    )
    path = tmp_path_factory.mktemp("search-model")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_search_in_two_processes_equals_one_process(search_model_dir, tmp_path):
    """Multi-turn episodes end after different numbers of turns (prompts of 22 and 34 characters
    under an 80-token context cap, EOS): a rank whose episodes are all done runs padding turns
    while the other goes on, and the run equals one process on the same global batch."""
    # The random model earns no reward: k1's sampled gradient (non-zero where policy and anchor
    # agree) gives every step a real update to compare, where noise amplified by Adam would not.
    extra = [*SEARCH_ARGS, f"warmstart.cache_dir={tmp_path / 'cache'}"]
    _torchrun(2, *_args(search_model_dir, tmp_path / "two", *extra, task=()))
    assert cli.main(["train", *_args(search_model_dir, tmp_path / "one", *extra, task=())]) == 0
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["step"] for r in two] == [0, 1, 2] and one[-1]["search/calls_mean"] >= 0
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    # Adam's steps of lr 1e-2 on k1's small gradients turn float rounding into ~1e-5 differences.
    for name, a in _policy(tmp_path / "one", 2).items():
        b = _policy(tmp_path / "two", 2)[name]
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (name, float((a - b).abs().max()))
