"""The jsonl corpus that local retrievers index: streamed line by line, its documents read back by
byte range, and the key that says whether an index built from it is still current."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from emapg.errors import EmapgError


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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def same_corpus(corpus: Path, record: dict, save=None) -> bool:
    """Whether `corpus` is the file `record` (its size, mtime_ns and sha256) describes.

    The key is the corpus's full sha256, computed once while building. Hashing 14 GB again at
    every start would take about half a minute, so size and mtime stand in for it: same size and
    mtime, it is the same; same size but another mtime (a copy, a touch), the corpus is hashed,
    and if the hash matches the record's mtime is updated and `save` called, to skip the hash
    next time (a read-only index folder hashes again next time); another size, it is another."""
    stat = corpus.stat()
    if record.get("size") != stat.st_size:
        return False
    if record.get("mtime_ns") == stat.st_mtime_ns:
        return True
    if file_sha256(corpus) != record.get("sha256"):
        return False
    record["mtime_ns"] = stat.st_mtime_ns
    if save:
        with contextlib.suppress(OSError):
            save()
    return True


def index_is_current(corpus: Path, index_dir: Path, index_format: int) -> bool:
    """Whether `index_dir` holds a complete index of this corpus (`same_corpus`), of this format."""
    try:
        meta = json.loads((index_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return False

    def save():
        (index_dir / "meta.json").write_text(json.dumps(meta))

    return meta.get("format") == index_format and same_corpus(corpus, meta, save)


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
