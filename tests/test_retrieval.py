"""Retrieval at wiki scale: the client splits batches, the server's limit, the streamed BM25 index."""

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import bm25s
import numpy as np
import pytest

import emapg
from emapg.cli import main
from emapg.config import load_config
from emapg.errors import EmapgError
from emapg.search import retriever as retriever_module
from emapg.search.retriever import BM25Retriever, HttpRetriever, build_index
from emapg.search.server import MAX_QUERIES, make_server
from emapg.search.world import build_world, write_corpus


@pytest.fixture(scope="module")
def world_corpus(tmp_path_factory):
    w = build_world(seed=1, num_people=30, num_cities=5)
    corpus = write_corpus(w, tmp_path_factory.mktemp("world") / "corpus.jsonl")
    return w, corpus, BM25Retriever(corpus)


class Counting:
    """A retriever that records the size of each request the server hands it."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def retrieve_scored(self, queries, topk):
        self.sizes.append(len(queries))
        return self.inner.retrieve_scored(queries, topk)


def _serve(retriever, **kwargs):
    srv = make_server(retriever, port=0, **kwargs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/retrieve"


def _queries(w, n: int) -> list[str]:
    people = sorted(w["people"])
    cities = sorted({p["city"] for p in w["people"].values()})
    return [f"{people[i % len(people)]} {cities[i // len(people) % len(cities)]} {i}" for i in range(n)]


def test_client_batch_of_3000_queries_against_serve_retriever(world_corpus):
    """The paper's batch is 2560 episodes: `emapg serve-retriever` with its default limit answers a
    3000-query batch from the client (split at the client's default), in order."""
    w, corpus, local = world_corpus
    cmd = [sys.executable, "-m", "emapg", "serve-retriever", "--corpus", str(corpus), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving 30 documents at http://127.0.0.1:"), proc.stderr.read()
        queries = _queries(w, 3000)
        got = HttpRetriever(line.split()[-1]).retrieve(queries, 3)
        assert got == local.retrieve(queries, 3)
        for i in range(0, 3000, 97):  # and each equals the query asked alone
            assert got[i] == local.retrieve([queries[i]], 3)[0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_client_splits_batches_into_requests_the_server_accepts(world_corpus):
    w, _, local = world_corpus
    counting = Counting(local)
    srv, url = _serve(counting, max_queries=100)
    try:
        queries = _queries(w, 1000)
        got = HttpRetriever(url, max_queries=64).retrieve(queries, 2)
        assert counting.sizes == [64] * 15 + [40]
        assert got == local.retrieve(queries, 2)
        counting.sizes.clear()
        assert HttpRetriever(url, max_queries=100).retrieve(queries[:100], 1) == local.retrieve(
            queries[:100], 1
        )
        assert counting.sizes == [100]
        assert HttpRetriever(url).retrieve([], 3) == [] and counting.sizes == [100]
    finally:
        srv.shutdown()


def test_server_refuses_more_queries_than_its_limit_with_413(world_corpus):
    w, _, local = world_corpus
    counting = Counting(local)
    srv, url = _serve(counting)
    try:
        assert MAX_QUERIES >= 2560  # the paper's batch, from Search-R1's own trainer, in one request
        with pytest.raises(EmapgError) as e:
            HttpRetriever(url, max_queries=5000).retrieve(_queries(w, 5000), 1)
        message = str(e.value)
        assert "\n" not in message and "HTTP 413" in message
        assert f"at most {MAX_QUERIES} queries per request, got 5000" in message
        assert "task.max_queries_per_request" in message
        assert counting.sizes == []  # refused before retrieving anything
    finally:
        srv.shutdown()


def test_max_queries_settings_are_checked(tmp_path, capsys):
    with pytest.raises(
        EmapgError, match="task.max_queries_per_request: input should be greater than or equal to 1"
    ):
        load_config("search_tiny", ["task.max_queries_per_request=0"])
    assert load_config("search_tiny", []).task.max_queries_per_request <= MAX_QUERIES
    with pytest.raises(EmapgError, match="max_queries must be >= 1"):
        HttpRetriever("http://127.0.0.1:1/retrieve", max_queries=0)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 0, "contents": "a\\nb"}\n')
    assert main(["serve-retriever", "--corpus", str(corpus), "--max-queries", "0"]) == 2
    assert capsys.readouterr().err.strip() == "emapg: error: --max-queries 0: expected >= 1"


# --- the streamed index ----------------------------------------------------------------------------


def _random_corpus(path: Path, n: int = 1500, seed: int = 0) -> list[dict]:
    """Documents with repeated words, stopwords, empty texts, non-ASCII text, blank lines and
    a CRLF line; returns them as bm25s's reference sees them."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(200)] + ["the", "of", "a", "Paris", "café", "naïve", "x"]
    docs, lines = [], []
    for i in range(n):
        vocab = words[: rng.randint(3, len(words))]
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 30)))
        doc = {"id": f"d{i}", "contents": f"Title {i}\n{text}"}
        docs.append(doc)
        lines.append(json.dumps(doc, ensure_ascii=rng.random() < 0.5))
        if rng.random() < 0.03:
            lines.append("   ")
    path.write_bytes(("\n".join(lines[:-1]) + "\r\n" + lines[-1] + "\n").encode())
    return docs


@pytest.mark.parametrize("buckets", [None, 7])
def test_streamed_bm25_equals_bm25s_in_memory(tmp_path, buckets):
    """The streamed index gives the documents and scores (bit for bit) of bm25s's own in-memory
    index of the same corpus, which is how it was built before."""
    corpus = tmp_path / "corpus.jsonl"
    docs = _random_corpus(corpus)
    if buckets:  # several term buckets, as on a large corpus
        build_index(corpus, corpus.with_name("corpus.jsonl.bm25"), buckets=buckets)
    streamed = BM25Retriever(corpus)
    reference = bm25s.BM25()
    reference.index(retriever_module._tokenize([d["contents"] for d in docs]), show_progress=False)
    rng = random.Random(1)
    words = [f"w{i}" for i in range(200)] + ["paris", "CAFÉ", "naïve", "title", "unknown"]
    queries = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(200)]
    queries += ["the of a", "", "Title 7"]
    ids, scores = reference.retrieve(
        retriever_module._tokenize(queries), k=5, show_progress=False, n_threads=1
    )
    got = streamed.retrieve_scored(queries, 5)
    for row, ref_ids, ref_scores in zip(got, ids, scores, strict=True):
        assert [d for d, _ in row] == [docs[i] for i in ref_ids]
        assert np.array_equal(np.float32([s for _, s in row]), ref_scores)
    assert len(streamed.docs) == len(docs)


def test_index_is_rebuilt_when_the_corpus_changes_and_reused_when_not(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        '{"id": "a", "contents": "Alpha\\nred fox"}\n{"id": "b", "contents": "Beta\\nblue owl"}\n'
    )
    builds = []
    real = retriever_module.build_index
    monkeypatch.setattr(retriever_module, "build_index", lambda *a, **k: builds.append(1) or real(*a, **k))
    assert BM25Retriever(corpus).retrieve(["fox"], 1)[0][0]["id"] == "a" and len(builds) == 1
    BM25Retriever(corpus)
    assert len(builds) == 1  # same size and mtime: reused without hashing
    st = corpus.stat()
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    BM25Retriever(corpus)
    assert len(builds) == 1  # touched, same bytes: the hash matches, reused
    corpus.write_text(corpus.read_text().replace("red fox", "red owl"))  # same size, new bytes
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert BM25Retriever(corpus).retrieve(["fox"], 1)[0][0]["contents"] != "Alpha\nred fox"
    assert len(builds) == 2
    with corpus.open("a") as f:
        f.write('{"id": "c", "contents": "Gamma\\ngreen fox"}\n')
    r = BM25Retriever(corpus)
    assert len(builds) == 3 and len(r.docs) == 3
    assert r.retrieve(["fox"], 1)[0][0] == {"id": "c", "contents": "Gamma\ngreen fox"}
    meta = json.loads((r.index_dir / "meta.json").read_text())
    assert meta["num_docs"] == 3 and meta["size"] == corpus.stat().st_size
    assert not (r.index_dir / "scratch").exists()


def test_a_document_read_by_offset_is_exactly_its_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = _random_corpus(corpus, n=300, seed=3)
    r = BM25Retriever(corpus)
    lines = [json.loads(line) for line in corpus.read_bytes().splitlines() if line.strip()]
    assert len(r.docs) == len(lines) == len(docs)
    for i in range(len(docs)):
        assert r.docs[i] == {"id": str(lines[i]["id"]), "contents": lines[i]["contents"]} == docs[i]


def test_bad_corpus_lines_are_one_line_errors(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": 1, "contents": "a\\nb"}\n\n{"id": 2}\n')
    with pytest.raises(EmapgError, match=r"corpus.jsonl:3: expected an object with 'id'"):
        BM25Retriever(corpus)
    corpus.write_text("\n\n")
    with pytest.raises(EmapgError, match="has no documents"):
        BM25Retriever(corpus)
