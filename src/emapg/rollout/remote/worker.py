"""A rollout worker: a process with its own copy of the policy and its own engine (hf, or vLLM
with its own weight-reload path), which samples what the trainer asks for, in order.

Started by the trainer on its host (`rollout.workers`), or on another with
`emapg rollout-worker --address HOST:PORT --rank N` (`rollout.remote_workers`). It learns the
run's sections (a WorkerSpec) and the model's directory from the trainer's store, joins the link's group, builds
its engine and task, says ready, then serves messages until told to stop:

    weights     load the buckets that follow into the model, then into the engine
    batch       one step's groups (single- or multi-turn, `sample_examples`), with timings
    sample      one engine call (the trainer's evaluation drives its episodes through these)
    parameters  a copy of the model's parameters (to check a sync)
    stop        close the engine and exit

An exception ends the worker, leaving its first line in the store: the trainer, which notices
the closed connection, stops the run with that line.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import time
from dataclasses import dataclass, replace

import torch
from transformers.utils import logging as hf_logging

from emapg.errors import EmapgError
from emapg.model.models import load_model_and_tokenizer, pin_cpu_kernels
from emapg.rollout import EngineNeeds, RolloutSettings, eos_ids, make_engine
from emapg.rollout.multiturn import sample_examples
from emapg.rollout.remote import link
from emapg.tasks import TaskSettings, make_task

JOIN_TIMEOUT_S = 600  # how long a worker tries to reach the trainer's store


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is told of the run: the sections it builds its engine and task from."""

    rollout: RolloutSettings
    needs: EngineNeeds
    task: TaskSettings
    cache_dir: str  # the task's cache folder (warmstart.cache_dir)
    dtype: str  # the model's parameters' (train.precision's; its compute dtype is needs.dtype)
    chat_template: bool  # prompts through the tokenizer's chat template (model.chat_template)
    device: str  # train.device ("auto": cuda where there is one)
    pin_kernels: bool  # the built-in model: pin CPU kernels as the trainer does


class Worker:
    """A worker's engine, model, task and the version of the weights it holds."""

    def __init__(self, spec: WorkerSpec, model_dir: str):
        device = spec.device if spec.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        self.spec = spec
        self.model, self.tokenizer = load_model_and_tokenizer(model_dir, dtype=getattr(torch, spec.dtype))
        # The hf engine samples with this model; any other engine holds its own copy of the
        # weights (vLLM), and this one only receives them: it stays in host memory.
        self.model.to(device if spec.rollout.engine == "hf" else "cpu").eval()
        self.engine = make_engine(spec.rollout, self.model, self.tokenizer, model_dir, spec.needs)
        self.task = make_task(spec.task, spec.cache_dir)
        self.multi_turn = self.task.environment() is not None
        self.eos = eos_ids(self.model, self.tokenizer)
        self.version = None  # the trainer's name for the weights held (None: the initial ones)

    def handle(self, pg, message: dict) -> dict | None:
        """Act on one message; the answer to send back, if any."""
        kind = message["kind"]
        if kind == "weights":
            link.recv_buckets(pg, self.model, message["layouts"])
            self.engine.sync_weights(self.model, message["version"])
            self.version = message["version"]
            return None
        if kind == "batch":
            params = message["params"]
            if self.multi_turn:  # each turn draws its call seed, from a generator seeded per batch
                torch.manual_seed(params.seed)
                params = replace(params, seed=None)
            start = time.perf_counter()
            rollout = sample_examples(
                self.engine, self.tokenizer, self.task, message["examples"], params,
                chat_template=self.spec.chat_template, eos=self.eos, rows=message["rows"],
            )  # fmt: skip
            seconds = time.perf_counter() - start
            return {"rollout": rollout, "version": self.version, "seconds": seconds}
        if kind == "sample":
            rollout = self.engine.sample(message["prompt_ids"], message["params"], rows=message["rows"])
            return {"rollout": rollout, "version": self.version}
        if kind == "parameters":
            return {"parameters": {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}}
        raise ValueError(f"unknown message kind {kind!r}")


def serve(address: str, rank: int, threads: int = 0) -> None:
    """Be rollout worker `rank` of the trainer whose store is at `address`, until told to stop."""
    hf_logging.disable_progress_bar()
    try:
        store = link.join_store(address, timeout_s=JOIN_TIMEOUT_S)
    except RuntimeError as e:
        raise EmapgError(f"no trainer answered at {address} within {JOIN_TIMEOUT_S} s ({e})") from None
    size = int(store.get("size"))
    if not 1 <= rank < size:
        raise EmapgError(f"rank {rank}: the run at {address} has workers of ranks 1 to {size - 1}")
    try:
        for module in json.loads(store.get("modules")):  # what registers the run's task and engine
            importlib.import_module(module)
        spec: WorkerSpec = pickle.loads(store.get("spec"))  # the trainer's own, on its host or this one
        if spec.pin_kernels:
            pin_cpu_kernels()  # before the first kernel, as in the trainer
        if threads:
            torch.set_num_threads(threads)
        store.set(f"joined/{rank}", str(os.getpid()))
        pg = link.group(store, rank, size, link.GROUP_TIMEOUT_S)
        worker = Worker(spec, store.get("model_dir").decode())
        sent = link.Sent()  # answers in flight: the worker reads on while the trainer is busy
        link.send(pg, {"kind": "ready", "id": None}, link.TRAINER, link.TO_TRAINER, sent)
        while (message := link.recv(pg, link.TRAINER, link.TO_WORKER))["kind"] != "stop":
            answer = worker.handle(pg, message)
            if answer is not None:
                answer = {"kind": "answer", "id": message["id"], **answer}
                link.send(pg, answer, link.TRAINER, link.TO_TRAINER, sent)
            sent.reap(link.TRAINER)
        worker.engine.close()  # answers still in flight are dropped: a stopping trainer reads none
    except Exception as e:
        if link.peer_gone(e):
            raise EmapgError(f"the trainer at {address} went away before saying stop") from None
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}".splitlines()[0])  # the trainer reads why
        raise
