"""`emapg serve-retriever`: the BM25 retriever over HTTP, in Search-R1's request format.

POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}
  -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}
(without return_scores each hit is the document itself). Bad requests get 400, and requests
over the limits (a body over MAX_BODY_BYTES, more queries than `max_queries`) 413, with
{"error": message}; the standard library's ThreadingHTTPServer serves, one thread a request.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the CLI reads MAX_QUERIES without numpy or bm25s
    from emapg.search.retriever import BM25Retriever

MAX_BODY_BYTES = 1 << 20
# Search-R1's trainer sends a whole rollout batch in one request (512 prompts x 5 = 2560 in
# the paper); emapg's client splits its batches (task.max_queries_per_request, 512).
MAX_QUERIES = 4096
MAX_TOPK = 100


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, max_queries: int = MAX_QUERIES) -> tuple[list[str], int, bool]:
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
        raise RequestError(f"at most {max_queries} queries per request, got {len(queries)}", 413)
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
) -> ThreadingHTTPServer:
    if max_queries < 1:
        raise ValueError(f"max_queries must be >= 1, got {max_queries}")

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
            if length > MAX_BODY_BYTES:
                return self._send(413, {"error": f"body of {length} bytes; at most {MAX_BODY_BYTES}"})
            try:
                queries, topk, scores = parse_request(self.rfile.read(length), max_queries)
            except RequestError as e:
                return self._send(e.status, {"error": str(e)})
            hits = retriever.retrieve_scored(queries, topk)  # it locks its index itself
            result = [[{"document": d, "score": s} if scores else d for d, s in row] for row in hits]
            self._send(200, {"result": result})

        def _send(self, code: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # quiet: one line per request would flood a training log
            pass

    return ThreadingHTTPServer((host, port), Handler)
