"""Retrievers: the protocol, the client of a Search-R1-style HTTP server, and the choice between it
and the local BM25 index (`make_retriever`).

Every retriever answers `retrieve(queries, topk)` with, per query, the top documents as
`{"id": ..., "contents": "title\\ntext"}` dicts, best first. The local ones are BM25
(emapg.tasks.search.bm25) and dense (emapg.tasks.search.dense, FAISS); their indexes keep each
document's byte range, not its text, and read a document from the corpus only when it is returned.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Protocol

from emapg.errors import EmapgError


class Retriever(Protocol):
    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]: ...


class HttpRetriever:
    """Client of a Search-R1 retrieval server: POST {url} with {"queries", "topk", "return_scores"}.

    A batch is sent as consecutive requests of at most `max_queries` queries (servers cap a
    request: `emapg serve-retriever` at 4096 by default), each query cut to `max_query_chars`
    characters (the server's per-query cap, 1000 by default); the results are joined in order.
    A refused or dropped connection is retried `retries` times with exponential backoff; a busy
    server's 503 is retried after its Retry-After for up to `busy_timeout_s` in all. Then the
    run stops with one line."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        max_queries: int = 512,
        max_query_chars: int = 1000,
        busy_timeout_s: float = 600.0,
    ):
        if max_queries < 1 or max_query_chars < 1:
            raise EmapgError(f"retriever {url}: max_queries and max_query_chars must be >= 1")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.max_queries, self.max_query_chars, self.busy_timeout_s = (
            max_queries,
            max_query_chars,
            busy_timeout_s,
        )

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        queries = [q[: self.max_query_chars] for q in queries]
        results: list[list[dict]] = []
        for i in range(0, len(queries), self.max_queries):
            results += self._request(queries[i : i + self.max_queries], topk)
        return results

    def _request(self, queries: list[str], topk: int) -> list[list[dict]]:
        body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        error, failures, busy_since = "", 0, None
        while True:
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return _parse_result(json.loads(response.read()), len(queries))
            except urllib.error.HTTPError as e:
                detail = " ".join(e.read().decode(errors="replace")[:200].split())
                if e.code != 503:  # the server answered: retrying will not help
                    hint = (
                        " (lower task.max_queries_per_request or task.max_query_chars)"
                        if e.code == 413
                        else ""
                    )
                    raise EmapgError(f"retriever {self.url}: HTTP {e.code}: {detail}{hint}") from None
                busy_since = busy_since or time.monotonic()
                waited = time.monotonic() - busy_since
                if waited >= self.busy_timeout_s:
                    raise EmapgError(
                        f"retriever {self.url}: still busy (HTTP 503) after {waited:.0f} s of retries "
                        f"(task.busy_timeout_s {self.busy_timeout_s:g}): {detail}"
                    ) from None
                time.sleep(min(_retry_after(e), self.busy_timeout_s - waited))
            except (OSError, ValueError) as e:  # refused, reset, timed out, or not JSON
                error, failures = str(getattr(e, "reason", e)), failures + 1
                if failures > self.retries:
                    raise EmapgError(
                        f"retriever {self.url}: no answer after {failures} attempts ({error})"
                    ) from None
                time.sleep(self.backoff_s * 2 ** (failures - 1))


def _retry_after(error: urllib.error.HTTPError) -> float:
    try:
        return max(0.05, float(error.headers.get("Retry-After", 1)))
    except ValueError:
        return 1.0


def _parse_result(data, n: int) -> list[list[dict]]:
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or len(result) != n:
        raise ValueError(f"expected {{'result': [...]}} with {n} lists")
    # With return_scores each hit is {"document": doc, "score": s}; without, the doc itself.
    return [[hit.get("document", hit) for hit in hits] for hits in result]


def make_retriever(
    corpus: str,
    url: str,
    max_queries_per_request: int = 512,
    max_query_chars: int = 1000,
    busy_timeout_s: float = 600.0,
) -> Retriever:
    if url:
        return HttpRetriever(
            url, max_queries=max_queries_per_request, max_query_chars=max_query_chars,
            busy_timeout_s=busy_timeout_s,
        )  # fmt: skip
    from emapg.tasks.search.bm25 import BM25Retriever

    return BM25Retriever(corpus)


def format_information(docs: list[dict]) -> str:
    """Retrieved documents as the model sees them (Search-R1's format): `Doc i(Title: title) text`,
    one per line, the whole stripped."""
    out = ""
    for i, doc in enumerate(docs, 1):
        title, _, text = str(doc.get("contents", "")).partition("\n")
        out += f"Doc {i}(Title: {title}) {text}\n"
    return out.strip()
