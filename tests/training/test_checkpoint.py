"""Checkpoints (emapg.training.checkpoint): SIGKILL a training run during a step and during a
checkpoint write, resume with --resume, and check the result equals an uninterrupted run exactly
(CPU, same seed); a checkpoint of the older format resumes and unknown formats stop; loading a
checkpoint never unpickles code."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import emapg
from emapg import cli
from emapg.errors import EmapgError
from emapg.model.models import load_model_and_tokenizer
from emapg.training import loop as trainer
from emapg.training.run import CHECKPOINT_FORMAT
from helpers import config

ARGS = ["task.num_train=32", "task.num_eval=4", "eval.samples=1", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "algo.micro_batch_size=8", "train.progress=false",
        "train.tensorboard=false", "train.steps=4", "train.eval_every=2", "train.save_every=2",
        "train.keep_checkpoints=5", "anchor.update_period=1", "kl.k=4"]  # fmt: skip


# Run the CLI in a child that SIGKILLs itself at a chosen point, so the kill is deterministic.
KILLER = """
import os, signal, sys
from emapg.training import checkpoint, loop as trainer
from emapg import cli
point = sys.argv[1]
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if point == "step":  # inside the update of step 3, after checkpoint step_2 is complete
    real_update, calls = trainer.update, []
    def update(*a, **k):
        calls.append(1)
        return die() if len(calls) == 3 else real_update(*a, **k)
    trainer.update = update
else:  # during the write of step_4: the policy is in the temporary directory, nothing renamed
    real_fsync = checkpoint._fsync_tree
    checkpoint._fsync_tree = lambda root: die() if "step_4" in root.name else real_fsync(root)
cli.main(["train", *sys.argv[2:]])
"""


# LoRA adapters; k1 because its sampled gradient moves them even where the random model earns nothing
LORA = ("lora.r=4", "lora.lr=0.01", "kl.estimator=k1", "kl.beta=1.0")


def _train_args(model_dir, out, extra=()):
    return [f"model.path={model_dir}", f"train.output_dir={out}", *ARGS, *extra]


def _read(out: Path):
    run = out / "quickstart"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]
    weights = load_model_and_tokenizer(str(run / "checkpoints" / "step_4" / "policy"))[0].state_dict()
    return records, weights


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run of each set of extra arguments, run once."""
    runs = {}

    def get(extra):
        if extra not in runs:
            out = tmp_path_factory.mktemp("straight")
            assert cli.main(["train", *_train_args(tiny_model_dir, out, extra)]) == 0
            runs[extra] = _read(out)
        return runs[extra]

    return get


BF16_ANCHOR = ("anchor.dtype=bfloat16",)  # a float32 policy beside a bfloat16 EMA anchor
# float32 master weights, AdamW state and anchor, bfloat16 compute; k1 moves the weights (as LORA's)
BF16_MIXED = ("train.precision=bf16-mixed", "kl.estimator=k1", "kl.beta=1.0", "optim.lr=0.01")


@pytest.mark.slow
@pytest.mark.parametrize(
    "point,extra",
    [
        ("step", ()),
        ("checkpoint", ()),
        ("step", LORA),
        ("step", BF16_ANCHOR),
        ("step", BF16_MIXED),
        ("checkpoint", BF16_MIXED),
    ],
    ids=["step", "checkpoint", "step-lora", "step-bf16-anchor", "step-bf16-mixed", "checkpoint-bf16-mixed"],
)
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, tiny_model_dir, straight, point, extra):
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, point, *_train_args(tiny_model_dir, tmp_path, extra)],
        env=env,
        # Time limit: each case measured at most 15 s at load 3-4; 300 s is x20.
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL
    ckpts = tmp_path / "quickstart" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == ["step_2"]
    assert any(p.name.startswith(".tmp-step_4") for p in ckpts.iterdir()) == (point == "checkpoint")

    assert cli.main(["train", "--resume", *_train_args(tiny_model_dir, tmp_path, extra)]) == 0
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]  # stale partial removed
    records, weights = _read(tmp_path)
    want_records, want_weights = straight(extra)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # no torn or duplicated line
    assert records == want_records
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights)
    if extra == BF16_ANCHOR:  # saved and restored in its own dtype
        with safe_open(str(ckpts / "step_4" / "anchor.safetensors"), "pt") as f:
            names = f.keys()  # a safetensors file handle, not a dict
            assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
    if extra in (LORA, BF16_MIXED):  # the policy moved from the base: it trained
        base = load_model_and_tokenizer(tiny_model_dir)[0].state_dict()
        assert any(not torch.equal(weights[k], base[k]) for k in weights)
    if extra == BF16_MIXED:  # what a checkpoint holds is float32 throughout: master weights, moments, anchor
        for file in ("anchor.safetensors", "policy/model.safetensors"):
            with safe_open(str(ckpts / "step_4" / file), "pt") as f:
                names = f.keys()  # a safetensors file handle, not a dict
                assert {f.get_tensor(k).dtype for k in names} == {torch.float32}, file
        saved = torch.load(ckpts / "step_4" / "optimizer.pt", weights_only=True)["optimizer"]["state"]
        moments = [t for state in saved.values() for t in state.values() if t.dim()]
        assert moments and {t.dtype for t in moments} == {torch.float32}


def _checkpoint_state(tmp_path):
    return tmp_path / "quickstart" / "checkpoints" / "step_2" / "state.json"


@pytest.mark.slow
def test_checkpoints_of_the_older_format_resume_and_unknown_formats_stop(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, "train.steps=2", "train.save_every=2")
    trainer.train(cfg)
    path = _checkpoint_state(tmp_path)
    state = json.loads(path.read_text())
    assert state["format"] == CHECKPOINT_FORMAT and state["trainer"]["optimizer_steps"] == 2
    # Format 1 (before this field existed, and before skipped_steps was counted) still resumes.
    del state["format"], state["trainer"]["skipped_steps"], state["trainer"]["bad_in_row"]
    path.write_text(json.dumps(state))
    result = trainer.train(
        config(tmp_path, tiny_model_dir, "train.steps=3", "train.save_every=3"), resume=True
    )
    assert result["accuracy_before"] == state["trainer"]["accuracy_before"]
    path = path.parent.parent / "step_3" / "state.json"
    state = json.loads(path.read_text())
    state["format"] = 99
    path.write_text(json.dumps(state))
    with pytest.raises(EmapgError, match=r"step_3 has format 99; this emapg resumes formats 1 to 2$"):
        trainer.train(config(tmp_path, tiny_model_dir, "train.steps=3"), resume=True)


class Payload:
    """A pickle that runs code when unpickled: it would create the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_checkpoint_never_unpickles_code(tmp_path, tiny_model_dir):
    import torch

    from emapg.model.models import load_model_and_tokenizer
    from emapg.training import checkpoint

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    objects = {"policy": model, "anchor": None, "optimizer": optimizer, "scheduler": scheduler}
    path = checkpoint.save(tmp_path, 1, tokenizer=tokenizer, state={}, keep=1, **objects)
    assert checkpoint.load(path, **objects)["step"] == 1  # the untouched checkpoint loads
    marker = tmp_path / "pwned"
    torch.save({"optimizer": Payload(marker)}, path / "optimizer.pt")
    with pytest.raises(EmapgError, match=f"checkpoint {path} cannot be loaded"):
        checkpoint.load(path, **objects)
    assert not marker.exists()


def _save_objects(tiny_model_dir):
    from emapg.model.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return tokenizer, {"policy": model, "anchor": None, "optimizer": optimizer, "scheduler": scheduler}


def test_a_checkpoint_the_disk_cannot_hold_stops_before_writing(tmp_path, tiny_model_dir, monkeypatch):
    from emapg.training import checkpoint

    tokenizer, objects = _save_objects(tiny_model_dir)
    weights = sum(p.numel() * p.element_size() for p in objects["policy"].state_dict().values())
    real = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=weights - 1))
    with pytest.raises(EmapgError, match=r"checkpoint step_3 needs about .* GiB free: free space"):
        checkpoint.save(tmp_path, 3, tokenizer=tokenizer, state={}, keep=1, **objects)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary directory


@pytest.mark.parametrize("free_after", [0, 1 << 40])
def test_a_write_that_fills_the_disk_says_so_and_leaves_nothing(
    tmp_path, tiny_model_dir, monkeypatch, free_after
):
    from emapg.training import checkpoint

    tokenizer, objects = _save_objects(tiny_model_dir)
    saved = checkpoint.save(tmp_path, 1, tokenizer=tokenizer, state={}, keep=1, **objects)
    real = checkpoint.shutil.disk_usage
    # Room before the write; the write fails as torch does on a full disk; then `free_after` left.
    frees = iter([1 << 40, free_after])
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=next(frees)))

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    if free_after == 0:
        error, message = EmapgError, "the disk filled up while writing checkpoint step_2"
    else:  # another failure, with room left, is passed on as it is
        error, message = RuntimeError, "unexpected pos"
    with pytest.raises(error, match=message):
        checkpoint.save(tmp_path, 2, tokenizer=tokenizer, state={}, keep=1, **objects)
    assert [p.name for p in tmp_path.iterdir()] == [saved.name]  # the complete one kept, no partial
