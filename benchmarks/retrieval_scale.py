"""Retrieval at wiki scale: build time, peak memory and query throughput of the streamed BM25.

Generates a synthetic jsonl corpus (default 2,000,000 passages of about 100 words, ~1.3 GB;
words drawn with Zipf-like frequencies from a 300k-word vocabulary whose most frequent words are
English stopwords), then in fresh subprocesses (1) builds the index with `BM25Retriever`, as
`emapg serve-retriever` does at start, and (2) loads it memory-mapped and answers queries. Each
subprocess reports its own wall time and peak RSS (ru_maxrss), so the figures are those of a
server process, not of this driver.

    python benchmarks/retrieval_scale.py                       # 2M passages in a temp dir
    python benchmarks/retrieval_scale.py --passages 200000 --dir /tmp/corpus --keep
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

CHILD = r"""
import json, resource, sys, time
import numpy as np
from emapg.search.retriever import BM25Retriever
phase, corpus = sys.argv[1], sys.argv[2]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
r = BM25Retriever(corpus)
out = {"phase": phase, "seconds": time.perf_counter() - t, "docs": len(r.docs), "base_rss_kib": base}
if phase == "serve":
    queries = json.loads(sys.argv[3])
    r.retrieve(queries[:8], 3)  # first touch of the mapped files
    t = time.perf_counter()
    for i in range(0, len(queries), 64):
        r.retrieve(queries[i : i + 64], 3)
    out["queries"] = len(queries)
    out["query_seconds"] = time.perf_counter() - t
out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
# at the end: process memory (anonymous) vs pages of the mapped index files (page cache)
for line in open("/proc/self/status"):
    if line.startswith(("RssAnon", "RssFile")):
        out[line.split(":")[0]] = int(line.split()[1])
print(json.dumps(out))
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
                body = text[cuts[j] : cuts[j + 1]]
                title = " ".join(body[:2]).title()
                lines.append(json.dumps({"id": str(start + j), "contents": f"{title}\n{' '.join(body)}"}))
            f.write("\n".join(lines) + "\n")
    return words, cdf


def child(phase: str, corpus: Path, *extra: str) -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")  # the emapg of this checkout
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, phase, str(corpus), *extra],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
    )
    if proc.returncode:
        sys.exit(f"{phase} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=2_000_000)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--dir", help="where to write the corpus (default: a temp dir, deleted at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and its index")
    ap.add_argument("--reuse", action="store_true", help="reuse a kept corpus (and its index) in --dir")
    args = ap.parse_args()
    where = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="retrieval-scale-"))
    where.mkdir(parents=True, exist_ok=True)
    corpus = where / f"synthetic-{args.passages}.jsonl"
    try:
        t = time.perf_counter()
        words, cdf = generate(corpus, args.passages, write=not (args.reuse and corpus.is_file()))
        size = corpus.stat().st_size
        print(f"corpus: {args.passages} passages, {size / 1e9:.2f} GB ({time.perf_counter() - t:.0f} s)")
        build = child("build", corpus)
        index = corpus.with_name(corpus.name + ".bm25")
        index_bytes = sum(f.stat().st_size for f in index.iterdir())
        rng = np.random.default_rng(1)
        # queries of 2 to 5 words, from the body of the distribution (not the stopwords)
        queries = [
            " ".join(words[np.searchsorted(cdf, rng.uniform(0.3, 1.0, size=rng.integers(2, 6)))])
            for _ in range(args.queries)
        ]
        serve = child("serve", corpus, json.dumps(queries))
        mib = 1 / 1024
        print(f"index: {index_bytes / 1e9:.2f} GB on disk ({index_bytes / size:.2f} x the corpus)")
        print(
            f"build: {build['seconds']:.0f} s, peak RSS {build['peak_rss_kib'] * mib:.0f} MiB "
            f"({build['peak_rss_kib'] * 1024 / size:.2f} x the corpus; interpreter and imports "
            f"{build['base_rss_kib'] * mib:.0f} MiB)"
        )
        print(
            f"serve: load {serve['seconds']:.1f} s, peak RSS {serve['peak_rss_kib'] * mib:.0f} MiB "
            f"({serve['peak_rss_kib'] * 1024 / size:.2f} x the corpus) after {serve['queries']} "
            f"queries, {serve['queries'] / serve['query_seconds']:.1f} queries/s "
            f"(topk 3, batches of 64, one thread); at the end {serve.get('RssAnon', 0) * mib:.0f} MiB "
            f"anonymous + {serve.get('RssFile', 0) * mib:.0f} MiB of mapped files"
        )
    finally:
        if not args.keep:
            corpus.unlink(missing_ok=True)
            shutil.rmtree(corpus.with_name(corpus.name + ".bm25"), ignore_errors=True)
            if not args.dir:
                where.rmdir()


if __name__ == "__main__":
    main()
