"""Multi-process training helpers: process group, rank and world, reductions, FSDP2 sharding.

Started by torchrun (WORLD_SIZE > 1 in the environment): gloo on CPU, NCCL on the local
GPU. In a single process every helper is a no-op, so the trainer has one code path.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from emapg.errors import EmapgError


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def init(device: torch.device) -> torch.device:
    """Join the torchrun process group when there is one; returns this rank's device."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def main_first():
    """Rank 0 runs the block first (e.g. builds a cache), then the others (which reuse it)."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def sum_all(*values: float) -> list[float]:
    """The sum over ranks of each value (float64, so counts and sums stay exact)."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t)
    return t.tolist()


def sum_one(value: float) -> float:
    return sum_all(value)[0]


def max_one(value: int | float) -> int | float:
    """The largest `value` over ranks (e.g. how many forward calls every rank must run)."""
    if not dist.is_initialized():
        return value
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"
    exact = isinstance(value, int)
    t = torch.tensor([value], dtype=torch.int64 if exact else torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) if exact else float(t.item())


def union(names) -> list[str]:
    """The sorted union of every rank's `names` (e.g. metric keys that depend on a rank's data)."""
    if not dist.is_initialized():
        return sorted(names)
    every = [None] * world()
    dist.all_gather_object(every, sorted(names))
    return sorted(set().union(*every))


def all_gather(obj) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    if not dist.is_initialized():
        return [obj]
    every = [None] * world()
    dist.all_gather_object(every, obj)
    return every


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_rows(n: int) -> slice:
    """This rank's contiguous slice of `n` rows (n divisible by the world size)."""
    per = n // world()
    return slice(rank() * per, (rank() + 1) * per)


def shard(model: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 over the ranks: each decoder layer is a unit, the root holds the rest.

    The root (embeddings, final norm, LM head, tied or not) stays gathered after its forward,
    which is what lets the fused LM-head path read the head weight after `model(...)`.
    Gradients are summed, not averaged, over ranks: every loss is already its share of the
    global total (token counts are reduced before the loss is formed). With a `compute_dtype`
    narrower than the parameters (bf16-mixed), FSDP2 gathers the parameters in it for the passes
    and reduces the gradients in float32 into the float32 shards (`MixedPrecisionPolicy`).
    """
    if world() == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    return shard_over(
        model, init_device_mesh(next(model.parameters()).device.type, (world(),)), compute_dtype
    )


def shard_over(model: nn.Module, mesh, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """`shard`'s FSDP2 units over a given device mesh (one rank's too: scripts/gpu-check.sh)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise EmapgError(f"multi-process training shards base_model.layers; {type(model).__name__} has none")
    first = next(model.parameters())
    mixed = compute_dtype is not None and compute_dtype != first.dtype
    policy = (
        MixedPrecisionPolicy(compute_dtype, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    return model


def reshard(model: nn.Module) -> None:
    """Free gathered parameters, so `model.parameters()` are the local shards (a no-op unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place ops change the DTensor), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
