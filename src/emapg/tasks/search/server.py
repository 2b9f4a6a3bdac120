"""`emapg serve-retriever`: a retriever over HTTP, in Search-R1's request format.

POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}
  -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}
(without return_scores each hit is the document itself). Every error is JSON {"error": message}:
400 for a malformed request, 413 past the limits, 404 for another path, 405 for another method,
503 with Retry-After when the server is full.

Limits, all settable: at most `max_queries` queries per request and `max_query_chars` characters
per query; the body cap follows from them (`body_cap`), so any request within both limits fits
it however its queries are written (long queries, JSON-escaped Chinese). At most `max_pending`
requests are admitted at once (read, searched, answered); one more is refused with 503 before its
body is parsed, so memory stays under max_pending bodies and their answers. The standard
library's ThreadingHTTPServer serves, one thread a connection; each admitted request is answered
whole and in its own order.

Every core: threads alone would not do it for BM25, whose work per query is mostly Python
(tokenizing, reading and decoding the passages, encoding the answer) and so holds the
interpreter's lock; 4 concurrent clients took 3.8-4.5x one client's time on 2 cores. So a BM25
index is searched by `workers` processes (by default one per usable core, at most max_pending),
each a fresh interpreter that opens the same memory-mapped index (it costs its own copy of the
vocabulary) and answers one request at a time, while this process's threads only read and write
the bytes (benchmarks/retriever_clients.py). A dense index keeps to threads: FAISS and torch
release the lock and use every core from one process, which holds the index once.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from emapg import fresh_process
from emapg.errors import EmapgError

if TYPE_CHECKING:  # not imported at run time: the CLI reads the defaults without numpy or bm25s
    from emapg.tasks.search.bm25 import BM25Retriever

# Search-R1's trainer sends a whole rollout batch in one request (512 prompts x 5 = 2560 in
# the paper); emapg's client splits its batches (task.max_queries_per_request, 512).
MAX_QUERIES = 4096
MAX_QUERY_CHARS = 1000
MAX_PENDING = 8
MAX_TOPK = 100
RETRY_AFTER_S = 1
# The longest JSON a character can take is 12 bytes: one outside the Basic Multilingual Plane
# written as two \uXXXX escapes. Per query add its quotes, comma and space; per request the rest.
_BYTES_PER_CHAR, _BYTES_PER_QUERY, _BYTES_PER_REQUEST = 12, 4, 1024


def body_cap(max_queries: int, max_query_chars: int) -> int:
    """The largest body a request within both limits can need, in bytes."""
    return max_queries * (max_query_chars * _BYTES_PER_CHAR + _BYTES_PER_QUERY) + _BYTES_PER_REQUEST


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _limits(max_queries: int, max_query_chars: int) -> str:
    return f"limits: {max_queries} queries per request (--max-queries), {max_query_chars} characters per query (--max-query-chars)"


def parse_request(
    body: bytes, max_queries: int = MAX_QUERIES, max_query_chars: int = MAX_QUERY_CHARS
) -> tuple[list[str], int, bool]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise RequestError("expected a JSON object")
    queries, topk, scores = data.get("queries"), data.get("topk", 3), data.get("return_scores", False)
    if not (isinstance(queries, list) and all(isinstance(q, str) for q in queries)):
        raise RequestError("'queries' must be a list of strings")
    if len(queries) > max_queries:
        raise RequestError(f"{len(queries)} queries; {_limits(max_queries, max_query_chars)}", 413)
    longest = max(range(len(queries)), key=lambda i: len(queries[i]), default=None)
    if longest is not None and len(queries[longest]) > max_query_chars:
        raise RequestError(
            f"query {longest} has {len(queries[longest])} characters; {_limits(max_queries, max_query_chars)}",
            413,
        )
    if topk is None:
        topk = 3
    if not (isinstance(topk, int) and not isinstance(topk, bool) and 1 <= topk <= MAX_TOPK):
        raise RequestError(f"'topk' must be an integer in [1, {MAX_TOPK}]")
    if not isinstance(scores, bool):
        raise RequestError("'return_scores' must be true or false")
    return queries, topk, scores


def answer(retriever, body: bytes, max_queries: int, max_query_chars: int) -> tuple[int, bytes]:
    """The status and JSON body that answer one request's `body` (in this process or a worker)."""
    try:
        queries, topk, scores = parse_request(body, max_queries, max_query_chars)
        hits = retriever.retrieve_scored(queries, topk)
    except RequestError as e:
        return e.status, _json({"error": str(e)})
    except Exception as e:  # the retriever's own failure (a corpus changed while served): one line
        return 500, _json({"error": f"retriever failed: {type(e).__name__}: {e}"})
    result = [[{"document": d, "score": s} if scores else d for d, s in row] for row in hits]
    return 200, _json({"result": result})


def _json(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def default_workers(retriever, max_pending: int) -> int:
    """Processes that search: one per usable core for BM25 (at most max_pending: no more are
    ever busy), else 1, the server's own process (see the module doc)."""
    bm25 = sys.modules.get("emapg.tasks.search.bm25")  # not imported: the retriever is not BM25
    if bm25 is None or not isinstance(retriever, bm25.BM25Retriever):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, max_pending)


def _worker(fd: int) -> None:
    """A worker process: receive sys.path, the pickled retriever and the limits, then answer
    request bodies one at a time until the server closes the connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it closes its workers
    accepted = fresh_process.accept(fd)
    if accepted is None:
        return
    conn, (retriever, max_queries, max_query_chars) = accepted
    while True:
        try:
            conn.send(answer(retriever, conn.recv_bytes(), max_queries, max_query_chars))
        except (EOFError, OSError):  # the server is gone
            return


class _Workers:
    """`n` worker processes, each answering one request at a time; a request waits for an idle one.

    Each is a fresh interpreter (emapg.fresh_process), as the reward worker is, and gets the
    retriever pickled: a BM25 index pickles as its corpus's path and opens
    the same memory-mapped files. One that dies (killed, out of memory) fails its request with a
    500 and is replaced."""

    def __init__(self, retriever, n: int, max_queries: int, max_query_chars: int):
        self._setup = pickle.dumps((retriever, max_queries, max_query_chars))
        self._processes: list[subprocess.Popen] = []
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        try:
            for worker in [self._spawn() for _ in range(n)]:  # all load the index at once
                self._idle.put(self._ready(*worker))
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> tuple[subprocess.Popen, Connection]:
        process, conn = fresh_process.start("emapg.tasks.search.server:_worker", self._setup)
        self._processes.append(process)
        return process, conn

    def _ready(self, process: subprocess.Popen, conn: Connection) -> tuple[subprocess.Popen, Connection]:
        try:
            reply = conn.recv()
        except EOFError:
            reply = f"it exited with code {process.wait()}"
        if reply != "ready":
            process.kill()
            raise EmapgError(f"serve-retriever: a worker process could not open the retriever ({reply})")
        return process, conn

    def __call__(self, body: bytes) -> tuple[int, bytes]:
        process, conn = self._idle.get()
        try:
            conn.send_bytes(body)
            return conn.recv()
        except (EOFError, OSError):  # it died with this request
            process.kill()
            conn.close()
            error = f"a retriever worker process exited (code {process.wait()}) with this request"
            if self._closed:  # the server is stopping: no replacement
                return 503, _json({"error": f"{error}; the server is stopping"})
            try:
                process, conn = self._ready(*self._spawn())
            except EmapgError as e:  # the dead one goes back: the next request tries again
                return 500, _json({"error": f"{error}; {e}"})
            return 500, _json({"error": f"{error}; it has been replaced"})
        finally:
            self._idle.put((process, conn))

    def close(self) -> None:
        self._closed = True
        for process in self._processes:
            process.kill()
            process.wait()


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests to a `_Server`: POST /retrieve is admitted (or refused) and
    answered; every other path or method, and every error, gets a JSON error."""

    server: _Server

    def do_POST(self):
        if self.path != "/retrieve":
            return self._send(404, {"error": f"no endpoint {self.path}; POST /retrieve"})
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            return self._send(400, {"error": "need a Content-Length header"})
        srv = self.server
        if length > srv.cap:
            limits = _limits(srv.max_queries, srv.max_query_chars)
            return self._send(413, {"error": f"body of {length} bytes; at most {srv.cap} ({limits})"})
        if not srv.admitted.acquire(blocking=False):
            self._drain(length)  # read, not parsed: the client then sees the 503, not a reset
            return self._send(
                503,
                {"error": f"busy: {srv.max_pending} requests in progress (--max-pending); retry later"},
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        try:
            self._send(*srv.respond(self.rfile.read(length)))
        finally:
            srv.admitted.release()

    def do_GET(self):
        if self.path != "/retrieve":
            return self._send(404, {"error": f"no endpoint {self.path}; POST /retrieve"})
        self._send(405, {"error": f"{self.command} /retrieve: use POST"}, {"Allow": "POST"})

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def send_error(self, code, message=None, explain=None):  # the base class answers in HTML
        self.close_connection = True
        self._send(code, {"error": message or self.responses.get(code, ("",))[0]})

    def _drain(self, length: int) -> None:
        while length > 0 and (chunk := self.rfile.read(min(length, 1 << 16))):
            length -= len(chunk)

    def _send(self, code: int, payload: dict | bytes, headers: dict | None = None):
        body = payload if isinstance(payload, bytes) else _json(payload)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args):  # quiet: one line per request would flood a training log
        pass


class _Server(ThreadingHTTPServer):
    """The HTTP server of one retriever and its limits; `pool`, once set, is the worker processes
    that search in its place (closed with the server)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: many trainer processes may connect at once

    def __init__(self, address, retriever, max_queries: int, max_query_chars: int, max_pending: int):
        self.retriever, self.max_queries, self.max_query_chars = retriever, max_queries, max_query_chars
        self.max_pending, self.cap = max_pending, body_cap(max_queries, max_query_chars)
        self.admitted = threading.BoundedSemaphore(max_pending)
        self.pool: _Workers | None = None  # started once the port is ours
        super().__init__(address, _Handler)

    def respond(self, body: bytes) -> tuple[int, bytes]:
        """The status and JSON body answering `body`: from a worker process, or from this one."""
        if self.pool:
            return self.pool(body)
        return answer(self.retriever, body, self.max_queries, self.max_query_chars)

    def server_close(self):
        super().server_close()
        if self.pool:
            self.pool.close()


def make_server(
    retriever: BM25Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queries: int = MAX_QUERIES,
    max_query_chars: int = MAX_QUERY_CHARS,
    max_pending: int = MAX_PENDING,
    workers: int | None = None,
) -> ThreadingHTTPServer:
    """The server (not yet serving: call serve_forever, and server_close to stop its workers).
    `workers`: processes that search (1: this one's threads); None: `default_workers`. The
    server's `workers` attribute is the number chosen."""
    workers = default_workers(retriever, max_pending) if workers is None else workers
    for name, value in [("max_queries", max_queries), ("max_query_chars", max_query_chars),
                        ("max_pending", max_pending), ("workers", workers)]:  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    server = _Server((host, port), retriever, max_queries, max_query_chars, max_pending)
    server.workers = workers
    try:
        server.pool = _Workers(retriever, workers, max_queries, max_query_chars) if workers > 1 else None
    except BaseException:
        server.server_close()
        raise
    return server
