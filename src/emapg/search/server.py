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
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the CLI reads the defaults without numpy or bm25s
    from emapg.search.bm25 import BM25Retriever

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


def make_server(
    retriever: BM25Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queries: int = MAX_QUERIES,
    max_query_chars: int = MAX_QUERY_CHARS,
    max_pending: int = MAX_PENDING,
) -> ThreadingHTTPServer:
    for name, value in [("max_queries", max_queries), ("max_query_chars", max_query_chars),
                        ("max_pending", max_pending)]:  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    cap = body_cap(max_queries, max_query_chars)
    admitted = threading.BoundedSemaphore(max_pending)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/retrieve":
                return self._send(404, {"error": f"no endpoint {self.path}; POST /retrieve"})
            try:
                length = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                length = -1
            if length < 0:
                return self._send(400, {"error": "need a Content-Length header"})
            if length > cap:
                return self._send(
                    413,
                    {
                        "error": f"body of {length} bytes; at most {cap} ({_limits(max_queries, max_query_chars)})"
                    },
                )
            if not admitted.acquire(blocking=False):
                self._drain(length)  # read, not parsed: the client then sees the 503, not a reset
                return self._send(
                    503,
                    {"error": f"busy: {max_pending} requests in progress (--max-pending); retry later"},
                    {"Retry-After": str(RETRY_AFTER_S)},
                )
            try:
                queries, topk, scores = parse_request(self.rfile.read(length), max_queries, max_query_chars)
                hits = retriever.retrieve_scored(queries, topk)
                result = [[{"document": d, "score": s} if scores else d for d, s in row] for row in hits]
                self._send(200, {"result": result})
            except RequestError as e:
                self._send(e.status, {"error": str(e)})
            finally:
                admitted.release()

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

        def _send(self, code: int, payload: dict, headers: dict | None = None):
            body = json.dumps(payload).encode()
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

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # the listen backlog: many trainer processes may connect at once

    return Server((host, port), Handler)
