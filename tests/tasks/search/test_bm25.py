"""BM25 retrieval (emapg.tasks.search.bm25) over the synthetic world's corpus and random ones: the
streamed index is bm25s's own, its pruned top-k equals scoring every document, and the index is
rebuilt when the corpus changes and reused when not."""

import json
import os
import random
import threading
from pathlib import Path

import bm25s
import numpy as np
import pytest

from emapg.errors import EmapgError
from emapg.tasks.search import bm25 as bm25_module
from emapg.tasks.search.bm25 import BM25Retriever
from emapg.tasks.search.world import questions


def test_world_questions_and_bm25_find_each_person(world):
    w, retriever = world
    qs = questions(w)
    assert len(qs) == 40 and {q["hops"] for q in qs} == {1, 2}
    for q in qs:
        p = w["people"][q["person"]]
        city = p["city"] if q["hops"] == 1 else w["people"][p["boss"]]["city"]
        assert q["golden_answers"] == [city]
    for person in w["people"]:
        assert retriever.retrieve([person], 1)[0][0]["contents"].startswith(f"{person}\n")
    assert (retriever.index_dir / "meta.json").is_file()  # built once, saved beside the corpus


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


@pytest.mark.slow
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
