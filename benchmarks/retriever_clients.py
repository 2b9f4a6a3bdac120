"""Concurrent clients of the BM25 retriever server: 1 client against 4 at once, each sending the
paper's batch (2,560 queries, one request), and the ratio of their wall times.

On N free cores a server that answers concurrent requests on every core takes about 4/N times
one client's time for 4 clients (2x on 2 cores); one that answers one request at a time takes
4x. Two servers are measured in the same run: `emapg serve-retriever`'s (make_server's default
workers: one process per usable core) and the same server with workers=1 (threads only, all in
one interpreter). Each runs in its own process on a synthetic corpus (the generator of
benchmarks/retrieval_scale.py); each client is its own process (spawned once, before timing).
Rounds alternate 1 client and 4 clients, so that load from other processes hits both alike; the
ratio is of the medians, and every concurrent answer is checked equal to the single client's.

What the machine can give is measured in the same run too: the wall time of 2 CPU-bound
processes at once over 1 alone (1.0x with 2 idle cores; 2.0x when something else holds one).

    python benchmarks/retriever_clients.py                  # 20,000 passages, 5 rounds
    python benchmarks/retriever_clients.py --passages 200000 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrieval_scale import generate  # noqa: E402  (the same synthetic corpus)

SRC = str(Path(__file__).resolve().parents[1] / "src")  # the emapg of this checkout
SERVER = r"""
import sys
from emapg.tasks.search.bm25 import BM25Retriever
from emapg.tasks.search.server import make_server
server = make_server(BM25Retriever(sys.argv[1]), port=0, workers=int(sys.argv[2]) or None)
print(f"http://127.0.0.1:{server.server_address[1]}/retrieve", server.workers, flush=True)
server.serve_forever()
"""
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass"
_client = None


def _connect(url: str) -> None:
    global _client
    sys.path.insert(0, SRC)
    from emapg.tasks.search.retriever import HttpRetriever

    _client = HttpRetriever(url, max_queries=4096, timeout_s=600)


def _ask(queries: list[str]) -> list:
    return _client.retrieve(queries, 3)


def parallelism() -> float:
    """Wall time of 2 processes burning 1 s of CPU each at once, over 1 alone."""

    def run(n: int) -> float:
        t = time.perf_counter()
        for p in [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(n)]:
            p.wait()
        return time.perf_counter() - t

    return run(2) / run(1)


def measure(corpus: Path, workers: int, batches: list[list[str]], rounds: int) -> tuple[int, list, list]:
    """The server's worker processes, and the wall times of 1 client and of all clients at once,
    `rounds` of each, alternating. `workers` 0: make_server's default."""
    env = {**os.environ, "PYTHONPATH": SRC}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(corpus), str(workers)],
                              stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        line = server.stdout.readline().split()  # once the index is open and the workers ready
        if not line:
            sys.exit(f"the server did not start (workers={workers})")
        url, started = line[0], int(line[1])
        with multiprocessing.get_context("spawn").Pool(len(batches), _connect, (url,)) as pool:
            alone = [pool.apply(_ask, (b,)) for b in batches]  # warm-up, and the answers to match
            one, many = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                pool.apply(_ask, (batches[0],))
                one.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = pool.map(_ask, batches, chunksize=1)
                many.append(time.perf_counter() - t)
                if got != alone:
                    sys.exit(f"workers={workers}: concurrent answers differ from the single client's")
        return started, one, many
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=20_000)
    ap.add_argument("--queries", type=int, default=2560, help="per client, one request (the paper's batch)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of (1 client, then all clients)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    free = parallelism()
    with tempfile.TemporaryDirectory(prefix="retriever-clients-") as where:
        corpus = Path(where) / "corpus.jsonl"
        words, cdf = generate(corpus, args.passages)
        rng = np.random.default_rng(1)
        batches = [  # each client its own queries, 2-5 words from the body of the distribution
            [" ".join(words[np.searchsorted(cdf, rng.uniform(0.3, 1.0, size=rng.integers(2, 6)))])
             for _ in range(args.queries)]
            for _ in range(args.clients)
        ]  # fmt: skip
        results = {w: measure(corpus, w, batches, args.rounds) for w in (0, 1)}
    free_after = parallelism()
    print(f"{args.passages:,} passages, {args.queries:,} queries a client, {args.rounds} rounds; {cores} usable "
          f"CPUs; load average (1 min) {load:.2f} before, {os.getloadavg()[0]:.2f} after; 2 CPU-bound "
          f"processes at once take {free:.2f}x one's time before, {free_after:.2f}x after")  # fmt: skip
    for w in (1, 0):
        started, one, many = results[w]
        name = "workers=1 (threads only)" if w else f"default: {started} worker processes"
        print(f"{name}: 1 client {statistics.median(one):.2f} s ({min(one):.2f}-{max(one):.2f}), "
              f"{args.clients} at once {statistics.median(many):.2f} s ({min(many):.2f}-{max(many):.2f}), "
              f"ratio {statistics.median(many) / statistics.median(one):.2f}x; answers equal")  # fmt: skip


if __name__ == "__main__":
    main()
