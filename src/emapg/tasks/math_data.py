"""Math problem files: `.jsonl`, `.json` (a list of records) and `.parquet`, schema told by the fields.

| schema (task.schema) | fields | reference |
|---|---|---|
| gsm8k: GSM8K | question, answer ending in "#### n" | the number after "####" |
| qwen_math: Qwen2.5-Math evaluation files (aime24, amc23, ...) | question, answer | answer |
| math500: MATH-500, DeepScaleR, AIME, AMC | problem, answer | answer |
| math: MATH | problem, solution | the boxed answer(s) of solution |
| olympiadbench: OlympiadBench | question, final_answer | the list's entries, "$" removed, joined by ", " |

With schema "auto" (the default) the first record decides: its fields, and for question +
answer the answer's form (a "####" line is GSM8K, anything else a final answer). Every record
must then have the schema's fields. A broken file, or one without the fields of an explicit
schema, stops with one line naming the file, the record (1-based) and the fields found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from emapg.errors import EmapgError
from emapg.tasks.records import read_records

BOXED = "\\boxed"  # the command a final answer is written in


@dataclass(frozen=True)
class Problem:
    question: str
    reference: str
    source: str  # the file's stem: the dataset's name in evaluation tables
    index: int  # 0-based record number in the file


def _gsm8k(record: dict) -> str:
    answer = _text(record, "answer")
    if "####" not in answer:
        raise ValueError("answer has no '#### <number>' final line")
    return answer.rpartition("####")[2].strip()


def _math_solution(record: dict) -> str:
    solution = _text(record, "solution")
    if BOXED not in solution:
        raise ValueError("solution has no \\boxed{} answer")
    return solution  # the grader takes the last boxed answer of a reference that has one


def _olympiad(record: dict) -> str:
    answers = record["final_answer"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"final_answer must be a non-empty list of strings, got {answers!r:.60}")
    return ", ".join(a.strip().strip("$").strip() for a in answers)


# name: (question field, answer field, description, reference of a record); auto checks them
# in this order, gsm8k and qwen_math (the same fields) told apart by the first answer.
SCHEMAS = {
    "olympiadbench": ("question", "final_answer", "OlympiadBench", _olympiad),
    "gsm8k": ("question", "answer", "GSM8K, answer ending in '#### n'", _gsm8k),
    "qwen_math": ("question", "answer", "Qwen2.5-Math evaluation", lambda r: _text(r, "answer")),
    "math500": ("problem", "answer", "MATH-500/DeepScaleR/AIME/AMC", lambda r: _text(r, "answer")),
    "math": ("problem", "solution", "MATH", _math_solution),
}
SCHEMA_NAMES = ("auto", *SCHEMAS)  # the choices of task.schema
EXPECTED = "; ".join(f"{q}+{a} ({desc})" for q, a, desc, _ in SCHEMAS.values())


def _text(record: dict, key: str) -> str:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{key} must be text or a number, got {type(value).__name__}")
    return str(value).strip()


def load_problems(path: str | Path, schema: str = "auto") -> list[Problem]:
    """The problems of one file, in file order; `schema`: one of SCHEMA_NAMES."""
    if schema not in SCHEMA_NAMES:
        raise EmapgError(f"math data: unknown schema {schema!r}; expected one of {', '.join(SCHEMA_NAMES)}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise EmapgError(f"math data {str(path)!r}: no such file")
    records = read_records(file, "math data", (".jsonl", ".json", ".parquet"))
    if not records:
        raise EmapgError(f"math data {file}: no records")
    fields = SCHEMAS[schema] if schema != "auto" else _detect(file, records[0])
    question_key, answer_key, name, reference = fields
    problems = []
    for i, record in enumerate(records):
        where = f"math data {file}: record {i + 1}"
        if not isinstance(record, dict):
            raise EmapgError(f"{where}: expected an object, got {type(record).__name__}")
        missing = [k for k in (question_key, answer_key) if k not in record]
        if missing:
            raise EmapgError(
                f"{where}: missing field {missing[0]!r} of the {name} schema (fields found: {_fields(record)})"
            )
        try:
            question, answer = _text(record, question_key), reference(record)
            if not question or not answer:
                raise ValueError(f"empty {question_key if not question else 'answer'}")
            problems.append(Problem(question, answer, file.stem, i))
        except ValueError as e:
            raise EmapgError(f"{where}: {e} (fields found: {_fields(record)})") from None
    return problems


def _detect(file: Path, first) -> tuple:
    if isinstance(first, dict):
        for name, schema in SCHEMAS.items():
            if schema[0] in first and schema[1] in first:
                if name == "gsm8k" and "####" not in str(first["answer"]):
                    continue  # a final answer without GSM8K's worked solution: qwen_math
                return schema
        found = _fields(first)
    else:
        found = f"none (a {type(first).__name__})"
    raise EmapgError(
        f"math data {file}: record 1: no known schema (fields found: {found}; expected {EXPECTED})"
    )


def _fields(record: dict) -> str:
    return ", ".join(map(str, record)) or "none"
