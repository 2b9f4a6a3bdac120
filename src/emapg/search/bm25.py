"""BM25 over a local jsonl corpus, served by tantivy (the Rust search engine, official bindings).

Why tantivy: on the same 2M-passage corpus it answers hundreds of times more queries per second
than bm25s (numpy or numba), because its top-k is block-max WAND, which skips the postings of
common terms that cannot reach the top k, where bm25s scores every posting
(benchmarks/retrieval_scale.py, benchmarks/RESULTS.md). The index is memory-mapped from disk and
built by tantivy's own threads while one Python pass streams the corpus, so a 14 GB wiki-18
never sits in memory.

The analysis is bm25s's: lower-cased `\\w\\w+` tokens without its English stopwords. Scoring is
tantivy's BM25 (k1 1.2, b 0.75, Lucene's idf, document lengths stored in one byte as Lucene
does), so scores are not bm25s's defaults (k1 1.5, exact lengths); the top 3 agree with bm25s
at the same k1 and b on most queries (RESULTS.md gives the share). The texts are not stored in
the index: a returned document is read back from the corpus by its byte range.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from emapg.errors import EmapgError
from emapg.search.retriever import Documents, index_is_current, iter_corpus

INDEX_FORMAT = 3  # 2 was bm25s's format: such an index is rebuilt
FIELD, ROW = "body", "row"
TOKENIZER = "emapg_bm25"
# Ties are broken by row, not by tantivy's document addresses, which depend on how its threads
# cut the corpus into segments: hits are fetched until the k-th score is passed (a few more than
# k at first, four times as many while the last one still ties with the k-th).
TIE_MARGIN = 8
MAX_TOKEN_BYTES = 255  # tantivy refuses terms over 65,530 bytes; no word is this long


def _tantivy():
    try:
        import tantivy
    except ImportError:
        raise EmapgError(
            "the BM25 retriever needs tantivy, a dependency of emapg: pip install 'tantivy>=0.25' "
            "(or reinstall emapg: pip install -e .)"
        ) from None
    return tantivy


def analyzer():
    """bm25s's analysis (`bm25s.tokenize(..., stopwords="en")`) as a tantivy analyzer."""
    from bm25s.stopwords import STOPWORDS_EN

    tantivy = _tantivy()
    return (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.regex(r"(?u)\b\w\w+\b"))
        .filter(tantivy.Filter.lowercase())
        .filter(tantivy.Filter.remove_long(MAX_TOKEN_BYTES))
        .filter(tantivy.Filter.custom_stopword(list(STOPWORDS_EN)))
        .build()
    )


def _schema():
    tantivy = _tantivy()
    builder = tantivy.SchemaBuilder()
    builder.add_text_field(FIELD, tokenizer_name=TOKENIZER, index_option="freq")  # no positions
    builder.add_integer_field(ROW, fast=True)  # the document's line among the corpus's documents
    return builder.build()


def build_index(corpus: str | Path, index_dir: str | Path, *, threads: int | None = None) -> dict:
    """Index `corpus` into `index_dir`: tantivy's index (tantivy/), each document's byte range
    (offsets.i64) and meta.json, written last (its presence marks a complete index)."""
    tantivy = _tantivy()
    corpus, index_dir = Path(corpus).expanduser(), Path(index_dir)
    threads = threads or min(8, os.cpu_count() or 1)
    if index_dir.exists():
        shutil.rmtree(index_dir)
    (index_dir / "tantivy").mkdir(parents=True)
    index = tantivy.Index(_schema(), path=str(index_dir / "tantivy"))
    index.register_tokenizer(TOKENIZER, analyzer())
    writer = index.writer(heap_size=threads * (256 << 20), num_threads=threads)
    digest, spans = hashlib.sha256(), []
    for row, (start, end, doc) in enumerate(iter_corpus(corpus, digest)):
        writer.add_document(tantivy.Document(**{FIELD: doc["contents"], ROW: row}))
        spans.append((start, end))
    if not spans:
        shutil.rmtree(index_dir)
        raise EmapgError(f"retriever corpus {str(corpus)!r} has no documents")
    writer.commit()
    writer.wait_merging_threads()
    np.asarray(spans, np.int64).tofile(index_dir / "offsets.i64")
    stat = corpus.stat()
    meta = {"format": INDEX_FORMAT, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": digest.hexdigest(), "num_docs": len(spans)}  # fmt: skip
    (index_dir / "meta.json").write_text(json.dumps(meta))
    return meta


class BM25Retriever:
    """BM25 over a jsonl corpus; the index is built once and saved beside it as
    `<corpus>.bm25/`, keyed by the corpus's contents (an edited corpus is re-indexed)."""

    def __init__(self, corpus_path: str | Path):
        tantivy = _tantivy()
        path = Path(corpus_path).expanduser()
        if not path.is_file():
            raise EmapgError(f"retriever corpus {str(path)!r}: no such file")
        self.index_dir = index_dir = path.with_name(path.name + ".bm25")
        if not index_is_current(path, index_dir, INDEX_FORMAT):
            build_index(path, index_dir)
        self.index = tantivy.Index.open(str(index_dir / "tantivy"))
        self.analyzer = analyzer()
        self.index.register_tokenizer(TOKENIZER, self.analyzer)
        self.schema = self.index.schema
        self.searcher = self.index.searcher()  # thread-safe: searches release the GIL
        self.docs = Documents(path, index_dir / "offsets.i64")

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        return [[doc for doc, _ in hits] for hits in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        return [[(self.docs[row], score) for row, score in self.search(query, topk)] for query in queries]

    def search(self, query: str, topk: int) -> list[tuple[int, float]]:
        """The top `topk` (row, score) pairs, best first, ties by row; none when no query term
        is in the corpus (a query of stopwords only, say)."""
        tantivy = _tantivy()
        terms = self.analyzer.analyze(query)
        if not terms:
            return []
        clauses = [(tantivy.Occur.Should, tantivy.Query.term_query(self.schema, FIELD, t)) for t in terms]
        query, limit = tantivy.Query.boolean_query(clauses), topk + TIE_MARGIN
        while True:
            hits = self.searcher.search(query, limit, count=False).hits
            if len(hits) < limit or hits[-1][0] < hits[topk - 1][0]:
                break
            limit *= 4
        rows = self.searcher.fast_field_values(ROW, [address for _, address in hits])
        ranked = sorted(zip(rows, (score for score, _ in hits), strict=True), key=lambda h: (-h[1], h[0]))
        return [(int(row), float(score)) for row, score in ranked[:topk]]
