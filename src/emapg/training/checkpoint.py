"""Crash-safe checkpoints: written to a temporary directory, flushed, then renamed into place.

runs/<name>/checkpoints/step_N/
  policy/            save_pretrained (safetensors) + tokenizer
  anchor.safetensors the anchor's weights (absent without an anchor)
  optimizer.pt       optimiser and scheduler state (tensors and numbers only: weights_only load)
  rng.safetensors    torch CPU (and CUDA) generator states
  state.json         step, optimiser steps, anchor updates, data position, Python RNG
With LoRA (lora.r > 0), policy/ holds the merged model (base + adapter) and there is no
anchor.safetensors:
  adapters/policy/   the policy adapter (peft format: adapter_model.safetensors + config)
  adapters/anchor/   the EMA anchor's adapter (absent for a frozen anchor: the base itself)
Resuming loads the adapters; the base comes from model.path, as in the run that wrote them.
A directory named step_N is complete by construction; partial ones are `.tmp-*` and ignored.

Written by several processes (torchrun, FSDP2), optimiser.pt and anchor.safetensors give way to
  sharded/           torch.distributed.checkpoint of policy, anchor and optimiser shards (resume)
  scheduler.pt       the scheduler state
while policy/ still holds the whole policy in HF format (gathered to rank 0), for eval and
export. Every rank writes its shards into the same temporary directory; rank 0 renames it
after a barrier, so the atomicity is the same.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from emapg import distributed
from emapg.errors import EmapgError
from emapg.model import lora

STEP_DIR = re.compile(r"^step_(\d+)$")


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(
    directory: Path, step: int, *, policy, tokenizer, anchor, optimizer, scheduler, state: dict, keep: int
) -> Path:
    """Write checkpoint `step_<step>` under `directory` atomically; keep the newest `keep`."""
    if distributed.world() > 1:
        return _save_sharded(
            directory,
            step,
            policy=policy,
            tokenizer=tokenizer,
            anchor=anchor,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            keep=keep,
        )
    directory.mkdir(parents=True, exist_ok=True)
    peft = lora.is_peft(policy)
    # The anchor's own model where it has one: a LoRA run's anchor is an adapter inside the policy.
    anchor_model = anchor.model if anchor is not None and not peft else None
    _check_space(directory, step, _bytes_to_write(policy, anchor_model, optimizer))
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".tmp-step_{step}-"))
    try:
        if peft:  # merged policy/, both adapters under adapters/
            lora.save(policy, tmp, _tied_names(lora.unwrap(policy)))
        else:
            policy.save_pretrained(tmp / "policy", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "policy")
        if anchor_model is not None:
            save_model(anchor_model, str(tmp / "anchor.safetensors"))
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt"
        )
        _write_state(tmp, step, state)
        return _publish(tmp, directory, step, keep)
    except BaseException as exc:
        # Measured before the partial write is removed: a full disk fails inside torch or
        # safetensors with a message that does not say so (torch: "iostream error").
        full = isinstance(exc, Exception) and shutil.disk_usage(directory).free < FULL_BYTES
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise EmapgError(
                f"the disk filled up while writing checkpoint step_{step} under {directory}; the "
                "partial write is removed and the newest complete checkpoint kept: free space, then resume"
            ) from exc
        raise


# A failed write with less than this left on the disk is reported as a full disk.
FULL_BYTES = 64 << 20


def _bytes_to_write(policy, anchor_model, optimizer) -> int:
    """About the checkpoint's size: the policy, the anchor's own model (if it has one) and the
    optimiser's state tensors."""
    tensors = list(policy.state_dict().values())
    if anchor_model is not None:
        tensors += anchor_model.state_dict().values()
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_space(directory: Path, step: int, needed: int) -> None:
    """Stop before writing a checkpoint the disk cannot hold (the older ones are deleted only
    after the new one is complete, so the new one needs room beside them)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise EmapgError(
            f"checkpoint step_{step} needs about {needed / 2**30:.2f} GiB and {directory} has "
            f"{free / 2**30:.2f} GiB free: free space (or lower train.keep_checkpoints), then resume"
        )


def _write_state(tmp: Path, step: int, state: dict) -> None:
    """RNG states and state.json, then flush the whole temporary directory."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / "rng.safetensors"))
    full_state = {**state, "step": step, "python_rng": random.getstate()}
    (tmp / "state.json").write_text(json.dumps(full_state))
    _fsync_tree(tmp)


def _publish(tmp: Path, directory: Path, step: int, keep: int) -> Path:
    """Rename the complete temporary directory into place; delete all but the newest `keep`."""
    final = directory / f"step_{step}"
    if final.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_tree(directory)
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    return final


def _sharded_state(policy, anchor, optimizer) -> dict:
    """This rank's shards of everything that is sharded, as torch.distributed.checkpoint wants."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {"policy": get_model_state_dict(policy), "optimizer": get_optimizer_state_dict(policy, optimizer)}
    if anchor is not None:
        out["anchor"] = get_model_state_dict(anchor.model)
    return out


def _save_sharded(
    directory: Path, step: int, *, policy, tokenizer, anchor, optimizer, scheduler, state: dict, keep: int
) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    main = distributed.is_main()
    distributed.reshard(policy)  # state dicts read the shards, not gathered copies
    if anchor is not None:
        distributed.reshard(anchor.model)
    tmp = None
    if main:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=directory, prefix=f".tmp-step_{step}-")
    tmp = Path(distributed.broadcast(tmp))
    try:
        dcp.save(_sharded_state(policy, anchor, optimizer), checkpoint_id=tmp / "sharded")
        whole = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if main:
            whole = {k: v for k, v in whole.items() if k not in _tied_names(policy)}  # as save_pretrained
            policy.save_pretrained(tmp / "policy", state_dict=whole, safe_serialization=True)
            tokenizer.save_pretrained(tmp / "policy")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            _write_state(tmp, step, state)
        distributed.barrier()  # every rank's shards are flushed to disk
        final = _publish(tmp, directory, step, keep) if main else directory / f"step_{step}"
        distributed.barrier()
        return final
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_partial(directory: Path) -> None:
    """Delete `.tmp-*` directories a killed save left behind (never a complete step_N)."""
    if directory.is_dir():
        for path in directory.glob(".tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def load(path: Path, **objects) -> dict:
    """Restore everything `save` wrote into the live objects; returns state.json's contents.
    A damaged checkpoint stops with one line (EmapgError), never a traceback or an unpickling."""
    try:
        return _load(path, **objects)
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError, SafetensorError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EmapgError(f"checkpoint {path} cannot be loaded: {detail}") from None


def _load(path: Path, *, policy, anchor, optimizer, scheduler) -> dict:
    sharded = (path / "sharded").is_dir()
    if sharded != (distributed.world() > 1):
        writer = "several processes (torchrun)" if sharded else "one process"
        raise EmapgError(
            f"checkpoint {path} was written by {writer}; resume it the same way "
            f"(this run has {distributed.world()} process(es))"
        )
    if sharded:
        _load_sharded(path, policy=policy, anchor=anchor, optimizer=optimizer, scheduler=scheduler)
        return _read_state(path)
    if lora.is_peft(policy):
        lora.load(policy, path)  # the policy and anchor adapters
    else:
        missing, unexpected = load_model(policy, str(path / "policy" / "model.safetensors"), strict=False)
        if unexpected or [m for m in missing if m not in _tied_names(policy)]:
            raise RuntimeError(f"checkpoint {path}: policy weights do not match the model")
    if anchor is not None and not lora.is_peft(policy):
        load_model(anchor.model, str(path / "anchor.safetensors"))
    states = torch.load(path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    return _read_state(path)


def _load_sharded(path: Path, *, policy, anchor, optimizer, scheduler) -> None:
    """Each rank reads its shards (torch.distributed.checkpoint reshards to this world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = _sharded_state(policy, anchor, optimizer)
    dcp.load(states, checkpoint_id=path / "sharded")
    set_model_state_dict(policy, states["policy"])
    set_optimizer_state_dict(policy, optimizer, states["optimizer"])
    if anchor is not None:
        set_model_state_dict(anchor.model, states["anchor"])
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))


def _read_state(path: Path) -> dict:
    """Restore the RNG states; returns state.json's contents."""
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and "cuda0" in rng:
        torch.cuda.set_rng_state_all([rng[f"cuda{i}"] for i in range(torch.cuda.device_count())])
    state = json.loads((path / "state.json").read_text())
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    return state


def _tied_names(model) -> set[str]:
    """Parameter names that save_pretrained leaves out: a parameter listed again (tied weights)."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied
