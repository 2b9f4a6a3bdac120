"""Retrievers: BM25 over a local jsonl corpus (in-process), or any Search-R1-style HTTP server.

Both answer `retrieve(queries, topk)` with, per query, the top documents as
`{"id": ..., "contents": "title\\ntext"}` dicts, best first.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

from emapg.errors import EmapgError


class Retriever(Protocol):
    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]: ...


def load_corpus(path: str | Path) -> list[dict]:
    """Documents of a jsonl corpus: one JSON object per line with string `id` and `contents`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise EmapgError(f"retriever corpus {str(path)!r}: no such file")
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            raise EmapgError(f"{path}:{n}: not valid JSON") from None
        if not (isinstance(doc, dict) and isinstance(doc.get("contents"), str) and "id" in doc):
            raise EmapgError(f"{path}:{n}: expected an object with 'id' and a string 'contents'")
        docs.append({"id": str(doc["id"]), "contents": doc["contents"]})
    if not docs:
        raise EmapgError(f"retriever corpus {str(path)!r} has no documents")
    return docs


def _tokenize(texts: list[str]):
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class BM25Retriever:
    """BM25 (bm25s) over a jsonl corpus; the index is built once and saved beside the corpus
    as `<corpus>.bm25/`, keyed by the corpus's hash so an edited corpus is re-indexed."""

    def __init__(self, corpus_path: str | Path):
        try:
            import bm25s
        except ImportError:
            raise EmapgError(
                "the BM25 retriever needs bm25s, a dependency of emapg: pip install 'bm25s>=0.2' "
                "(or reinstall emapg: pip install -e .)"
            ) from None
        self.docs = load_corpus(corpus_path)
        path = Path(corpus_path).expanduser()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        self.index_dir = index_dir = path.with_name(path.name + ".bm25")
        stamp = index_dir / "corpus.sha256"
        if stamp.is_file() and stamp.read_text() == digest:
            self.index = bm25s.BM25.load(str(index_dir))
        else:
            self.index = bm25s.BM25()
            self.index.index(_tokenize([d["contents"] for d in self.docs]), show_progress=False)
            self.index.save(str(index_dir))
            stamp.write_text(digest)  # last: its presence marks a complete index

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        return [[doc for doc, _ in hits] for hits in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        if not queries:
            return []
        k = min(topk, len(self.docs))
        ids, scores = self.index.retrieve(_tokenize(queries), k=k, show_progress=False, n_threads=1)
        return [
            [(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True)]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


class HttpRetriever:
    """Client of a Search-R1 retrieval server: POST {url} with {"queries", "topk", "return_scores"}.

    Retries with exponential backoff (`backoff_s`, doubling) and then stops with one line."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return _parse_result(json.loads(response.read()), len(queries))
            except urllib.error.HTTPError as e:  # the server answered: retrying will not help
                detail = e.read().decode(errors="replace")[:200]
                raise EmapgError(f"retriever {self.url}: HTTP {e.code}: {detail}") from None
            except (OSError, ValueError) as e:  # refused, reset, timed out, or not JSON
                error = str(getattr(e, "reason", e))
        raise EmapgError(f"retriever {self.url}: no answer after {self.retries + 1} attempts ({error})")


def _parse_result(data, n: int) -> list[list[dict]]:
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or len(result) != n:
        raise ValueError(f"expected {{'result': [...]}} with {n} lists")
    # With return_scores each hit is {"document": doc, "score": s}; without, the doc itself.
    return [[hit.get("document", hit) for hit in hits] for hits in result]


def make_retriever(corpus: str, url: str) -> Retriever:
    return HttpRetriever(url) if url else BM25Retriever(corpus)


def format_information(docs: list[dict]) -> str:
    """Retrieved documents as the model sees them (Search-R1's format): `Doc i(Title: title) text`,
    one per line, the whole stripped."""
    out = ""
    for i, doc in enumerate(docs, 1):
        title, _, text = str(doc.get("contents", "")).partition("\n")
        out += f"Doc {i}(Title: {title}) {text}\n"
    return out.strip()
