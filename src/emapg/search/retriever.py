"""Retrievers: BM25 over a local jsonl corpus (in-process), or any Search-R1-style HTTP server.

Both answer `retrieve(queries, topk)` with, per query, the top documents as
`{"id": ..., "contents": "title\\ntext"}` dicts, best first.

The BM25 index is built by streaming the corpus (a 14 GB wiki-18 never sits in memory): one
pass tokenizes each line, records its byte range and writes (document, term, count) triples to
term-bucketed scratch files; a second pass turns each bucket into its slice of the bm25s
score matrix. The result is saved in bm25s's own format and served memory-mapped, and a
document's text is read back from the corpus by its byte range only when it is returned.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from emapg.errors import EmapgError


class Retriever(Protocol):
    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]: ...


def iter_corpus(path: str | Path, digest=None) -> Iterator[tuple[int, int, dict]]:
    """Stream a jsonl corpus: (start byte, end byte, {"id", "contents"}) per document.

    Blank lines are skipped; a malformed line stops with one line naming the file and line.
    `digest` (a hashlib object), if given, is fed every byte of the file on the way."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise EmapgError(f"retriever corpus {str(path)!r}: no such file")
    offset = 0
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if digest is not None:
                digest.update(line)
            if not line.strip():
                continue
            yield start, offset, _parse_line(line, path, n)


def _parse_line(line: bytes, path, n) -> dict:
    try:
        doc = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EmapgError(f"{path}:{n}: not valid JSON") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("contents"), str) and "id" in doc):
        raise EmapgError(f"{path}:{n}: expected an object with 'id' and a string 'contents'")
    return {"id": str(doc["id"]), "contents": doc["contents"]}


def _tokenize(texts: list[str]):
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


# --- the streamed index --------------------------------------------------------------------------

INDEX_FORMAT = 2  # bumped when the saved layout changes; an index of another format is rebuilt
# bm25s's defaults (BM25(): method "lucene", k1 1.5, b 0.75) and its tokenizer's pattern; the
# streamed build reproduces bm25s's own index of the same corpus (the tests compare them).
K1, B = 1.5, 0.75
_TOKEN = re.compile(r"(?u)\b\w\w+\b")
CHUNK_DOCS = 20_000  # documents tokenized per scratch write
BUCKET_BYTES = 32 << 20  # corpus bytes per term bucket: each bucket's triples fit in memory


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _write_npy(path: Path, dtype: str, shape: tuple) -> object:
    """An open .npy file with its header written; the caller appends the raw data in order."""
    f = path.open("wb")
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
    )
    return f


def build_index(corpus: str | Path, index_dir: str | Path, *, buckets: int | None = None) -> dict:
    """Build the BM25 index of `corpus` into `index_dir` without holding the corpus in memory.

    Memory: the vocabulary, one int32 length per document, one chunk of documents' tokens and
    one bucket's (document, term, count) triples. Disk: scratch triples of about 12 bytes per
    distinct term of each document, deleted at the end. Returns the index's metadata."""
    corpus, index_dir = Path(corpus).expanduser(), Path(index_dir)
    from bm25s import __version__ as bm25s_version

    stat = corpus.stat()
    n_buckets = buckets or min(512, max(1, math.ceil(stat.st_size / BUCKET_BYTES)))
    if index_dir.exists():
        shutil.rmtree(index_dir)
    (index_dir / "scratch").mkdir(parents=True)
    digest = hashlib.sha256()
    vocab, df, doc_len = _scan(corpus, index_dir, n_buckets, digest)
    if not len(doc_len):
        shutil.rmtree(index_dir)
        raise EmapgError(f"retriever corpus {str(corpus)!r} has no documents")
    final = _write_scores(index_dir, n_buckets, df, doc_len)
    vocab_final = dict(zip(vocab, final.tolist(), strict=True))
    vocab.clear()  # one vocabulary in memory at a time
    vocab_final[""] = len(final)  # bm25s's empty token, which matches no document
    with (index_dir / "vocab.index.json").open("w", encoding="utf-8") as f:
        json.dump(vocab_final, f, ensure_ascii=False)
    del vocab_final
    params = {"k1": K1, "b": B, "delta": 0.5, "method": "lucene", "idf_method": "lucene",
              "dtype": "float32", "int_dtype": "int32", "num_docs": len(doc_len),
              "version": bm25s_version, "backend": "numpy"}  # fmt: skip
    (index_dir / "params.index.json").write_text(json.dumps(params, indent=4))
    meta = {"format": INDEX_FORMAT, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": digest.hexdigest(), "num_docs": len(doc_len)}  # fmt: skip
    (index_dir / "meta.json").write_text(json.dumps(meta))  # last: its presence marks a complete index
    return meta


def _scan(corpus: Path, index_dir: Path, n_buckets: int, digest) -> tuple[dict, np.ndarray, np.ndarray]:
    """One pass over the corpus: each document's byte span to offsets.i64, its (document, term,
    count) triples to scratch/<term % n_buckets>.i32; returns the vocabulary (term -> first-seen
    id), the documents per term and the tokens per document (stopwords removed)."""
    from bm25s.stopwords import STOPWORDS_EN

    stop, findall = frozenset(STOPWORDS_EN), _TOKEN.findall
    vocab: dict[str, int] = {}
    df = np.zeros(1024, np.int64)  # documents per term, by first-seen term id
    lengths: list[np.ndarray] = []  # tokens per document, per chunk
    files = [(index_dir / "scratch" / f"{b}.i32").open("wb") for b in range(n_buckets)]

    def flush(chunk: list[list[int]]) -> None:
        nonlocal df
        sizes = np.fromiter(map(len, chunk), np.int64, len(chunk))
        base = sum(map(len, lengths))
        lengths.append(sizes.astype(np.int32))
        tokens = np.fromiter((t for ids in chunk for t in ids), np.int64, int(sizes.sum()))
        docs = np.repeat(np.arange(len(chunk), dtype=np.int64), sizes)
        pairs, counts = np.unique((docs << 32) | tokens, return_counts=True)  # by document, term
        terms = pairs & 0xFFFFFFFF
        if len(vocab) > len(df):
            df = np.concatenate([df, np.zeros(max(len(vocab), 2 * len(df)) - len(df), np.int64)])
        df[: len(vocab)] += np.bincount(terms, minlength=len(vocab))
        triples = np.stack([(pairs >> 32) + base, terms, counts]).T.astype(np.int32)
        bucket = terms % n_buckets
        order = np.argsort(bucket, kind="stable")  # keeps document order inside each bucket
        bounds = np.searchsorted(bucket[order], np.arange(n_buckets + 1))
        for b in range(n_buckets):
            if bounds[b] < bounds[b + 1]:
                files[b].write(triples[order[bounds[b] : bounds[b + 1]]].tobytes())

    with (index_dir / "offsets.i64").open("wb") as offsets:
        chunk: list[list[int]] = []
        spans: list[tuple[int, int]] = []
        for start, end, doc in iter_corpus(corpus, digest):
            ids = []
            for token in findall(doc["contents"].lower()):
                if token not in stop:
                    i = vocab.get(token)
                    if i is None:
                        i = vocab[token] = len(vocab)
                    ids.append(i)
            chunk.append(ids)
            spans.append((start, end))
            if len(chunk) == CHUNK_DOCS:
                flush(chunk)
                offsets.write(np.asarray(spans, np.int64).tobytes())
                chunk, spans = [], []
        if chunk:
            flush(chunk)
            offsets.write(np.asarray(spans, np.int64).tobytes())
    for f in files:
        f.close()
    doc_len = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    return vocab, df[: len(vocab)], doc_len


def _write_scores(index_dir: Path, n_buckets: int, df: np.ndarray, doc_len: np.ndarray) -> np.ndarray:
    """The score matrix (CSC, a column per term) from the scratch buckets, which it deletes;
    returns each first-seen term id's column."""
    n_docs, n_vocab = len(doc_len), len(df)
    avg_len = float(doc_len.sum(dtype=np.int64)) / n_docs
    # idf as bm25s computes it (Lucene's), one Python float per term, stored as float32
    idf = np.fromiter(
        (math.log(1 + (n_docs - d + 0.5) / (d + 0.5)) for d in df.tolist()), np.float64, n_vocab
    ).astype(np.float32)
    # Final term ids: bucket by bucket, first-seen order inside a bucket, so that each bucket
    # file holds one contiguous run of the score matrix's columns.
    per_bucket = np.array([len(range(b, n_vocab, n_buckets)) for b in range(n_buckets)], np.int64)
    first = np.concatenate([[0], np.cumsum(per_bucket)])
    seen = np.arange(n_vocab, dtype=np.int64)
    final = first[seen % n_buckets] + seen // n_buckets
    indptr = np.zeros(n_vocab + 1, np.int64)
    indptr[final + 1] = df
    np.cumsum(indptr, out=indptr)
    data_f = _write_npy(index_dir / "data.csc.index.npy", "float32", (int(indptr[-1]),))
    indices_f = _write_npy(index_dir / "indices.csc.index.npy", "int32", (int(indptr[-1]),))
    with data_f, indices_f:
        for b in range(n_buckets):
            path = index_dir / "scratch" / f"{b}.i32"
            triples = np.fromfile(path, np.int32).reshape(-1, 3)
            path.unlink()
            doc, term, tf = triples[:, 0], triples[:, 1], triples[:, 2]
            order = np.argsort(term // n_buckets, kind="stable")  # by term, then document
            doc, term, tf = doc[order], term[order], tf[order].astype(np.float32).astype(np.float64)
            # bm25s's lucene score: idf * tf / (k1 * (1 - b + b * len / avg_len) + tf), in
            # float64 from float32 idf and tf, stored as float32
            norm = K1 * ((1 - B) + (B * doc_len[doc].astype(np.float64)) / avg_len)
            score = idf[term].astype(np.float64) * (tf / (norm + tf))
            data_f.write(score.astype(np.float32).tobytes())
            indices_f.write(doc.astype(np.int32).tobytes())
    (index_dir / "scratch").rmdir()
    np.save(index_dir / "indptr.csc.index.npy", indptr)
    return final


def _index_is_current(corpus: Path, index_dir: Path) -> bool:
    """Whether `index_dir` holds a complete index of this corpus.

    The key is the corpus's full sha256, computed once while building. Hashing 14 GB again
    at every start would take about half a minute, so size and mtime stand in for it: same
    size and mtime, the index is used; same size but another mtime (a copy, a touch), the
    corpus is hashed and the index used if the hash matches; another size, it is rebuilt."""
    try:
        meta = json.loads((index_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    stat = corpus.stat()
    if meta.get("format") != INDEX_FORMAT or meta.get("size") != stat.st_size:
        return False
    if meta.get("mtime_ns") == stat.st_mtime_ns:
        return True
    if _sha256(corpus) != meta.get("sha256"):
        return False
    meta["mtime_ns"] = stat.st_mtime_ns  # the same bytes: skip the hash next time
    (index_dir / "meta.json").write_text(json.dumps(meta))
    return True


class Documents:
    """The corpus's documents by index, each read from its byte range when asked for."""

    def __init__(self, corpus: Path, offsets: Path):
        self.path = corpus
        self.spans = np.memmap(offsets, dtype=np.int64, mode="r").reshape(-1, 2)
        self._fd = os.open(corpus, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> dict:
        start, end = (int(x) for x in self.spans[i])
        line = os.pread(self._fd, end - start, start)  # no shared file position: thread-safe
        if len(line) != end - start:
            raise EmapgError(f"retriever corpus {str(self.path)!r} changed while being served")
        return _parse_line(line, self.path, f"byte {start}")

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None


class BM25Retriever:
    """BM25 (bm25s) over a jsonl corpus; the index is built once by streaming the corpus and
    saved beside it as `<corpus>.bm25/`, keyed by the corpus's contents (an edited corpus is
    re-indexed), and served memory-mapped."""

    def __init__(self, corpus_path: str | Path):
        try:
            import bm25s
        except ImportError:
            raise EmapgError(
                "the BM25 retriever needs bm25s, a dependency of emapg: pip install 'bm25s>=0.2' "
                "(or reinstall emapg: pip install -e .)"
            ) from None
        path = Path(corpus_path).expanduser()
        if not path.is_file():
            raise EmapgError(f"retriever corpus {str(path)!r}: no such file")
        self.index_dir = index_dir = path.with_name(path.name + ".bm25")
        if not _index_is_current(path, index_dir):
            build_index(path, index_dir)
        self.index = bm25s.BM25.load(str(index_dir), mmap=True, show_progress=False)
        self.docs = Documents(path, index_dir / "offsets.i64")
        self._lock = threading.Lock()  # the bm25s index is not documented as thread-safe

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        return [[doc for doc, _ in hits] for hits in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        if not queries:
            return []
        k = min(topk, len(self.docs))
        with self._lock:
            ids, scores = self.index.retrieve(_tokenize(queries), k=k, show_progress=False, n_threads=1)
        return [
            [(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True)]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


class HttpRetriever:
    """Client of a Search-R1 retrieval server: POST {url} with {"queries", "topk", "return_scores"}.

    A batch is sent as consecutive requests of at most `max_queries` queries (servers cap a
    request: `emapg serve-retriever` at 4096 by default); the results are joined in order.
    Each request retries with exponential backoff (`backoff_s`, doubling), then stops with one line."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        max_queries: int = 512,
    ):
        if max_queries < 1:
            raise EmapgError(f"retriever {url}: max_queries must be >= 1, got {max_queries}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.max_queries = max_queries

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        results: list[list[dict]] = []
        for i in range(0, len(queries), self.max_queries):
            results += self._request(queries[i : i + self.max_queries], topk)
        return results

    def _request(self, queries: list[str], topk: int) -> list[list[dict]]:
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
                detail = " ".join(e.read().decode(errors="replace")[:200].split())
                hint = " (lower task.max_queries_per_request)" if e.code == 413 else ""
                raise EmapgError(f"retriever {self.url}: HTTP {e.code}: {detail}{hint}") from None
            except (OSError, ValueError) as e:  # refused, reset, timed out, or not JSON
                error = str(getattr(e, "reason", e))
        raise EmapgError(f"retriever {self.url}: no answer after {self.retries + 1} attempts ({error})")


def _parse_result(data, n: int) -> list[list[dict]]:
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or len(result) != n:
        raise ValueError(f"expected {{'result': [...]}} with {n} lists")
    # With return_scores each hit is {"document": doc, "score": s}; without, the doc itself.
    return [[hit.get("document", hit) for hit in hits] for hits in result]


def make_retriever(corpus: str, url: str, max_queries_per_request: int = 512) -> Retriever:
    if url:
        return HttpRetriever(url, max_queries=max_queries_per_request)
    return BM25Retriever(corpus)


def format_information(docs: list[dict]) -> str:
    """Retrieved documents as the model sees them (Search-R1's format): `Doc i(Title: title) text`,
    one per line, the whole stripped."""
    out = ""
    for i, doc in enumerate(docs, 1):
        title, _, text = str(doc.get("contents", "")).partition("\n")
        out += f"Doc {i}(Title: {title}) {text}\n"
    return out.strip()
