"""Records (one dict of fields per example) from local data files, for the tasks that read data.

.jsonl (one object per line, blank lines skipped), .json (a list), .parquet and .csv (a header
row). Every problem is one line that starts with the caller's label and names the file.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from emapg.errors import EmapgError

FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv")


def read_records(file: Path, label: str, types: tuple[str, ...] = FILE_TYPES) -> list:
    """The records of `file`, whose suffix must be one of `types` (records are not checked to be
    dicts: callers say what they expect of each)."""
    where = f"{label} {file}"
    suffix = file.suffix.lower()
    if suffix not in types:
        raise EmapgError(f"{where}: unknown file type {suffix!r}; expected {', '.join(types)}")
    if suffix == ".jsonl":
        records = []
        with file.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise EmapgError(f"{where}: line {n}: not valid JSON ({e.msg})") from None
        return records
    if suffix == ".json":
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise EmapgError(f"{where}: not valid JSON (line {e.lineno}: {e.msg})") from None
        if not isinstance(data, list):
            raise EmapgError(f"{where}: expected a JSON list of records, got {type(data).__name__}")
        return data
    if suffix == ".csv":
        with file.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file).to_pylist()
    except Exception as e:  # pyarrow's errors name no common base class
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EmapgError(f"{where}: not a readable parquet file ({detail})") from None
