"""BM25 over a local jsonl corpus: a streamed index and an exact top-k that skips what cannot win.

Why a top-k of our own: the paper's batch is 2,560 queries a turn over 21M passages. bm25s
scores every posting of every query term (its numpy backend a few queries per second at 2M
passages, its numba backend hundreds, with an index built in memory: 6 GB at 2M); tantivy, a
real engine with block-max WAND, was no faster than bm25s numba on the same corpus (its block
maxima rarely fall below the threshold when most postings share a term frequency). Both are
measured beside this one in benchmarks/retrieval_scale.py (figures in benchmarks/RESULTS.md).
MaxScore does better here: a document whose query terms are all common cannot reach the top k
once the k-th best score exceeds what those terms together could add, so documents are
enumerated from the rarer terms' postings only and the common terms are looked up for them.
It is exact, compiled with numba, and about 60 lines (`_maxscore`).

The index is built by streaming the corpus (a 14 GB wiki-18 never sits in memory): one pass
tokenizes each line, records its byte range and writes (document, term, count) triples to
term-bucketed scratch files; a second pass turns each bucket into its slice of the score matrix
in bm25s's format and scoring (lucene, k1 1.5, b 0.75, its tokenizer and English stopwords: each
stored score is bm25s's, bit for bit) and records each term's largest score. It is served
memory-mapped; a document's text is read back from the corpus by its byte range when returned.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
from numba import njit

from emapg.errors import EmapgError
from emapg.tasks.search.corpus import Documents, index_is_current, iter_corpus

INDEX_FORMAT = 6  # bumped when the saved layout changes; an index of another format is rebuilt
# bm25s's defaults (BM25(): method "lucene", k1 1.5, b 0.75) and its tokenizer's pattern; the
# streamed build reproduces bm25s's own index of the same corpus (the tests compare them).
K1, B = 1.5, 0.75
_TOKEN = re.compile(r"(?u)\b\w\w+\b")
CHUNK_DOCS = 20_000  # documents tokenized per scratch write
BUCKET_BYTES = 32 << 20  # corpus bytes per term bucket: each bucket's triples fit in memory


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
    """The score matrix (CSC, a column per term, documents in order) and each term's largest
    score, from the scratch buckets, which it deletes; returns each first-seen term id's column."""
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
    max_score = np.zeros(n_vocab, np.float32)  # per final term id: the bound MaxScore prunes by
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
            score = (idf[term].astype(np.float64) * (tf / (norm + tf))).astype(np.float32)
            data_f.write(score.tobytes())
            indices_f.write(doc.astype(np.int32).tobytes())
            starts = np.flatnonzero(np.r_[True, term[1:] != term[:-1]])
            max_score[final[term[starts]]] = np.maximum.reduceat(score, starts)
    (index_dir / "scratch").rmdir()
    np.save(index_dir / "indptr.csc.index.npy", indptr)
    np.save(index_dir / "max_score.npy", max_score)
    return final


# Bounds are compared with sums of float32 scores added in float64 in other orders: a relative
# slack far above that rounding (1e-16) and far below any real gap keeps the pruning exact.
SLACK = 1 + 1e-9
FLOOR_POSTINGS = 65536


class BM25Retriever:
    """BM25 over a jsonl corpus; the index is built once by streaming the corpus and saved
    beside it as `<corpus>.bm25/`, keyed by the corpus's contents (an edited corpus is
    re-indexed), and served memory-mapped."""

    def __init__(self, corpus_path: str | Path):
        from bm25s.stopwords import STOPWORDS_EN

        path = Path(corpus_path).expanduser()
        if not path.is_file():
            raise EmapgError(f"retriever corpus {str(path)!r}: no such file")
        self.index_dir = index_dir = path.with_name(path.name + ".bm25")
        if not index_is_current(path, index_dir, INDEX_FORMAT):
            build_index(path, index_dir)
        self.stopwords = frozenset(STOPWORDS_EN)
        with (index_dir / "vocab.index.json").open(encoding="utf-8") as f:
            self.vocab: dict[str, int] = json.load(f)
        self.indptr = np.load(index_dir / "indptr.csc.index.npy")
        self.postings = np.load(index_dir / "indices.csc.index.npy", mmap_mode="r")
        self.scores = np.load(index_dir / "data.csc.index.npy", mmap_mode="r")
        self.max_score = np.load(index_dir / "max_score.npy").astype(np.float64)
        self.docs = Documents(path, index_dir / "offsets.i64")

    def __reduce__(self):
        # pickled for a server's worker process: the corpus's path, whose index it maps again
        return BM25Retriever, (self.docs.path,)

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        return [[doc for doc, _ in hits] for hits in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        return [[(self.docs[row], score) for row, score in self.search(q, topk)] for q in queries]

    def terms(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """The query's term ids in the index and how often each occurs in the query (bm25s
        counts a repeated query word once per occurrence)."""
        ids = [self.vocab.get(t) for t in _TOKEN.findall(query.lower()) if t not in self.stopwords]
        ids = np.array([i for i in ids if i is not None and i < len(self.indptr) - 1], np.int64)
        return np.unique(ids, return_counts=True)

    def search(self, query: str, topk: int) -> list[tuple[int, float]]:
        """The top `topk` (row, score) pairs, best first, ties by row; none when no query term
        is in the corpus. A score is the sum of bm25s's per-term scores, in float64."""
        ids, counts = self.terms(query)
        if not len(ids):
            return []
        order = np.argsort(self.max_score[ids] * counts, kind="stable")  # the smallest bound first
        ids, counts = ids[order], counts[order].astype(np.float64)
        starts, ends = self.indptr[ids], self.indptr[ids + 1]
        # A floor under the final k-th score: the k-th best score of the term with the largest
        # bound alone (k documents score at least that), read where its postings are few.
        floor = -math.inf
        if topk <= ends[-1] - starts[-1] <= FLOOR_POSTINGS:
            alone = np.asarray(self.scores[starts[-1] : ends[-1]])
            floor = float(np.partition(alone, len(alone) - topk)[len(alone) - topk]) * counts[-1]
        rows, scores = _maxscore(self.postings, self.scores, starts, ends, counts,
                                 self.max_score[ids] * counts, topk, floor / SLACK)  # fmt: skip
        return [(int(r), float(s)) for r, s in zip(rows, scores, strict=True)]


@njit(cache=True, nogil=True)
def _maxscore(postings, scores, starts, ends, weights, bounds, k, floor):
    """Document-at-a-time MaxScore over the query terms' postings (documents in order), terms
    sorted by their bound (largest score x weight), smallest first. Exact top k, ties by row.

    The top k so far is kept sorted; theta is its k-th score. Terms whose bounds together fall
    short of theta are non-essential: a document containing only those cannot enter the top k,
    so documents are enumerated from the essential terms' postings only, and the non-essential
    terms are looked up (by bisection) for a document only while its score plus their bounds
    can still reach theta. Documents come in row order, so a later document that ties with the
    k-th loses the tie: it enters only with a larger score."""
    m = len(starts)
    cum = np.cumsum(bounds) * SLACK  # cum[i]: the most terms 0..i can add together
    pos = starts.copy()
    top_rows = np.full(k, -1, np.int64)
    top_scores = np.full(k, -np.inf)
    # theta starts just under the floor: a document tying with the floor may still win on its row
    filled, theta, first = 0, floor, 0  # terms first.. are essential
    while first < m and cum[first] < theta:
        first += 1
    while True:
        doc = np.int64(-1)  # the next document of an essential term
        for i in range(first, m):
            if pos[i] < ends[i] and (doc < 0 or postings[pos[i]] < doc):
                doc = postings[pos[i]]
        if doc < 0:
            break
        score = 0.0
        for i in range(first, m):
            if pos[i] < ends[i] and postings[pos[i]] == doc:
                score += scores[pos[i]] * weights[i]
                pos[i] += 1
        for i in range(first - 1, -1, -1):  # non-essential terms, the largest bound first
            if score + cum[i] <= theta:
                break
            lo, hi = pos[i], ends[i]  # postings[pos[i]:] are all after earlier documents
            while lo < hi:
                mid = (lo + hi) // 2
                if postings[mid] < doc:
                    lo = mid + 1
                else:
                    hi = mid
            pos[i] = lo
            if lo < ends[i] and postings[lo] == doc:
                score += scores[lo] * weights[i]
        if filled < k or score > theta:
            j = min(filled, k - 1)  # insert, keeping the k best sorted by score, then row
            while j > 0 and top_scores[j - 1] < score:
                top_scores[j], top_rows[j] = top_scores[j - 1], top_rows[j - 1]
                j -= 1
            top_scores[j], top_rows[j] = score, doc
            filled = min(filled + 1, k)
            if filled == k:
                theta = max(theta, top_scores[k - 1])
                while first < m and cum[first] <= theta:
                    first += 1
    return top_rows[:filled], top_scores[:filled]
