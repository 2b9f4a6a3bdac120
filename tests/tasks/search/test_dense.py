"""Dense retrieval (emapg.tasks.search.dense) with a tiny random BERT encoder built here: the pooling,
FAISS against brute force, approximate indexes' recall, a killed build resuming, Search-R1's
single index file."""

import json
import os
import random
import shutil
import threading

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from emapg.errors import EmapgError
from emapg.tasks.search.dense import DenseRetriever, Encoder, EncoderSettings, build_dense_index

faiss = pytest.importorskip("faiss")  # the optional extra emapg[dense]

WORDS = [f"w{i}" for i in range(200)]
N_DOCS, SHARD = 300, 50
SETTINGS = EncoderSettings(batch_size=16)


def _make_encoder(path, seed: int):
    path.mkdir()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "query", "passage", ":"]
    (path / "vocab.txt").write_text("\n".join(specials + WORDS) + "\n")
    BertTokenizerFast.from_pretrained(path).save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(specials) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64)  # fmt: skip
    BertModel(config).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    """A 32-wide model gains nothing from threads, and spinning threads stall on a busy CPU."""
    torch.set_num_threads(1)  # after conftest's _few_threads


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return _make_encoder(tmp_path_factory.mktemp("enc") / "e5-tiny", seed=0)


def _write_corpus(path, n: int, seed: int = 0, blank_every: int = 0):
    """n distinct documents "title\\ntext" of random words; id i is document i."""
    rng, lines = random.Random(seed), []
    for i in range(n):
        title = " ".join(rng.choices(WORDS, k=2))
        text = " ".join(rng.choices(WORDS, k=rng.randint(3, 20)))
        lines.append(json.dumps({"id": str(i), "contents": f"{title}\n{text}"}))
        if blank_every and i % blank_every == 0:
            lines.append("")  # blank lines are not documents: row i is still document i
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _write_corpus(tmp_path_factory.mktemp("corpus") / "wiki.jsonl", N_DOCS)


@pytest.fixture(scope="module")
def flat_dir(tmp_path_factory, corpus, encoder_dir):
    index_dir = tmp_path_factory.mktemp("flat") / "index"
    torch.set_num_threads(1)  # module fixtures come before the per-test _one_thread
    build_dense_index(corpus, index_dir, encoder_dir, SETTINGS, shard_docs=SHARD, progress=False)
    return index_dir


def _queries(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 6))) for _ in range(n)]


def _vectors(index_dir) -> np.ndarray:
    index = faiss.read_index(str(index_dir / "index.faiss"))
    return index.reconstruct_n(0, index.ntotal)


class Killed(Exception):
    pass


class Counting:
    """Counts the texts Encoder.encode is given; raises Killed once more than `crash_after` were."""

    real_encode = Encoder.encode

    def __init__(self, monkeypatch, crash_after: int | None = None):
        self.docs = 0

        def encode(encoder, texts, *, is_query):
            self.docs += len(texts)
            if crash_after is not None and self.docs > crash_after:
                raise Killed  # the build dies here
            return Counting.real_encode(encoder, texts, is_query=is_query)

        monkeypatch.setattr(Encoder, "encode", encode)


# --- the encoder ----------------------------------------------------------------------------------


def test_mean_pooling_averages_the_real_tokens_only(encoder_dir):
    assert torch.get_num_threads() == 1
    enc = Encoder(encoder_dir, SETTINGS)
    texts = ["w1", "w2 w3 w4 w5 w6 w7 w8 w9", "w10 w11"]
    got = enc.encode(texts, is_query=False)
    batch = enc.tokenizer(["passage: " + t for t in texts], padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # the batch is padded
    with torch.no_grad():
        hidden = enc.model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    expected = (mean / mean.norm(dim=-1, keepdim=True)).numpy()
    assert got.dtype == np.float32 and got.shape == (3, 32)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    unmasked = hidden.mean(1) / hidden.mean(1).norm(dim=-1, keepdim=True)
    assert not np.allclose(got[0], unmasked[0].numpy(), atol=1e-3)  # the test can tell
    # the batch size changes only the padding: why a build's key leaves it out
    one_by_one = Encoder(encoder_dir, EncoderSettings(batch_size=1)).encode(texts, is_query=False)
    np.testing.assert_allclose(one_by_one, got, atol=1e-6)
    # CLS pooling, unnormalised: the first token's hidden state as it is
    cls = Encoder(encoder_dir, EncoderSettings(pooling="cls", normalize=False))
    np.testing.assert_allclose(cls.encode(texts, is_query=False), hidden[:, 0].numpy(), atol=1e-6)


def test_prefixes_are_applied(encoder_dir):
    enc = Encoder(encoder_dir, SETTINGS)
    bare = Encoder(encoder_dir, EncoderSettings(query_prefix="", passage_prefix=""))
    text = ["w5 w6 w7"]
    query, passage = enc.encode(text, is_query=True), enc.encode(text, is_query=False)
    assert not np.allclose(query, passage, atol=1e-3)
    np.testing.assert_allclose(bare.encode(["query: w5 w6 w7"], is_query=True), query, atol=1e-6)
    np.testing.assert_allclose(bare.encode(["passage: w5 w6 w7"], is_query=True), passage, atol=1e-6)
    assert enc.encode([], is_query=True).shape == (0, 32)


def test_encoder_errors_are_one_line(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(EmapgError, match="not a model folder with a config.json") as e:
            Encoder(path)
        assert "\n" not in str(e.value)
    with pytest.raises(EmapgError, match="pooling must be 'mean' or 'cls'"):
        EncoderSettings(pooling="max")


# --- searching ------------------------------------------------------------------------------------


def test_flat_index_equals_brute_force(flat_dir, corpus, encoder_dir):
    shards = np.concatenate([np.load(p) for p in sorted((flat_dir / "shards").glob("*.npy"))])
    assert shards.shape == (N_DOCS, 32) and np.array_equal(_vectors(flat_dir), shards)
    meta = json.loads((flat_dir / "meta.json").read_text())
    assert (meta["num_docs"], meta["dim"], meta["index_type"]) == (N_DOCS, 32, "flat")

    retriever = DenseRetriever(flat_dir, corpus, encoder_dir)
    assert len(retriever.docs) == N_DOCS
    lines = corpus.read_text().splitlines()
    queries, k = _queries(12), 5
    exact = retriever.encoder.encode(queries, is_query=True) @ shards.T
    for q, hits in enumerate(retriever.retrieve_scored(queries, k)):
        ids = [int(doc["id"]) for doc, _ in hits]
        scores = np.array([s for _, s in hits])
        assert all(doc == json.loads(lines[i]) for (doc, _), i in zip(hits, ids, strict=True))
        assert all(isinstance(s, float) for s in scores)
        best = np.argsort(-exact[q], kind="stable")
        np.testing.assert_allclose(scores, exact[q][best[:k]], atol=1e-5)  # the top-k scores
        np.testing.assert_allclose(exact[q][ids], scores, atol=1e-5)  # each id's own score
        gaps = -np.diff(exact[q][best[: k + 1]])
        for r in range(k):  # ids exactly, except between scores within float32 rounding
            if (r == 0 or gaps[r - 1] > 1e-5) and gaps[r] > 1e-5:
                assert ids[r] == best[r]
    assert retriever.retrieve(queries, k) == [
        [d for d, _ in h] for h in retriever.retrieve_scored(queries, k)
    ]
    assert retriever.retrieve([], 3) == [] and len(retriever.retrieve(queries[:1], 1000)[0]) == N_DOCS

    # threads share one retriever (the HTTP server): each gets what it would alone
    expected, results = retriever.retrieve_scored(queries, 3), {}

    def ask(i):
        results[i] = retriever.retrieve_scored(queries, 3)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == expected for r in results.values())


def test_each_passage_finds_itself(flat_dir, corpus, encoder_dir):
    """A random encoder has no semantics, but a passage encoded as a query, with the passage's
    prefix, is its own vector: found first, at inner product 1 (unit vectors)."""
    settings = EncoderSettings(query_prefix="passage: ", batch_size=16)
    retriever = DenseRetriever(flat_dir, corpus, encoder_dir, settings)
    docs = [json.loads(line) for line in corpus.read_text().splitlines()]
    hits = retriever.retrieve_scored([d["contents"] for d in docs], 2)
    for doc, ((first, score), (_, second)) in zip(docs, hits, strict=True):
        assert first == doc
        assert abs(score - 1) < 1e-5 and second < score - 1e-3


def _recall(retriever, exact_top: np.ndarray, exact: np.ndarray, queries) -> float:
    """Recall@3 against the exact top 3; an id scoring within rounding of the 3rd counts as found."""
    found = 0
    for q, hits in enumerate(retriever.retrieve_scored(queries, 3)):
        cutoff = exact[q][exact_top[q][2]] - 1e-5
        found += sum(exact[q][int(doc["id"])] >= cutoff for doc, _ in hits)
    return found / (3 * len(queries))


@pytest.mark.slow
def test_hnsw_ivf_and_sq8_recall(flat_dir, corpus, encoder_dir, tmp_path, monkeypatch):
    queries = _queries(100, seed=2)
    flat = DenseRetriever(flat_dir, corpus, encoder_dir)
    exact = flat.encoder.encode(queries, is_query=True) @ _vectors(flat_dir).T
    exact_top = np.argsort(-exact, axis=1)[:, :3]
    assert _recall(flat, exact_top, exact, queries) == 1.0
    # another index type from the same build: its shards are reused, nothing is encoded again
    shutil.copytree(flat_dir, tmp_path / "approx")
    counting = Counting(monkeypatch)
    build_dense_index(corpus, tmp_path / "approx", encoder_dir, SETTINGS, shard_docs=SHARD,
                      progress=False, index_type="hnsw", hnsw_m=8)  # fmt: skip
    assert counting.docs == 0
    hnsw = _recall(
        DenseRetriever(tmp_path / "approx", corpus, encoder_dir, ef_search=64), exact_top, exact, queries
    )
    assert hnsw >= 0.95, hnsw
    counting.docs = 0  # the queries were counted too
    meta = build_dense_index(corpus, tmp_path / "approx", encoder_dir, SETTINGS, shard_docs=SHARD,
                             progress=False, index_type="ivf", nlist=16)  # fmt: skip
    assert meta["nlist"] == 16 and counting.docs == 0
    ivf_one = _recall(
        DenseRetriever(tmp_path / "approx", corpus, encoder_dir, nprobe=1), exact_top, exact, queries
    )
    ivf_all = _recall(
        DenseRetriever(tmp_path / "approx", corpus, encoder_dir, nprobe=16), exact_top, exact, queries
    )
    assert ivf_all == 1.0  # every list searched: exhaustive
    assert 0.5 <= ivf_one < 1.0, ivf_one  # one list of 16: approximate, and measurably so (0.78)
    with pytest.raises(EmapgError, match="efSearch does not apply"):
        DenseRetriever(tmp_path / "approx", corpus, encoder_dir, ef_search=8)
    # sq8: one byte per dimension instead of four, for machines without the RAM for flat
    build_dense_index(corpus, tmp_path / "approx", encoder_dir, SETTINGS, shard_docs=SHARD,
                      progress=False, index_type="sq8")  # fmt: skip
    sq8 = DenseRetriever(tmp_path / "approx", corpus, encoder_dir)
    assert sq8.index.sa_code_size() * 4 == flat.index.sa_code_size() == 4 * flat.index.d
    recall = _recall(sq8, exact_top, exact, queries)
    assert recall >= 0.95, recall


# --- building: resuming, starting over ------------------------------------------------------------


def test_killed_build_resumes_at_the_first_missing_shard(
    tmp_path, corpus, encoder_dir, flat_dir, monkeypatch
):
    index_dir = tmp_path / "index"
    Counting(monkeypatch, crash_after=2 * SHARD)
    with pytest.raises(Killed):
        build_dense_index(corpus, index_dir, encoder_dir, SETTINGS, shard_docs=SHARD, progress=False)
    assert sorted(p.name for p in (index_dir / "shards").glob("*.npy")) == ["00000.npy", "00001.npy"]
    assert not (index_dir / "meta.json").exists() and not (index_dir / "index.faiss").exists()
    with pytest.raises(EmapgError, match="incomplete"):
        DenseRetriever(index_dir, corpus, encoder_dir)

    counting = Counting(monkeypatch)
    build_dense_index(corpus, index_dir, encoder_dir, SETTINGS, shard_docs=SHARD, progress=False)
    assert counting.docs == N_DOCS - 2 * SHARD  # only the missing shards
    assert np.array_equal(_vectors(index_dir), _vectors(flat_dir))  # bitwise the uninterrupted build's
    for shard in (flat_dir / "shards").glob("*.npy"):
        assert shard.read_bytes() == (index_dir / "shards" / shard.name).read_bytes()


@pytest.mark.slow
def test_edited_corpus_other_settings_or_encoder_start_over(tmp_path, encoder_dir, monkeypatch):
    n, index_dir, my_encoder = 60, tmp_path / "index", tmp_path / "e5"
    my_corpus = _write_corpus(tmp_path / "wiki.jsonl", n)
    shutil.copytree(encoder_dir, my_encoder)
    counting = Counting(monkeypatch)

    def build(settings=SETTINGS, encoder=my_encoder):
        counting.docs = 0
        build_dense_index(my_corpus, index_dir, encoder, settings, shard_docs=20, progress=False)
        return counting.docs

    assert build() == n
    assert build() == 0  # complete, and current: the index is rebuilt from the shards
    os.utime(my_corpus, ns=(1, 1))  # touched, the same bytes: still current (by sha256)
    DenseRetriever(index_dir, my_corpus, my_encoder)
    assert json.loads((index_dir / "meta.json").read_text())["corpus"]["mtime_ns"] == 1  # no hash next time
    assert build() == 0
    assert build(EncoderSettings(batch_size=8)) == 0  # the batch size does not change the vectors
    assert build(EncoderSettings(batch_size=16, max_length=8)) == n
    assert build() == n
    other = _make_encoder(tmp_path / "other", seed=1)  # the same config, other weights
    shutil.copy(other / "model.safetensors", my_encoder / "model.safetensors")
    assert build() == n  # at the same path
    with pytest.raises(EmapgError, match="was built with another encoder"):
        DenseRetriever(index_dir, my_corpus, encoder_dir)
    with my_corpus.open("a") as f:
        f.write(json.dumps({"id": "new", "contents": "w1\nw2 w3"}) + "\n")
    with pytest.raises(EmapgError, match="was not built from"):
        DenseRetriever(index_dir, my_corpus, my_encoder)
    assert build() == n + 1
    as_passage = EncoderSettings(query_prefix="passage: ")
    hits = DenseRetriever(index_dir, my_corpus, my_encoder, as_passage).retrieve_scored(["w1\nw2 w3"], 1)
    assert hits[0][0][0]["id"] == "new" and abs(hits[0][0][1] - 1) < 1e-5
    with pytest.raises(EmapgError, match="index type must be one of"):
        build_dense_index(my_corpus, index_dir, encoder_dir, index_type="pq")


# --- Search-R1's prebuilt index file --------------------------------------------------------------


def test_single_index_file_with_its_corpus(tmp_path, corpus, encoder_dir, flat_dir, monkeypatch):
    """Search-R1 ships e5_Flat.index (row i = document i of wiki-18.jsonl) beside the corpus."""
    vectors = _vectors(flat_dir)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    faiss.write_index(index, str(tmp_path / "e5_Flat.index"))
    # the same documents with blank lines between some: rows still count documents only
    my_corpus = _write_corpus(tmp_path / "wiki-18.jsonl", N_DOCS, blank_every=7)
    assert my_corpus.read_text() != corpus.read_text()
    from_file = DenseRetriever(tmp_path / "e5_Flat.index", my_corpus, encoder_dir, SETTINGS)
    from_dir = DenseRetriever(flat_dir, corpus, encoder_dir)
    queries = _queries(10, seed=3)
    assert from_file.retrieve_scored(queries, 4) == from_dir.retrieve_scored(queries, 4)
    assert (tmp_path / "wiki-18.jsonl.offsets" / "offsets.i64").is_file()  # cached beside the corpus
    with pytest.raises(EmapgError, match="nprobe does not apply"):
        DenseRetriever(tmp_path / "e5_Flat.index", my_corpus, encoder_dir, nprobe=4)

    # where the corpus's folder cannot hold the cache, it goes under ~/.cache/emapg
    (tmp_path / "ro").mkdir()
    other = _write_corpus(tmp_path / "ro" / "wiki-18.jsonl", N_DOCS)
    (tmp_path / "ro" / "wiki-18.jsonl.offsets").write_text("a file where the folder would go")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cached = DenseRetriever(tmp_path / "e5_Flat.index", other, encoder_dir, SETTINGS)
    assert cached.retrieve_scored(queries, 4) == from_dir.retrieve_scored(queries, 4)
    assert len(list((tmp_path / "home" / ".cache" / "emapg").glob("*.offsets/offsets.i64"))) == 1

    short = _write_corpus(tmp_path / "short.jsonl", N_DOCS - 1)
    with pytest.raises(EmapgError, match=f"has {N_DOCS} rows but corpus .* has {N_DOCS - 1} documents"):
        DenseRetriever(tmp_path / "e5_Flat.index", short, encoder_dir)
    narrow = faiss.IndexFlatIP(16)
    narrow.add(np.zeros((N_DOCS, 16), np.float32))
    faiss.write_index(narrow, str(tmp_path / "narrow.index"))
    with pytest.raises(EmapgError, match="holds 16-dimensional vectors but encoder .* makes 32"):
        DenseRetriever(tmp_path / "narrow.index", my_corpus, encoder_dir)
    with pytest.raises(EmapgError, match="no such file or folder"):
        DenseRetriever(tmp_path / "missing.index", my_corpus, encoder_dir)


@pytest.mark.slow
def test_build_index_and_serve_retriever_dense_end_to_end(tmp_path, corpus, encoder_dir, flat_dir):
    """`emapg build-index --dense` writes the index the library builds, and `emapg serve-retriever
    --dense` in a subprocess answers Search-R1's /retrieve with the passages and scores the
    in-process retriever gives; Search-R1's single index file is served the same way."""
    import subprocess
    import sys
    from pathlib import Path

    import emapg
    from emapg.cli import main
    from emapg.tasks.search.retriever import HttpRetriever

    copy = tmp_path / "wiki.jsonl"
    shutil.copy(corpus, copy)
    args = ["build-index", "--corpus", str(copy), "--dense", "--encoder", str(encoder_dir)]
    assert main([*args, "--batch-size", "16", "--shard-docs", str(SHARD), "--no-progress"]) == 0
    assert np.array_equal(_vectors(tmp_path / "wiki.jsonl.dense"), _vectors(flat_dir))
    faiss.write_index(faiss.read_index(str(flat_dir / "index.faiss")), str(tmp_path / "e5_Flat.index"))
    local = DenseRetriever(flat_dir, corpus, encoder_dir)
    queries = _queries(20)
    env = {**os.environ, "PYTHONPATH": str(Path(emapg.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    for dense in ([], [str(tmp_path / "e5_Flat.index")]):
        cmd = [sys.executable, "-m", "emapg", "serve-retriever", "--corpus", str(copy), "--port", "0",
               "--dense", *dense, "--encoder", str(encoder_dir)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            line = proc.stdout.readline()
            assert line.startswith(f"serving {N_DOCS} documents at http://127.0.0.1:"), proc.stderr.read()
            assert HttpRetriever(line.split()[-1]).retrieve(queries, 3) == local.retrieve(queries, 3)
        finally:
            proc.terminate()
            # Time limit: the test measured 23 s at load 3-4; x6.
            proc.wait(timeout=150)


def test_dense_cli_needs_an_encoder(tmp_path, corpus, capsys):
    from emapg.cli import main

    assert main(["build-index", "--corpus", str(corpus), "--dense"]) == 2
    assert "build-index --dense needs --encoder PATH" in capsys.readouterr().err
    assert main(["serve-retriever", "--corpus", str(corpus), "--dense"]) == 2
    assert "serve-retriever --dense needs --encoder PATH" in capsys.readouterr().err
    assert main(["build-index", "--corpus", str(corpus), "--out", str(tmp_path / "x")]) == 2
    assert "--out is for --dense" in capsys.readouterr().err
