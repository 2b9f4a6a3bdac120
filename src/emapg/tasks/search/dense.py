"""Dense retrieval as Search-R1 ran it: an e5 encoder and a FAISS inner-product index.

Search-R1 encodes each wiki-18 passage as "passage: " + contents and each query as
"query: " + text with e5-base-v2 (mean pooling, L2-normalised, 256 tokens), and searches a
flat inner-product index (`e5_Flat.index`, row i = document i of the corpus). Here the index is
built by streaming the corpus: the vectors are saved shard by shard (a killed build resumes at
the first missing shard), then added to a FAISS index; a document's text is read back from
the corpus by its byte range, as the BM25 retriever does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from emapg.errors import EmapgError
from emapg.tasks.search.corpus import Documents, file_sha256, iter_corpus, same_corpus

DENSE_FORMAT = 1  # bumped when the saved layout changes; a build of another format starts over
INDEX_TYPES = ("flat", "sq8", "hnsw", "ivf")


@dataclass(frozen=True)
class EncoderSettings:
    query_prefix: str = "query: "  # e5 was trained with these prefixes
    passage_prefix: str = "passage: "
    pooling: str = "mean"  # "mean" over the attention mask (e5), or "cls"
    max_length: int = 256  # Search-R1's, for passages and queries
    normalize: bool = True  # e5 vectors are compared by cosine: inner product of unit vectors
    batch_size: int = 64
    fp16: bool = True  # on cuda only

    def __post_init__(self):
        if self.pooling not in ("mean", "cls"):
            raise EmapgError(f"dense encoder pooling must be 'mean' or 'cls', got {self.pooling!r}")


def _faiss():
    try:
        import faiss
    except ImportError:
        raise EmapgError("dense retrieval needs faiss: pip install 'emapg[dense]' (faiss-cpu)") from None
    return faiss


def _model_folder(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise EmapgError(f"dense encoder {str(path)!r}: not a model folder with a config.json")
    return path


class Encoder:
    """A local Hugging Face encoder (a folder with config.json) turning texts into vectors."""

    def __init__(self, path: str | Path, settings: EncoderSettings | None = None, device: str | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = _model_folder(path)
        self.settings = settings = settings or EncoderSettings()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.fp16 = settings.fp16 and self.device.type == "cuda"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise EmapgError(f"dense encoder {str(path)!r}: cannot load ({str(e).splitlines()[0]})") from None
        if self.fp16:
            self.model.half()
        self.dim = self.model.config.hidden_size

    def encode(self, texts: list[str], *, is_query: bool) -> np.ndarray:
        """float32 [len(texts), dim], one row per text, in order."""
        import torch

        s = self.settings
        prefix = s.query_prefix if is_query else s.passage_prefix
        out = [np.zeros((0, self.dim), np.float32)]
        with torch.inference_mode():
            for i in range(0, len(texts), s.batch_size):
                batch = self.tokenizer([prefix + t for t in texts[i : i + s.batch_size]], padding=True,
                                       truncation=True, max_length=s.max_length, return_tensors="pt")  # fmt: skip
                batch = batch.to(self.device)
                hidden = self.model(**batch).last_hidden_state.float()  # pooled in float32 even in fp16
                if s.pooling == "cls":
                    vectors = hidden[:, 0]
                else:  # padding must not count: average the real tokens only
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    vectors = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
                if s.normalize:
                    vectors = torch.nn.functional.normalize(vectors, dim=-1)
                out.append(vectors.cpu().numpy())
        return np.concatenate(out)


# --- corpus bookkeeping ---------------------------------------------------------------------------


def _write_offsets(corpus: Path, folder: Path) -> dict:
    """Each document's byte span to folder/offsets.i64 (BM25's layout, so `Documents` can read
    it); returns the corpus's identity: size, mtime, sha256 and document count."""
    stat, digest, spans = corpus.stat(), hashlib.sha256(), []
    tmp = folder / "offsets.i64.tmp"
    with tmp.open("wb") as f:
        for start, end, _ in iter_corpus(corpus, digest):  # parses every line: a bad one stops here
            spans.append((start, end))
            if len(spans) == 100_000:  # in blocks: wiki-18's 21M spans need not sit in a list
                f.write(np.asarray(spans, np.int64).tobytes())
                spans = []
        f.write(np.asarray(spans, np.int64).tobytes())
        num_docs = f.tell() // 16
    tmp.replace(folder / "offsets.i64")
    if not num_docs:
        raise EmapgError(f"retriever corpus {str(corpus)!r} has no documents")
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest(),
            "num_docs": num_docs}  # fmt: skip


def _save_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def corpus_offsets(corpus: Path) -> Path:
    """offsets.i64 for a prebuilt index file, cached in `<corpus>.offsets/`, or under
    ~/.cache/emapg/ when the corpus's folder is read-only."""
    key = hashlib.sha256(str(corpus.resolve()).encode()).hexdigest()[:16]
    folders = [corpus.with_name(corpus.name + ".offsets"),
               Path("~/.cache/emapg").expanduser() / f"{corpus.name}-{key}.offsets"]  # fmt: skip
    for folder in folders:
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if same_corpus(corpus, meta, partial(_save_json, folder / "meta.json", meta)):
            return folder / "offsets.i64"
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _save_json(folder / "meta.json", _write_offsets(corpus, folder))
            return folder / "offsets.i64"
        except OSError:
            continue
    raise EmapgError(f"retriever corpus {str(corpus)!r}: nowhere writable to cache its offsets")


def _encoder_id(path: Path) -> str:
    """A hash of the encoder folder's files: another model at the same path is another encoder."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.expanduser().iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
    return h.hexdigest()


# --- building -------------------------------------------------------------------------------------


def build_dense_index(corpus: str | Path, index_dir: str | Path, encoder_path: str | Path,
                      settings: EncoderSettings | None = None, *, index_type: str = "flat",
                      shard_docs: int = 50_000, progress: bool = True, nlist: int | None = None,
                      hnsw_m: int = 32) -> dict:  # fmt: skip
    """Encode `corpus` into `index_dir` (offsets.i64, shards/NNNNN.npy, index.faiss, meta.json).

    A build killed mid-way resumes at its first missing shard when the corpus, the encoder's
    files and the settings that change the vectors are the same (build.json records them);
    otherwise it starts over. shards/ can be deleted once meta.json exists; kept, it lets
    another index type be built without encoding again. Returns the index's metadata."""
    faiss = _faiss()
    if index_type not in INDEX_TYPES:
        raise EmapgError(f"dense index type must be one of {INDEX_TYPES}, got {index_type!r}")
    if shard_docs < 1:
        raise EmapgError(f"dense index shard_docs must be >= 1, got {shard_docs}")
    import torch

    corpus, index_dir = Path(corpus).expanduser(), Path(index_dir).expanduser()
    encoder_path = _model_folder(encoder_path)
    if not corpus.is_file():
        raise EmapgError(f"retriever corpus {str(corpus)!r}: no such file")
    settings = settings or EncoderSettings()
    fp16 = settings.fp16 and torch.cuda.is_available()
    # batch_size is left out: it changes only the padding, which the pooling ignores
    vector_settings = {**asdict(settings), "batch_size": None, "fp16": fp16}
    key = {"format": DENSE_FORMAT, "encoder": _encoder_id(encoder_path), "settings": vector_settings,
           "shard_docs": shard_docs}  # fmt: skip
    build = _start_build(corpus, index_dir, key)

    docs = Documents(corpus, index_dir / "offsets.i64")
    n = len(docs)
    shards = [index_dir / "shards" / f"{s:05d}.npy" for s in range(math.ceil(n / shard_docs))]
    _encode_shards(docs, shards, shard_docs, encoder_path, settings, progress)

    dim = np.load(shards[0], mmap_mode="r").shape[1]
    if index_type == "ivf":
        nlist = min(n, nlist or max(1, round(4 * math.sqrt(n))))
    index = _empty_index(faiss, index_type, dim, shards, n, nlist, hnsw_m)
    for path in shards:  # one shard in memory beside the index
        index.add(np.load(path))
    faiss.write_index(index, str(index_dir / "index.faiss.tmp"))
    (index_dir / "index.faiss.tmp").replace(index_dir / "index.faiss")
    meta = {"format": DENSE_FORMAT, "corpus": {"path": str(corpus.resolve()), **build["corpus"]},
            "encoder_path": str(encoder_path.resolve()), "encoder": build["encoder"],
            "settings": asdict(settings), "index_type": index_type, "dim": int(dim), "num_docs": n,
            "nlist": nlist if index_type == "ivf" else None,
            "hnsw_m": hnsw_m if index_type == "hnsw" else None}  # fmt: skip
    _save_json(index_dir / "meta.json", meta)  # last: its presence marks a complete index
    return meta


def _start_build(corpus: Path, index_dir: Path, key: dict) -> dict:
    """Resume the build in `index_dir` when its build.json matches `key` and the corpus, else
    clear it and start over (offsets written anew); returns the build record, saved as build.json."""
    try:
        build = json.loads((index_dir / "build.json").read_text())
    except (OSError, ValueError):
        build = {}
    if {k: build.get(k) for k in key} == key and same_corpus(corpus, build.get("corpus", {})):
        (index_dir / "meta.json").unlink(missing_ok=True)  # incomplete until written again
    else:  # nothing reusable: start over
        if index_dir.exists():
            for name in ("meta.json", "build.json", "index.faiss", "offsets.i64"):
                (index_dir / name).unlink(missing_ok=True)
            for shard in (index_dir / "shards").glob("*"):
                shard.unlink()
        index_dir.mkdir(parents=True, exist_ok=True)
        build = {**key, "corpus": _write_offsets(corpus, index_dir)}
    (index_dir / "shards").mkdir(exist_ok=True)
    _save_json(index_dir / "build.json", build)  # the key of the shards written from here on
    return build


def _encode_shards(docs: Documents, shards: list[Path], shard_docs: int, encoder_path: Path,
                   settings: EncoderSettings, progress: bool) -> None:  # fmt: skip
    """Encode the passages of every shard not yet on disk, `shard_docs` to a shard; the encoder
    is loaded only if one is missing."""
    n, encoder = len(docs), None
    done = sum(min(shard_docs, n - s * shard_docs) for s, p in enumerate(shards) if p.exists())
    with tqdm(total=n, initial=done, unit="doc", desc="encoding", disable=not progress) as bar:
        for s, path in enumerate(shards):
            if path.exists():  # written whole by the rename below
                continue
            encoder = encoder or Encoder(encoder_path, settings)
            parts, end = [], min(n, (s + 1) * shard_docs)
            for i in range(s * shard_docs, end, settings.batch_size):
                texts = [docs[j]["contents"] for j in range(i, min(end, i + settings.batch_size))]
                parts.append(encoder.encode(texts, is_query=False))
                bar.update(len(texts))
            tmp = path.with_suffix(".tmp")
            with tmp.open("wb") as f:
                np.save(f, np.concatenate(parts))
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the name says the shard is done
            tmp.replace(path)


def _empty_index(faiss, index_type: str, dim: int, shards: list[Path], n: int, nlist: int | None,
                 hnsw_m: int):  # fmt: skip
    """A FAISS inner-product index of `index_type`, trained where the type needs it (on a
    sample of the shards' n vectors) and still without vectors."""
    if index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if index_type == "sq8":  # one byte per dimension, a quarter of flat's memory
        index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        index.train(_sample(shards, n, min(n, 100_000)))  # each dimension's range
        return index
    if index_type == "hnsw":
        return faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.train(_sample(shards, n, min(n, 64 * nlist)))  # FAISS asks for 39+ points per list
    return index


def _sample(shards: list[Path], n: int, size: int) -> np.ndarray:
    """`size` rows drawn at random (fixed seed) from the shards, reading only those rows."""
    rows, parts, start = np.sort(np.random.default_rng(0).choice(n, size, replace=False)), [], 0
    for path in shards:
        x = np.load(path, mmap_mode="r")
        parts.append(np.asarray(x[rows[(rows >= start) & (rows < start + len(x))] - start]))
        start += len(x)
    return np.concatenate(parts)


# --- serving --------------------------------------------------------------------------------------


class DenseRetriever:
    """Top-k documents by inner product of e5 vectors, from a folder made by build_dense_index
    or from one FAISS index file whose row i is document i of `corpus` (Search-R1's e5_Flat.index)."""

    def __init__(self, index_path: str | Path, corpus: str | Path, encoder_path: str | Path,
                 settings: EncoderSettings | None = None, *, nprobe: int | None = None,
                 ef_search: int | None = None):  # fmt: skip
        faiss = _faiss()
        index_path, corpus = Path(index_path).expanduser(), Path(corpus).expanduser()
        encoder_path = _model_folder(encoder_path)
        if not corpus.is_file():
            raise EmapgError(f"retriever corpus {str(corpus)!r}: no such file")
        if index_path.is_dir():
            try:
                meta = json.loads((index_path / "meta.json").read_text())
            except (OSError, ValueError):
                raise EmapgError(
                    f"dense index {str(index_path)!r}: incomplete (no meta.json); build it again"
                ) from None
            save = partial(_save_json, index_path / "meta.json", meta)
            if meta.get("format") != DENSE_FORMAT or not same_corpus(corpus, meta.get("corpus", {}), save):
                raise EmapgError(
                    f"dense index {str(index_path)!r} was not built from {str(corpus)!r}; build it again"
                )
            if _encoder_id(encoder_path) != meta["encoder"]:  # its query vectors would be nonsense here
                raise EmapgError(
                    f"dense index {str(index_path)!r} was built with another encoder ({meta['encoder_path']})"
                )
            # queries are encoded the way the index's passages were, unless told otherwise
            settings = settings or EncoderSettings(**meta["settings"])
            index_file, offsets = index_path / "index.faiss", index_path / "offsets.i64"
        elif index_path.is_file():
            index_file, offsets = index_path, corpus_offsets(corpus)
        else:
            raise EmapgError(f"dense index {str(index_path)!r}: no such file or folder")
        self.index = faiss.read_index(str(index_file))
        self.docs = Documents(corpus, offsets)
        if self.index.ntotal != len(self.docs):
            raise EmapgError(
                f"dense index {str(index_file)!r} has {self.index.ntotal} rows but corpus "
                f"{str(corpus)!r} has {len(self.docs)} documents"
            )
        self.encoder = Encoder(encoder_path, settings)
        if self.index.d != self.encoder.dim:
            raise EmapgError(
                f"dense index {str(index_file)!r} holds {self.index.d}-dimensional vectors but "
                f"encoder {str(encoder_path)!r} makes {self.encoder.dim}-dimensional ones"
            )
        for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
            if value is not None:
                try:
                    faiss.ParameterSpace().set_index_parameter(self.index, name, value)
                except RuntimeError:
                    raise EmapgError(
                        f"dense index {str(index_file)!r}: {name} does not apply to it"
                    ) from None
        self._lock = threading.Lock()  # the HTTP server is threaded; one batch at a time on the model

    def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        return [[doc for doc, _ in hits] for hits in self.retrieve_scored(queries, topk)]

    def retrieve_scored(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        if not queries:
            return []
        with self._lock:
            scores, ids = self.index.search(
                self.encoder.encode(queries, is_query=True), min(topk, len(self.docs))
            )
        # an approximate index returns id -1 where it found fewer than k
        return [
            [(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True) if i >= 0]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]
