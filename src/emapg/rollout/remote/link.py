"""The link between the trainer and its rollout workers: a torch.distributed gloo group of their
own, met at a TCPStore the trainer serves (`rollout.address`).

Rank 0 is the trainer, ranks 1..W the workers. The group is built directly on the store
(`ProcessGroupGloo`), not as the default group: a trainer started by torchrun keeps its own.
Over it go messages (pickled dicts: requests, results, weight headers) and the weights
themselves, in flat buckets of one dtype. Each direction has its own tag, and gloo delivers a
pair's messages of one tag in order, so a worker sees requests and weights in the order the
trainer sent them: a request is sampled with the weights pushed before it. The store also
carries what a worker needs to start (the run's config, the model's directory).

Pickle runs code on load: like torch.distributed itself, the link is for a trusted network.
"""

from __future__ import annotations

import math
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

TRAINER = 0
TO_WORKER, TO_TRAINER = 0, 1  # message tags, one per direction
BUCKET_BYTES = 64 << 20  # weights travel in flat buckets of up to this many bytes (one send each)
# A message may be long in coming (a worker sampling long responses, a trainer in a long update);
# a peer that dies is noticed at once (its connection closes), so the group waits a day.
GROUP_TIMEOUT_S = 24 * 3600


def split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def serve_store(address: str, size: int, timeout_s: float) -> dist.TCPStore:
    """The trainer's store at `address` (port 0: a free port, then `store.port`)."""
    host, port = split_address(address)
    return dist.TCPStore(host, port, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A worker's client of the trainer's store."""
    host, port = split_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def group(store: dist.TCPStore, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """The gloo group of the trainer and its workers (every rank calls this; it returns once all have)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("rollout", store), rank, size, timedelta(seconds=timeout_s))


def peer_gone(error: Exception) -> bool:
    """Whether a failed send or receive means the other side's process is gone."""
    return isinstance(error, RuntimeError) and any(
        words in str(error) for words in ("Connection closed", "Connection reset", "Broken pipe")
    )


class Sent:
    """Sends in flight, per peer, each with the tensors it reads (which must live until it ends).

    gloo completes a send only once the peer has posted the matching receive, so a side that
    waited on its own sends while the other waited on it could stall both: sends are left here,
    dropped when done (`reap`), and waited for only where the peer is known to read on."""

    def __init__(self):
        self.pending: dict[int, list[tuple[object, list[Tensor]]]] = {}

    def add(self, peer: int, works: list, tensors: list[Tensor]) -> None:
        self.pending.setdefault(peer, []).extend((work, tensors) for work in works)

    def reap(self, peer: int) -> None:
        """Drop the sends to `peer` that have completed."""
        self.pending[peer] = [(w, t) for w, t in self.pending.get(peer, []) if not w.is_completed()]

    def wait(self, peer: int, timeout_s: float = 0) -> None:
        """Wait for the sends to `peer` (timeout_s > 0: at most that long each, then raise)."""
        for work, _ in self.pending.pop(peer, []):
            work.wait(timedelta(seconds=timeout_s))


def send(pg: dist.ProcessGroup, message: dict, peer: int, tag: int, sent: Sent | None = None) -> None:
    """Send a picklable `message`: its length, then its bytes. With `sent` the sends are left in
    flight there (wait on it before dropping what they read); without, this waits for them."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    works = [pg.send([size], peer, tag), pg.send([data], peer, tag)]
    if sent is None:
        for work in works:
            work.wait()
    else:
        sent.add(peer, works, [size, data])


def recv(pg: dist.ProcessGroup, peer: int, tag: int) -> dict:
    size = torch.zeros(1, dtype=torch.long)
    pg.recv([size], peer, tag).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    pg.recv([data], peer, tag).wait()
    return pickle.loads(data.numpy().tobytes())


def buckets(model: nn.Module) -> tuple[list[dict], list[Tensor]]:
    """The model's parameters as flat CPU buckets of one dtype each (a copy: training may go on
    while they are sent), and each bucket's layout: its dtype and (name, shape) per parameter.
    A parameter larger than BUCKET_BYTES travels alone. A tied parameter comes once, under its
    first name, and the worker's model ties it too."""
    layouts, flats, members, size = [], [], [], 0

    def close():
        if members:
            dtype = str(members[0][1].dtype)
            layouts.append({"dtype": dtype, "params": [(n, list(p.shape)) for n, p in members]})
            flats.append(torch.cat([p.detach().reshape(-1).cpu() for _, p in members]))

    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if members and (size + nbytes > BUCKET_BYTES or param.dtype != members[0][1].dtype):
            close()
            members, size = [], 0
        members.append((name, param))
        size += nbytes
    close()
    return layouts, flats


def recv_buckets(pg: dist.ProcessGroup, model: nn.Module, layouts: list[dict]) -> None:
    """Receive the buckets `layouts` describes into `model`'s parameters, in place."""
    params = dict(model.named_parameters())
    for layout in layouts:
        dtype = getattr(torch, layout["dtype"].removeprefix("torch."))
        flat = torch.empty(sum(math.prod(shape) for _, shape in layout["params"]), dtype=dtype)
        pg.recv([flat], TRAINER, TO_WORKER).wait()
        at = 0
        with torch.no_grad():
            for name, shape in layout["params"]:
                param = params[name]
                if list(param.shape) != shape:
                    raise RuntimeError(f"weights: {name} is {shape} in the trainer, {list(param.shape)} here")
                param.copy_(flat[at : at + param.numel()].view(param.shape))  # casts to the worker's dtype
                at += param.numel()
