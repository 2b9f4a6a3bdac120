"""Retrieval at wiki scale, side by side on one corpus: emapg's BM25 (its MaxScore top-k), tantivy,
bm25s numpy, bm25s numba and a dense FAISS index: build time, peak memory, queries per second.

The corpus is synthetic (default 2,000,000 passages of about 100 words, ~1.35 GB): words drawn
with Zipf-like frequencies from a 300k-word vocabulary whose most frequent words are English
stopwords, plus one planted passage every 8,000 holding three words found nowhere else. Queries
are 2-5 words from the body of the distribution; a planted query is its passage's three words and
two common ones, and its passage must come first. Each retriever runs in a fresh subprocess that
builds its index (as `emapg serve-retriever` does at its first start) and then answers, and
reports its own wall times and peak RSS (ru_maxrss): the figures are a server's, not this driver's.

- emapg: the whole 2,560-query batch of the paper (512 prompts x 5 samples), one thread, as
  `emapg serve-retriever` answers one request.
- tantivy: the Rust engine's official bindings, block-max WAND top-k, bm25s's analysis.
- bm25s numpy / numba: its own in-memory index of the same corpus (tokenized in chunks), built
  once, then its numpy scorer on a slice of the batch (`--bm25s-queries`: it is slow, reported
  per query) and its numba scorer (where numba is installed) on the whole batch. Its scoring is
  emapg's (lucene, k1 1.5, b 0.75), so their top 3 should be emapg's up to float32 ties.
- dense: a tiny random BERT-style encoder (no download) encoding `--dense-passages` passages and
  the queries, and FAISS's flat inner-product search over them; the figures scale to wiki-18
  below by the arithmetic printed.

    python benchmarks/retrieval_scale.py                          # 2M passages in a temp dir
    python benchmarks/retrieval_scale.py --passages 200000 --dir /tmp/corpus --keep
    python benchmarks/retrieval_scale.py --passages 8000000 --dir /tmp/c --only emapg tantivy
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIKI18 = 21_015_324  # passages in Search-R1's wiki-18
PAPER_BATCH = 512 * 5
PLANT_EVERY = 8000

CHILD = r"""
import json, resource, sys, time
import numpy as np
name, corpus, queries, limit = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read()), int(sys.argv[4])
runs = {}

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def measure(label, search, n, build_s):
    search(queries[:8])  # first touch of the mapped files, compilation of numba's kernels
    t = time.perf_counter()
    rows = search(queries[:n])
    runs[label] = {"build_s": build_s, "build_rss_mib": build_rss, "query_s": time.perf_counter() - t,
                   "queries": n, "rows": rows, "peak_rss_mib": rss()}

t = time.perf_counter()
if name == "emapg":
    from emapg.tasks.search.bm25 import BM25Retriever
    r = BM25Retriever(corpus)
    build_s, build_rss = time.perf_counter() - t, rss()
    measure("emapg", lambda qs: [[row for row, _ in r.search(q, 3)] for q in qs], len(queries), build_s)
elif name == "tantivy":  # bm25s's analysis; tantivy's BM25 (k1 1.2, b 0.75, one-byte lengths)
    import shutil, tantivy
    from pathlib import Path
    from bm25s.stopwords import STOPWORDS_EN
    analyzer = (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.regex(r"(?u)\b\w\w+\b"))
                .filter(tantivy.Filter.lowercase()).filter(tantivy.Filter.custom_stopword(list(STOPWORDS_EN))).build())
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("body", tokenizer_name="bm25s", index_option="freq")
    builder.add_integer_field("row", fast=True)
    schema = builder.build()
    path = Path(corpus + ".tantivy")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    index = tantivy.Index(schema, path=str(path))
    index.register_tokenizer("bm25s", analyzer)
    writer = index.writer(heap_size=1 << 30, num_threads=2)
    with open(corpus, "rb") as f:
        for row, line in enumerate(f):
            writer.add_document(tantivy.Document(body=json.loads(line)["contents"], row=row))
    writer.commit()
    writer.wait_merging_threads()
    index.reload()
    searcher = index.searcher()
    build_s, build_rss = time.perf_counter() - t, rss()
    def search(qs):
        out = []
        for q in qs:
            clauses = [(tantivy.Occur.Should, tantivy.Query.term_query(schema, "body", w)) for w in analyzer.analyze(q)]
            hits = searcher.search(tantivy.Query.boolean_query(clauses), 3, count=False).hits
            out.append(searcher.fast_field_values("row", [a for _, a in hits]))
        return out
    measure("tantivy", search, len(queries), build_s)
    shutil.rmtree(path)
else:  # bm25s's own in-memory index (its defaults, as emapg's), then its numpy and numba scorers
    import bm25s
    from bm25s.tokenization import Tokenizer
    tok = Tokenizer(stopwords="en")
    ids, chunk = [], []
    with open(corpus, "rb") as f:
        for line in f:
            chunk.append(json.loads(line)["contents"])
            if len(chunk) == 100_000:
                ids += tok.tokenize(chunk, update_vocab=True, return_as="ids", show_progress=False)
                chunk = []
    ids += tok.tokenize(chunk, update_vocab=True, return_as="ids", show_progress=False)
    index = bm25s.BM25()
    index.index((ids, tok.get_vocab_dict()), show_progress=False)
    del ids
    build_s, build_rss = time.perf_counter() - t, rss()
    def search(qs):
        q = tok.tokenize(qs, update_vocab=False, return_as="ids", show_progress=False)
        docs, _ = index.retrieve(q, k=3, show_progress=False, n_threads=1)
        return docs.tolist()
    measure("bm25s numpy", search, limit, build_s)
    try:
        import numba  # noqa: F401
        index.backend = "numba"
        measure("bm25s numba", search, len(queries), build_s)
    except ImportError:
        pass
print(json.dumps(runs))
"""

DENSE_CHILD = r"""
import json, resource, sys, time, tempfile
import numpy as np
from pathlib import Path
import faiss, torch
from transformers import BertConfig, BertModel, BertTokenizerFast
from emapg.tasks.search.dense import Encoder, EncoderSettings
corpus, queries, n = sys.argv[1], json.loads(open(sys.argv[2]).read()), int(sys.argv[3])
torch.manual_seed(0)
where = Path(tempfile.mkdtemp())
vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
(where / "vocab.txt").write_text("\n".join(vocab))
BertTokenizerFast(vocab_file=str(where / "vocab.txt")).save_pretrained(where)
config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=512)
BertModel(config).save_pretrained(where)
encoder = Encoder(str(where), EncoderSettings(max_length=128))
texts = []
with open(corpus, "rb") as f:
    for line in f:
        texts.append(json.loads(line)["contents"])
        if len(texts) == n:
            break
t = time.perf_counter()
vectors = encoder.encode(texts, is_query=False)
encode_s = time.perf_counter() - t
index = faiss.IndexFlatIP(vectors.shape[1])
index.add(vectors)
t = time.perf_counter()
q = encoder.encode(queries, is_query=True)
query_encode_s = time.perf_counter() - t
t = time.perf_counter()
index.search(q, 3)
search_s = time.perf_counter() - t
print(json.dumps({"passages": n, "dim": int(vectors.shape[1]), "encode_s": encode_s, "queries": len(queries),
                  "query_encode_s": query_encode_s, "search_s": search_s,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def vocabulary(n: int, rng: np.random.Generator) -> list[str]:
    from bm25s.stopwords import STOPWORDS_EN

    stop = list(dict.fromkeys(w for w in STOPWORDS_EN if w.isalpha()))[:60]
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = set(stop)
    out = list(stop)
    while len(out) < n:
        for length in rng.integers(3, 11, size=n):
            w = "".join(letters[rng.integers(0, 26, size=length)])
            if w not in words:
                words.add(w)
                out.append(w)
                if len(out) == n:
                    break
    return out


def planted_words(i: int) -> list[str]:
    """Three words of the i-th planted passage: digits in them, so no vocabulary word matches."""
    return [f"p{i}x{j}q" for j in range(3)]


def generate(path: Path, passages: int, seed: int = 0, vocab_size: int = 300_000, write: bool = True):
    """Write the corpus; return the vocabulary and its cumulative frequencies (for queries)."""
    rng = np.random.default_rng(seed)
    words = np.array(vocabulary(vocab_size, rng), dtype=object)
    p = 1.0 / (np.arange(vocab_size) + 2.7) ** 1.07  # Zipf-Mandelbrot, as in English text
    cdf = np.cumsum(p / p.sum())
    if not write:
        return words, cdf
    with path.open("w", encoding="utf-8") as f:
        for start in range(0, passages, 10_000):
            n = min(10_000, passages - start)
            lengths = np.clip(rng.normal(100, 20, size=n).astype(int), 40, 160)
            ids = np.searchsorted(cdf, rng.random(int(lengths.sum())))
            ids = np.minimum(ids, vocab_size - 1)
            text = words[ids]
            cuts = np.concatenate([[0], np.cumsum(lengths)])
            lines = []
            for j in range(n):
                body = list(text[cuts[j] : cuts[j + 1]])
                row = start + j
                if row % PLANT_EVERY == PLANT_EVERY // 2:
                    body[5:5] = planted_words(row // PLANT_EVERY)
                title = " ".join(body[:2]).title()
                lines.append(json.dumps({"id": str(row), "contents": f"{title}\n{' '.join(body)}"}))
            f.write("\n".join(lines) + "\n")
    return words, cdf


def child(script: str, *args: str) -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")  # the emapg of this checkout
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"},
    )
    if proc.returncode:
        sys.exit(f"{args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=2_000_000)
    ap.add_argument("--queries", type=int, default=PAPER_BATCH, help="the batch (default: the paper's)")
    ap.add_argument(
        "--bm25s-queries", type=int, default=256, help="of the batch, answered by bm25s numpy (slow)"
    )
    ap.add_argument("--dense-passages", type=int, default=20_000)
    ap.add_argument("--only", nargs="+", choices=["emapg", "tantivy", "bm25s", "dense"])
    ap.add_argument("--dir", help="where to write the corpus (default: a temp dir, deleted at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and emapg's index")
    ap.add_argument("--reuse", action="store_true", help="reuse a kept corpus (and its index) in --dir")
    args = ap.parse_args()
    where = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="retrieval-scale-"))
    where.mkdir(parents=True, exist_ok=True)
    corpus = where / f"synthetic-{args.passages}.jsonl"
    runs = args.only or ["emapg", "tantivy", "bm25s", "dense"]
    try:
        t = time.perf_counter()
        words, cdf = generate(corpus, args.passages, write=not (args.reuse and corpus.is_file()))
        size = corpus.stat().st_size
        print(f"corpus: {args.passages:,} passages, {size / 1e9:.2f} GB ({time.perf_counter() - t:.0f} s)")
        rng = np.random.default_rng(1)
        planted = args.passages // PLANT_EVERY
        queries, answers = [], {}  # every 10th query a planted one: its passage's row
        for i in range(args.queries):
            if planted and i % 10 == 0:
                k = i // 10 % planted
                queries.append(" ".join(planted_words(k) + list(words[rng.integers(60, 200, 2)])))
                answers[i] = k * PLANT_EVERY + PLANT_EVERY // 2
            else:  # 2-5 words from the body of the distribution
                queries.append(
                    " ".join(words[np.searchsorted(cdf, rng.uniform(0.3, 1.0, size=rng.integers(2, 6)))])
                )
        qfile = where / "queries.json"
        qfile.write_text(json.dumps(queries))
        results = {}
        for name in runs:
            if name == "dense":
                results[name] = child(DENSE_CHILD, str(corpus), str(qfile), str(args.dense_passages))
            else:  # bm25s: its numpy scorer, and its numba one where numba is installed
                results |= child(
                    CHILD, name, str(corpus), str(qfile), str(min(args.bm25s_queries, args.queries))
                )
        report(results, answers, args.passages, size, corpus)
    finally:
        if not args.keep:
            corpus.unlink(missing_ok=True)
            shutil.rmtree(corpus.with_name(corpus.name + ".bm25"), ignore_errors=True)
            (where / "queries.json").unlink(missing_ok=True)
            if not args.dir:
                shutil.rmtree(where, ignore_errors=True)


def report(results: dict, answers: dict[int, int], passages: int, size: int, corpus: Path) -> None:
    print(f"\n{'retriever':<12} {'build s':>8} {'build RSS':>10} {'queries':>8} {'queries/s':>10} "
          f"{'2,560-batch s':>14} {'peak RSS':>9}")  # fmt: skip
    for name, r in results.items():
        if name == "dense":
            continue
        qps = r["queries"] / r["query_s"]
        print(f"{name:<12} {r['build_s']:>8.0f} {r['build_rss_mib']:>7.0f} MiB {r['queries']:>8} "
              f"{qps:>10.1f} {PAPER_BATCH / qps:>14.1f} {r['peak_rss_mib']:>5.0f} MiB")  # fmt: skip
    if "emapg" in results:
        e = results["emapg"]
        rows = e["rows"]
        first = sum(rows[i][:1] == [row] for i, row in answers.items())
        print(f"\nplanted passages retrieved first by emapg: {first} of {len(answers)}")
        index = corpus.with_name(corpus.name + ".bm25")
        if index.exists():
            index_bytes = sum(f.stat().st_size for f in index.rglob("*") if f.is_file())
            print(
                f"emapg's index: {index_bytes / 1e9:.2f} GB on disk ({index_bytes / size:.2f} x the corpus)"
            )
        for name in ("bm25s numpy", "bm25s numba", "tantivy"):
            if name in results:
                other = results[name]
                n = other["queries"]
                # bm25s fills the top 3 with score-0 passages where fewer match: compare what emapg gives
                same = np.mean(
                    [set(a) == set(b[: len(a)]) for a, b in zip(rows[:n], other["rows"], strict=True)]
                )
                top1 = np.mean([a[:1] == b[:1] for a, b in zip(rows[:n], other["rows"], strict=True)])
                ratio = (e["queries"] / e["query_s"]) / (n / other["query_s"])
                print(
                    f"vs {name}: {ratio:.1f}x the queries/s; same top-3 set on {same:.1%} of "
                    f"{n} queries, same first passage on {top1:.1%} "
                    + (
                        "(the same scoring)"
                        if name.startswith("bm25s")
                        else "(tantivy's BM25: k1 1.2, one-byte lengths)"
                    )
                )
        scale = WIKI18 / passages
        qps = e["queries"] / e["query_s"]
        print(f"\nwiki-18 ({WIKI18:,} passages) = {scale:.1f} x this corpus. emapg's BM25, scaled linearly "
              f"(no per-query cost grows faster than the corpus: a lower bound on the rate):\n"
              f"  build {e['build_s']:.0f} s x {scale:.1f} = {e['build_s'] * scale / 60:.0f} min; "
              f"{qps:.0f} q/s / {scale:.1f} = {qps / scale:.0f} q/s, a 2,560-query turn in "
              f"{PAPER_BATCH / (qps / scale):.0f} s on one thread")  # fmt: skip
    if "dense" in results:
        d = results["dense"]
        enc, qenc = d["passages"] / d["encode_s"], d["queries"] / d["query_encode_s"]
        flops = 2 * d["passages"] * d["dim"] * d["queries"] / d["search_s"]
        print(
            f"\ndense (tiny random BERT, dim {d['dim']}, 2 layers, 128 tokens): encode {enc:.0f} passages/s, "
            f"queries {qenc:.0f}/s; flat search of {d['queries']} queries over {d['passages']:,} "
            f"vectors {d['search_s'] * 1e3:.0f} ms ({flops / 1e9:.1f} GFLOP/s); peak RSS {d['peak_rss_mib']:.0f} MiB"
        )
        e5 = 2 * WIKI18 * 768 * PAPER_BATCH
        print(f"  wiki-18 with e5-base-v2 (dim 768): a flat index is {WIKI18 * 768 * 4 / 2**30:.0f} GiB of float32 "
              f"(Search-R1's e5_Flat.index: more than this machine's RAM); one 2,560-query batch is "
              f"2 x {WIKI18:,} x 768 x {PAPER_BATCH} = {e5 / 1e12:.0f} TFLOP, {e5 / flops / 60:.0f} min at "
              f"this machine's measured {flops / 1e9:.1f} GFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
