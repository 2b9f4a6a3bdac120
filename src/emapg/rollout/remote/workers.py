"""The trainer's side of async rollouts: it starts the local workers, meets them (and any remote
ones) at its store, pushes weights, sends requests and receives their answers.

`RolloutWorkers` is also a `RolloutEngine`: evaluation samples through `sample`, on the first
worker, so held-out accuracy and the anchor's own evaluation work unchanged in async mode.
Training batches go through `request` (returns at once) and `result` (waits): the trainer asks
for the next steps' batches before it updates, and each worker samples them while it does.

Sends never wait: weights are copied into buckets and left in flight (`link.Sent`), the copy
waited for only at the next push, so the trainer goes on while a busy worker reads them.
A worker that dies, or fails, stops the run with one line; checkpoints are written only between
steps, so the last one is whole and `emapg train --resume` continues from it.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Hashable, Sequence
from contextlib import contextmanager, suppress

import torch
import torch.multiprocessing as mp
from torch import nn

from emapg.errors import EmapgError
from emapg.rollout import ENGINES, Rollout, SamplingParams, with_call_seed
from emapg.rollout.remote import link, worker
from emapg.tasks import TASKS


def user_modules(spec: worker.WorkerSpec) -> list[str]:
    """Modules outside emapg that registered the run's task or engine: a worker imports them
    before it reads its spec (a local worker has the trainer's sys.path)."""
    found = {TASKS[spec.task.name].factory.__module__, ENGINES[spec.rollout.engine].factory.__module__}
    return sorted(m for m in found if m != "__main__" and not m.startswith("emapg."))


STOP_S = 30  # seconds a worker is given to read its stop, and a local one to exit


class RolloutWorkers:
    """The trainer's handle on its rollout workers (see the module doc)."""

    def __init__(self, spec: worker.WorkerSpec, model_dir: str):
        r = spec.rollout
        self.ranks = list(range(1, 1 + r.workers + r.remote_workers))
        self.store = link.serve_store(r.address, len(self.ranks) + 1, r.worker_timeout_s)
        host = link.split_address(r.address)[0]
        self.address = f"{host}:{self.store.port}"
        for key, value in (
            ("size", str(len(self.ranks) + 1)),
            ("spec", pickle.dumps(spec)),
            ("model_dir", model_dir),
            ("modules", json.dumps(user_modules(spec))),
        ):
            self.store.set(key, value)
        spawn = mp.get_context("spawn")  # a fresh interpreter: no fork of the trainer's threads
        self.processes = {
            rank: spawn.Process(target=worker.serve, args=(self.address, rank, r.worker_threads), daemon=True)
            for rank in self.ranks[: r.workers]
        }
        for process in self.processes.values():
            process.start()
        self.pg = None
        self.sent = link.Sent()
        self.answers: dict[int, dict] = {}
        self.next_id, self.turn = 0, 0
        self.version: Hashable = None  # the weights the workers hold (None: the model directory's)
        try:
            self._meet(r.worker_timeout_s)
        except BaseException:
            self.close()
            raise

    def _meet(self, timeout_s: float) -> None:
        """Wait until every worker has joined the group and built its engine."""
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks:
            while not self.store.check([f"joined/{rank}"]):
                process = self.processes.get(rank)
                exited = process is not None and process.exitcode is not None
                if exited or self.store.check([f"error/{rank}"]):
                    raise EmapgError(f"rollout worker {rank} stopped before joining{self._why(rank)}")
                if time.monotonic() > deadline:
                    raise EmapgError(
                        f"rollout worker {rank} did not join at {self.address} within "
                        f"rollout.worker_timeout_s={timeout_s:g}"
                    )
                time.sleep(0.05)
        self.pg = link.group(self.store, 0, len(self.ranks) + 1, link.GROUP_TIMEOUT_S)
        for rank in self.ranks:
            with self._link(rank):
                link.recv(self.pg, rank, link.TO_TRAINER)  # "ready"

    @contextmanager
    def _link(self, rank: int):
        """Turns a dead worker's broken connection into the run's one-line stop, with the
        worker's own error where it left one."""
        try:
            yield
        except RuntimeError as e:
            if not link.peer_gone(e):
                raise
            raise EmapgError(
                f"rollout worker {rank} stopped{self._why(rank)}; the run stops here, its checkpoints "
                "intact: `emapg train --resume` continues from the last"
            ) from None

    def _why(self, rank: int) -> str:
        """What is known of why worker `rank` stopped: a local one's exit code, and the error
        line a worker leaves in the store."""
        process = self.processes.get(rank)
        if process is not None:
            process.join(5)
        code = (
            f" (exit code {process.exitcode})" if process is not None and process.exitcode is not None else ""
        )
        error = f": {self.store.get(f'error/{rank}').decode()}" if self.store.check([f"error/{rank}"]) else ""
        return code + error

    def _send(self, rank: int, message: dict) -> int:
        """Send a request to `rank` without waiting; its id, to find its answer by."""
        self.next_id += 1
        with self._link(rank):
            link.send(self.pg, {**message, "id": self.next_id}, rank, link.TO_WORKER, self.sent)
        self.sent.reap(rank)
        return self.next_id

    def _answer(self, rank: int, request: int) -> dict:
        """The answer to `request` from `rank`, keeping the answers that come before it."""
        while request not in self.answers:
            with self._link(rank):
                message = link.recv(self.pg, rank, link.TO_TRAINER)
            self.answers[message["id"]] = message
        return self.answers.pop(request)

    # RolloutEngine -----------------------------------------------------------------------------

    def sync_weights(self, model: nn.Module, version: Hashable) -> None:
        """Push `model`'s parameters to every worker, unless `version` is what they hold."""
        if version == self.version:
            return
        for rank in self.ranks:
            with self._link(rank):
                self.sent.wait(rank)  # the last push's buckets are read: drop them before copying anew
        layouts, flats = link.buckets(model)
        for rank in self.ranks:
            self._send(rank, {"kind": "weights", "version": version, "layouts": layouts})
            with self._link(rank):
                self.sent.add(rank, [self.pg.send([flat], rank, link.TO_WORKER) for flat in flats], flats)
        self.version = version

    def sample(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, rows=None) -> Rollout:
        rows = list(range(len(prompt_ids))) if rows is None else list(rows)
        params = with_call_seed(params)
        rank = self.ranks[0]
        message = {
            "kind": "sample",
            "prompt_ids": [list(p) for p in prompt_ids],
            "params": params,
            "rows": rows,
        }
        return self._answer(rank, self._send(rank, message))["rollout"]

    def sleep(self) -> None:
        """Nothing to free: the workers' memory is their own."""

    def close(self) -> None:
        """Tell every worker to stop, give each STOP_S to read it (its connection must not close
        under it), and wait for the local ones (killed if they do not stop)."""
        if self.pg is not None:
            stops = link.Sent()
            for rank in self.ranks:
                with suppress(RuntimeError):  # a worker already gone
                    link.send(self.pg, {"kind": "stop", "id": None}, rank, link.TO_WORKER, stops)
            for rank in self.ranks:
                with suppress(RuntimeError):  # gone, or still busy with an earlier request
                    stops.wait(rank, timeout_s=STOP_S)
        for process in self.processes.values():
            process.join(STOP_S)
            if process.is_alive():
                process.kill()
                process.join()
        self.pg = None

    # Training batches --------------------------------------------------------------------------

    def request(self, examples: list, params: SamplingParams, *, rows: Sequence[int]) -> tuple[int, int]:
        """Ask the next worker in turn for one step's responses to `examples`, drawn with the
        weights last pushed; returns (worker, request) for `result`. The call seed is drawn here,
        from the trainer's generator, as an engine in the trainer would draw it."""
        params = with_call_seed(params)
        rank = self.ranks[self.turn % len(self.ranks)]
        self.turn += 1
        message = {"kind": "batch", "examples": examples, "params": params, "rows": list(rows)}
        return rank, self._send(rank, message)

    def result(self, ticket: tuple[int, int]) -> dict:
        """The answer to a `request`: rollout, version (the weights it was drawn with) and
        seconds (the worker's sampling time)."""
        return self._answer(*ticket)

    def parameters(self, rank: int) -> dict[str, torch.Tensor]:
        """A copy of worker `rank`'s parameters (to check that a push arrived whole)."""
        return self._answer(rank, self._send(rank, {"kind": "parameters"}))["parameters"]
