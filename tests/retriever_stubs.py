"""Retrievers for the server's tests, in a module of their own: a server's worker process
unpickles them, so importing this must be cheap (no conftest, no torch)."""

import os
import time
import uuid
from pathlib import Path


class Rendezvous:
    """Each call waits until `n` calls are in progress at once (each leaves a file in `folder`;
    at most 30 s), then answers every query with one passage naming the process that ran it and
    whether the others came."""

    def __init__(self, folder: Path, n: int):
        self.folder, self.n = Path(folder), n

    def retrieve_scored(self, queries, topk):
        (self.folder / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        deadline = time.monotonic() + 30
        while len(list(self.folder.iterdir())) < self.n and time.monotonic() < deadline:
            time.sleep(0.01)
        met = len(list(self.folder.iterdir())) >= self.n
        return [[({"id": str(os.getpid()), "contents": f"met: {met}"}, 1.0)] for _ in queries]


class ExitsOn:
    """`inner`, except that a request with the query `word` ends the process that serves it."""

    def __init__(self, inner, word: str):
        self.inner, self.word = inner, word

    def retrieve_scored(self, queries, topk):
        if self.word in queries:
            os._exit(3)
        return self.inner.retrieve_scored(queries, topk)
