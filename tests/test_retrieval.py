"""Retrieval at wiki scale: the client splits batches, the server's limits and back-pressure under
load, the streamed BM25 index and its pruned top-k against scoring every document."""

import json
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import bm25s
import numpy as np
import pytest

import emapg
from conftest import http
from emapg.cli import main
from emapg.errors import EmapgError
from emapg.tasks.search import bm25 as bm25_module
from emapg.tasks.search.bm25 import BM25Retriever
from emapg.tasks.search.retriever import HttpRetriever
from emapg.tasks.search.server import MAX_PENDING, MAX_QUERIES, MAX_QUERY_CHARS, body_cap, make_server
from emapg.tasks.search.world import build_world, write_corpus
from emapg.training.config import load_config
from retriever_stubs import ExitsOn, Rendezvous


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
        srv.server_close()


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
        assert f"5000 queries; limits: {MAX_QUERIES} queries per request (--max-queries)" in message
        assert "task.max_queries_per_request" in message
        assert counting.sizes == []  # refused before retrieving anything
    finally:
        srv.shutdown()
        srv.server_close()


def test_max_queries_settings_are_checked(tmp_path, capsys):
    with pytest.raises(
        EmapgError, match="task.max_queries_per_request: input should be greater than or equal to 1"
    ):
        load_config("search_tiny", ["task.max_queries_per_request=0"])
    assert load_config("search_tiny", []).task.max_queries_per_request <= MAX_QUERIES
    with pytest.raises(EmapgError, match="max_queries and max_query_chars must be >= 1"):
        HttpRetriever("http://127.0.0.1:1/retrieve", max_queries=0)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": 0, "contents": "a\\nb"}\n')
    assert main(["serve-retriever", "--corpus", str(corpus), "--max-queries", "0"]) == 2
    assert capsys.readouterr().err.strip() == "emapg: error: --max-queries 0: expected >= 1"


# --- the BM25 index ----------------------------------------------------------------------------


def _random_corpus(path: Path, n: int = 1500, seed: int = 0) -> list[dict]:
    """Documents with repeated words, stopwords, empty texts, non-ASCII
    text, blank lines and a CRLF line; returns them as bm25s's reference sees them."""
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


def _exhaustive(index_dir: Path, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
    """Every document scored: each query token's column of the index summed in float64 (a
    repeated word counts again, as in bm25s), the top k by score then row, positives only."""
    import scipy.sparse

    loaded = bm25s.BM25.load(str(index_dir), show_progress=False)
    matrix = scipy.sparse.csc_matrix(
        (loaded.scores["data"].astype(np.float64), loaded.scores["indices"], loaded.scores["indptr"]),
        shape=(loaded.scores["num_docs"], len(loaded.scores["indptr"]) - 1),
    )
    out = []
    for q in queries:
        cols = [loaded.vocab_dict[t] for t in bm25s.tokenize([q], stopwords="en", return_ids=False,
                                                             show_progress=False)[0] if t in loaded.vocab_dict and t]  # fmt: skip
        scores = np.asarray(matrix[:, cols].sum(axis=1)).ravel() if cols else np.zeros(matrix.shape[0])
        ranked = sorted(np.flatnonzero(scores > 0), key=lambda i: (-scores[i], i))[:k]
        out.append([(int(i), float(scores[i])) for i in ranked])
    return out


@pytest.mark.parametrize("buckets", [None, 7])
def test_streamed_index_is_bm25s_own_index(tmp_path, buckets):
    """The streamed index holds bm25s's own index of the corpus, score for score: bm25s loading
    it retrieves exactly (documents and float32 scores, bit for bit) what bm25s's in-memory
    index of the same corpus does."""
    corpus = tmp_path / "corpus.jsonl"
    docs = _random_corpus(corpus)
    if buckets:  # several term buckets, as on a large corpus
        bm25_module.build_index(corpus, corpus.with_name("corpus.jsonl.bm25"), buckets=buckets)
    r = BM25Retriever(corpus)
    reference = bm25s.BM25()
    reference.index(
        bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False),
        show_progress=False,
    )
    loaded = bm25s.BM25.load(str(r.index_dir), show_progress=False)
    queries = _word_queries(200) + ["the of a", "Title 7"]
    tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
    ids, scores = reference.retrieve(tokens, k=5, show_progress=False, n_threads=1)
    ids2, scores2 = loaded.retrieve(tokens, k=5, show_progress=False, n_threads=1)
    assert np.array_equal(ids, ids2) and np.array_equal(scores, scores2)
    assert len(r.docs) == len(docs)


def _word_queries(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(200)] + ["paris", "CAFÉ", "naïve", "title", "unknown"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(n)]


@pytest.mark.parametrize("k", [1, 3, 10])
def test_maxscore_top_k_equals_scoring_every_document(tmp_path, k):
    """The pruned search returns exactly the top k of an exhaustive scoring (rows, ties by row;
    scores to float64 rounding), for queries mixing words in nearly every document (w0-w2)
    with rare ones, repeated words, unknown words and stopwords; and it agrees with bm25s's own
    retrieval, whose float32 sums differ by float32 rounding only."""
    corpus = tmp_path / "corpus.jsonl"
    docs = _random_corpus(corpus)
    r = BM25Retriever(corpus)
    queries = _word_queries(300) + ["w0 w1 w199", "w1 w1 w2", "w0", "the of a", "", "unknown", "Title 7 w150"]
    reference = _exhaustive(r.index_dir, queries, k)
    for q, ref in zip(queries, reference, strict=True):
        got = r.search(q, k)
        assert [row for row, _ in got] == [row for row, _ in ref], q
        np.testing.assert_allclose([s for _, s in got], [s for _, s in ref], rtol=1e-12)
    assert r.retrieve(queries[:3], k) == [[docs[row] for row, _ in ref] for ref in reference[:3]]
    bm = bm25s.BM25()
    bm.index(
        bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False),
        show_progress=False,
    )
    _, scores = bm.retrieve(
        bm25s.tokenize(queries[:100], stopwords="en", show_progress=False),
        k=k,
        show_progress=False,
        n_threads=1,
    )
    for row, ref in zip(scores, reference[:100], strict=True):  # float32 sums of a few float32 terms
        np.testing.assert_allclose(row[: len(ref)], [s for _, s in ref], rtol=1e-6)


def test_maxscore_is_exact_where_the_bounds_are_tight(tmp_path):
    """A corpus where pruning decisions are close: 40 words with Zipf frequencies, documents of
    1-40 words (a word repeated up to several times), and queries of 2-6 of the same words, so
    that a document without the best query term can still win on the others."""
    rng = np.random.default_rng(3)
    words = np.array([f"z{i}" for i in range(40)])
    p = 1 / np.arange(1, 41) ** 1.1
    p /= p.sum()
    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w") as f:
        for i in range(3000):
            body = " ".join(rng.choice(words, size=rng.integers(1, 41), p=p))
            f.write(json.dumps({"id": str(i), "contents": f"t\n{body}"}) + "\n")
    r = BM25Retriever(corpus)
    queries = [" ".join(rng.choice(words, size=rng.integers(2, 7), p=p[::-1] / p.sum())) for _ in range(600)]
    for k in (1, 3, 10):
        reference = _exhaustive(r.index_dir, queries, k)
        for q, ref in zip(queries, reference, strict=True):
            assert [row for row, _ in r.search(q, k)] == [row for row, _ in ref], (q, k)


def test_a_document_without_the_rarest_term_can_win_on_the_others(tmp_path):
    """A short passage repeating three commoner words beats the rare word's passage, though no one
    or two of its words alone would: it must be let in on what the later terms can add, not on
    its first term's score alone."""
    filler = " ".join(f"f{i}" for i in range(60))
    lines = [
        {"id": "rare", "contents": f"t\nrare {filler[:29]}"},
        {"id": "win", "contents": "t\nm1 m1 m2 m2 m3 m3"},
    ]
    lines += [{"id": f"x{i}", "contents": f"t\nm{i % 3 + 1} {filler[:20]}"} for i in range(100)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in lines))
    r = BM25Retriever(corpus)
    rare_alone, m_alone = r.search("rare", 1)[0][1], r.search("m1", 1)[0][1]
    assert 2 * m_alone < rare_alone < 3 * m_alone  # the premise: only all three words beat it
    assert r.search("rare m1 m2 m3", 1) == _exhaustive(r.index_dir, ["rare m1 m2 m3"], 1)[0]
    assert r.retrieve(["rare m1 m2 m3"], 1)[0][0]["id"] == "win"


def test_concurrent_searches_get_their_own_answers(tmp_path):
    """Searches in flight at once (the server's threads, the kernel releasing the GIL) each
    get their own answer."""
    corpus = tmp_path / "corpus.jsonl"
    _random_corpus(corpus)
    r = BM25Retriever(corpus)
    queries = _word_queries(400, seed=5)
    alone = [r.search(q, 3) for q in queries]
    got: dict = {}

    def work(part):
        got[part] = [r.search(q, 3) for q in queries[part::4]]

    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[p] == alone[p::4] for p in range(4))


def test_index_is_rebuilt_when_the_corpus_changes_and_reused_when_not(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        '{"id": "a", "contents": "Alpha\\nred fox"}\n{"id": "b", "contents": "Beta\\nblue owl"}\n'
    )
    builds = []
    real = bm25_module.build_index
    monkeypatch.setattr(bm25_module, "build_index", lambda *a, **k: builds.append(1) or real(*a, **k))
    assert BM25Retriever(corpus).retrieve(["fox"], 1)[0][0]["id"] == "a" and len(builds) == 1
    BM25Retriever(corpus)
    assert len(builds) == 1  # same size and mtime: reused without hashing
    st = corpus.stat()
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    BM25Retriever(corpus)
    assert len(builds) == 1  # touched, same bytes: the hash matches, reused
    corpus.write_text(corpus.read_text().replace("red fox", "red owl"))  # same size, new bytes
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert BM25Retriever(corpus).retrieve(["fox", "owl"], 1) == [
        [],
        [{"id": "a", "contents": "Alpha\nred owl"}],
    ]
    assert len(builds) == 2
    with corpus.open("a") as f:
        f.write('{"id": "c", "contents": "Gamma\\ngreen fox"}\n')
    r = BM25Retriever(corpus)
    assert len(builds) == 3 and len(r.docs) == 3
    assert r.retrieve(["fox"], 1)[0][0] == {"id": "c", "contents": "Gamma\ngreen fox"}
    meta = json.loads((r.index_dir / "meta.json").read_text())
    assert meta["num_docs"] == 3 and meta["size"] == corpus.stat().st_size


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


# --- the server under load ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [None, 1])
def test_four_clients_with_the_papers_batch_at_once_each_get_their_own_answers(world_corpus, workers):
    """4 clients x 2,560 queries (the paper's batch) at once: every answer whole, in its
    request's order, and equal to the answer of the same queries asked alone; by default from
    one worker process per usable core (BM25), or from the server's own threads."""
    w, _, local = world_corpus
    srv, url = _serve(local, workers=workers)
    cores = len(os.sched_getaffinity(0))
    assert srv.workers == (min(cores, MAX_PENDING) if workers is None else 1)
    try:
        batches = [_queries(w, 2560)[c:] + _queries(w, c) for c in range(0, 400, 100)]  # each its own order
        expected = [local.retrieve(b, 3) for b in batches]
        got: list = [None] * 4

        def client(c):
            got[c] = HttpRetriever(url, max_queries=2560).retrieve(batches[c], 3)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == expected
    finally:
        srv.shutdown()
        srv.server_close()


def test_concurrent_requests_are_searched_in_separate_processes_at_once(tmp_path):
    """Two requests at once are searched at the same time, each in its own worker process (so on
    its own core: threads of one interpreter would take turns at its lock)."""
    srv, url = _serve(Rendezvous(tmp_path, 2), workers=2)
    try:
        got: list = []
        clients = [threading.Thread(target=lambda: got.extend(HttpRetriever(url).retrieve(["q"], 1)))
                   for _ in range(2)]  # fmt: skip
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=60)
        assert [hits[0]["contents"] for hits in got] == ["met: True"] * 2
        pids = {hits[0]["id"] for hits in got}
        assert len(pids) == 2 and str(os.getpid()) not in pids
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_worker_that_dies_fails_its_request_with_500_and_is_replaced(world_corpus):
    w, _, local = world_corpus
    srv, url = _serve(ExitsOn(local, "exit"), workers=2)
    try:
        status, _, data = http(url, json.dumps({"queries": ["exit"], "topk": 1}).encode())
        assert status == 500
        assert data["error"] == (
            "a retriever worker process exited (code 3) with this request; it has been replaced"
        )
        queries = _queries(w, 50)
        for _ in range(3):  # each worker, the new one included
            assert HttpRetriever(url).retrieve(queries, 2) == local.retrieve(queries, 2)
    finally:
        srv.shutdown()
        srv.server_close()


class Gate:
    """A retriever that holds every request until the test opens the gate."""

    def __init__(self, inner):
        self.inner, self.open, self.entered = inner, threading.Event(), threading.Event()

    def retrieve_scored(self, queries, topk):
        self.entered.set()
        self.open.wait(timeout=30)
        return self.inner.retrieve_scored(queries, topk)


def test_past_the_pending_limit_a_503_and_the_clients_retry_gets_the_answer_once_it_drains(world_corpus):
    w, _, local = world_corpus
    gate = Gate(local)
    srv, url = _serve(gate, max_pending=1)
    try:
        first: list = []
        holder = threading.Thread(target=lambda: first.append(HttpRetriever(url).retrieve(["a b"], 1)))
        holder.start()
        assert gate.entered.wait(timeout=10)  # the one admitted request is in progress
        status, headers, data = http(url, json.dumps({"queries": ["x"] * 2000, "topk": 3}).encode())
        assert status == 503 and headers["Retry-After"] == "1" and "--max-pending" in data["error"]
        queries = _queries(w, 50)
        threading.Timer(1.5, gate.open.set).start()  # the queue drains while the client retries
        assert HttpRetriever(url, busy_timeout_s=30).retrieve(queries, 2) == local.retrieve(queries, 2)
        holder.join(timeout=10)
        assert first == [local.retrieve(["a b"], 1)]
    finally:
        gate.open.set()
        srv.shutdown()
        srv.server_close()


def test_a_server_busy_past_the_clients_deadline_stops_the_run_with_one_line(world_corpus):
    gate = Gate(world_corpus[2])
    srv, url = _serve(gate, max_pending=1)
    try:
        threading.Thread(target=lambda: HttpRetriever(url).retrieve(["a"], 1), daemon=True).start()
        assert gate.entered.wait(timeout=10)
        with pytest.raises(EmapgError) as e:
            HttpRetriever(url, busy_timeout_s=0.5).retrieve(["b"], 1)
        message = str(e.value)
        assert (
            "\n" not in message
            and "still busy (HTTP 503)" in message
            and "task.busy_timeout_s 0.5" in message
        )
    finally:
        gate.open.set()
        srv.shutdown()
        srv.server_close()


def test_long_and_escaped_queries_within_the_limits_are_answered(world_corpus):
    """Search-R1's client sends the whole batch in one request and reads response.json()['result']:
    2,560 queries of 420 characters (1.04 MiB of JSON) or of 70 Chinese characters (JSON-escaped,
    six bytes each), once refused by a 1 MiB body cap, are answered."""
    w, _, local = world_corpus
    srv, url = _serve(local)
    try:
        long = [(q + " ") * 60 for q in _queries(w, 2560)]
        long = [q[:420] for q in long]
        chinese = ["北京上海广州深圳" * 9][0][:70]
        for queries in (long, [chinese] * 2560, ["𝔘" * MAX_QUERY_CHARS] * 4):  # the last: 12 bytes each
            status, _, data = http(
                url, json.dumps({"queries": queries, "topk": 3, "return_scores": True}).encode()
            )
            assert status == 200 and len(data["result"]) == len(queries)
        assert len(json.dumps({"queries": long}).encode()) > 1 << 20
        assert data["result"][0] == []  # no term of the corpus in it: no passage
        assert HttpRetriever(url, max_queries=2560).retrieve(long, 3) == local.retrieve(long, 3)
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_query_over_the_length_cap_gets_413_naming_both_limits(world_corpus):
    srv, url = _serve(world_corpus[2], max_queries=10, max_query_chars=50)
    try:
        status, _, data = http(url, json.dumps({"queries": ["a", "b" * 51], "topk": 3}).encode())
        assert status == 413
        assert data["error"] == (
            "query 1 has 51 characters; limits: 10 queries per request (--max-queries), "
            "50 characters per query (--max-query-chars)"
        )
        cap = body_cap(10, 50)
        assert cap >= len(json.dumps({"queries": ["𝔘" * 50] * 10, "topk": 100, "return_scores": False}))
        # the client cuts its queries to the server's cap instead
        assert HttpRetriever(url, max_query_chars=50).retrieve(["b" * 51], 1) == [[]]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_other_methods_get_405_and_every_error_is_json(world_corpus, method):
    srv, url = _serve(world_corpus[2])
    try:
        status, headers, data = http(url, None, method)
        assert (
            status == 405
            and headers["Allow"] == "POST"
            and data == {"error": f"{method} /retrieve: use POST"}
        )
        status, _, data = http(url.replace("/retrieve", "/search"), None, method)
        assert status == 404 and "POST /retrieve" in data["error"]
        with socket.create_connection(srv.server_address[:2], timeout=5) as s:  # not HTTP at all
            s.sendall(b"NONSENSE\r\n\r\n")
            reply = s.recv(4096).decode()  # an HTTP/0.9 answer: the body alone
        assert json.loads(reply) == {"error": "Bad request syntax ('NONSENSE')"}
    finally:
        srv.shutdown()
        srv.server_close()
