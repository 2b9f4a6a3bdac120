"""Math data loaders: each schema in each file format, and the one-line errors of broken files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emapg.errors import EmapgError
from emapg.tasks.math_data import EXPECTED, SCHEMA_NAMES, Problem, load_problems
from emapg.tasks.math_grader import score

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A pen costs 1,200 cents. In cents?", "answer": "It is 1,200.\n#### 1,200"},
]
MATH = [
    {"problem": "What is $1/2 + 1/4$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"}
]
MATH500 = [
    {"problem": "Compute $2+2$.", "solution": "So $\\boxed{4}$.", "answer": "4", "unique_id": "x/1.json"}
]
DEEPSCALER = [
    {"problem": "AIME: find n.", "answer": 204},
    {"problem": "AIME: find m.", "answer": 17},
]
OLYMPIAD = [{"question": "Find all x.", "final_answer": ["$x=1$", "$x=2$"], "id": 7}]
# Qwen2.5-Math's evaluation files (aime24, amc23, ...): question + a final answer, no "####"
QWEN_MATH = [
    {"id": 0, "question": "AIME: how many?", "answer": "27", "url": "https://x"},
    {"id": 1, "question": "Find the ratio.", "answer": "\\frac{1}{2}", "url": "https://x"},
]


def write(path, records):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize(
    "records,expected",
    [
        (
            GSM8K,
            [
                ("Tom has 3 apples and buys 4. How many?", "7"),
                ("A pen costs 1,200 cents. In cents?", "1,200"),
            ],
        ),
        (MATH, [("What is $1/2 + 1/4$?", "We get $\\boxed{\\frac{3}{4}}$.")]),
        (MATH500, [("Compute $2+2$.", "4")]),  # answer wins over solution
        (DEEPSCALER, [("AIME: find n.", "204"), ("AIME: find m.", "17")]),  # integer answers
        (OLYMPIAD, [("Find all x.", "x=1, x=2")]),
        (QWEN_MATH, [("AIME: how many?", "27"), ("Find the ratio.", "\\frac{1}{2}")]),
    ],
    ids=["gsm8k", "math", "math500", "deepscaler", "olympiadbench", "qwen_math"],
)
def test_each_schema_in_each_format(tmp_path, suffix, records, expected):
    path = write(tmp_path / f"data{suffix}", records)
    problems = load_problems(path)
    assert problems == [Problem(q, ref, "data", i) for i, (q, ref) in enumerate(expected)]


def test_references_grade_the_right_answers(tmp_path):
    gsm8k = load_problems(write(tmp_path / "g.jsonl", GSM8K))
    math = load_problems(write(tmp_path / "m.jsonl", MATH))
    assert score("\\boxed{1200}", gsm8k[1].reference) == 1.0
    assert score("\\boxed{0.75}", math[0].reference) == 1.0  # the solution's last boxed answer
    assert score("\\boxed{0.5}", math[0].reference) == 0.0


def test_bad_json_on_line_3(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(DEEPSCALER[0]) + "\n" + json.dumps(DEEPSCALER[1]) + "\n{problem: 1}\n")
    with pytest.raises(EmapgError) as e:
        load_problems(path)
    assert str(e.value) == (
        f"math data {path}: line 3: not valid JSON (Expecting property name enclosed in double quotes)"
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_missing_answer_field_names_file_record_and_fields(tmp_path, suffix):
    records = [{**r, "source": "amc"} for r in DEEPSCALER] + [{"problem": "No answer here.", "source": "amc"}]
    if suffix == ".parquet":  # a parquet table has one schema: a missing answer is a null
        records[2] = {"problem": "No answer here.", "answer": None, "source": "amc"}
    path = write(tmp_path / f"gap{suffix}", records)
    with pytest.raises(EmapgError) as e:
        load_problems(path)
    if suffix == ".parquet":
        assert str(e.value) == (
            f"math data {path}: record 3: answer must be text or a number, got NoneType "
            "(fields found: problem, answer, source)"
        )
    else:
        assert str(e.value) == (
            f"math data {path}: record 3: missing field 'answer' of the MATH-500/DeepScaleR/AIME/AMC "
            "schema (fields found: problem, source)"
        )


@pytest.mark.parametrize(
    "records,message",
    [
        (
            [{"text": "hi", "label": 1}],
            "record 1: no known schema (fields found: text, label; expected <EXPECTED>)",
        ),
        ([["a", "b"]], "record 1: no known schema (fields found: none (a list); expected <EXPECTED>)"),
        (
            [GSM8K[0], {"question": "q", "answer": "no final line"}],
            "record 2: answer has no '#### <number>' final line (fields found: question, answer)",
        ),
        (
            [MATH[0], {"problem": "p", "solution": "no box"}],
            "record 2: solution has no \\boxed{} answer (fields found: problem, solution)",
        ),
        (
            [{"question": "q", "final_answer": []}],
            "record 1: final_answer must be a non-empty list of strings, "
            "got [] (fields found: question, final_answer)",
        ),
        ([{"problem": " ", "answer": "1"}], "record 1: empty problem (fields found: problem, answer)"),
        ([DEEPSCALER[0], "text"], "record 2: expected an object, got str"),
    ],
    ids=[
        "unknown",
        "not-an-object-first",
        "gsm8k-no-hashes",
        "math-no-boxed",
        "olympiad-empty",
        "empty",
        "str",
    ],
)
def test_broken_records(tmp_path, records, message):
    path = write(tmp_path / "d.jsonl", records)
    with pytest.raises(EmapgError) as e:
        load_problems(path)
    assert str(e.value) == f"math data {path}: " + message.replace("<EXPECTED>", EXPECTED)


def test_file_level_errors(tmp_path):
    with pytest.raises(EmapgError, match=r"^math data 'nope.jsonl': no such file$"):
        load_problems("nope.jsonl")
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(EmapgError, match=r"unknown file type '.csv'; expected .jsonl, .json, .parquet$"):
        load_problems(tmp_path / "d.csv")
    (tmp_path / "d.json").write_text('{"problem": "p"}')
    with pytest.raises(EmapgError, match=r"d.json: expected a JSON list of records, got dict$"):
        load_problems(tmp_path / "d.json")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(EmapgError, match=r"e.jsonl: no records$"):
        load_problems(tmp_path / "e.jsonl")
    (tmp_path / "f.parquet").write_text("not parquet")
    with pytest.raises(EmapgError, match=r"f.parquet: not a readable parquet file \(.+\)$"):
        load_problems(tmp_path / "f.parquet")


def test_qwen_math_references_grade(tmp_path):
    amc23 = [
        {"id": 0, "question": "AMC: how many?", "answer": 27.0},
        *QWEN_MATH[1:],
    ]  # amc23's answers are floats
    problems = load_problems(write(tmp_path / "amc23.jsonl", amc23))
    assert problems[0].reference == "27.0"
    assert score("\\boxed{27}", problems[0].reference) == 1.0
    assert score("<think>hm</think>\\boxed{0.5}", problems[1].reference) == 1.0


def test_question_answer_is_told_by_the_first_answer(tmp_path):
    # "####" in the first answer: GSM8K, and a later final-answer-only record is an error
    with pytest.raises(EmapgError, match=r"record 2: answer has no '#### <number>' final line"):
        load_problems(write(tmp_path / "a.jsonl", [GSM8K[0], QWEN_MATH[1]]))
    # a final answer first: Qwen2.5-Math, and every answer is taken whole
    mixed = load_problems(write(tmp_path / "b.jsonl", [QWEN_MATH[1], GSM8K[0]]))
    assert [p.reference for p in mixed] == ["\\frac{1}{2}", "3 + 4 = 7\n#### 7"]


@pytest.mark.parametrize(
    "records,schema,expected",
    [
        (GSM8K, "gsm8k", ["7", "1,200"]),
        (GSM8K, "qwen_math", ["3 + 4 = 7\n#### 7", "It is 1,200.\n#### 1,200"]),  # taken whole
        (QWEN_MATH, "qwen_math", ["27", "\\frac{1}{2}"]),
        (MATH500, "math500", ["4"]),
        (MATH500, "math", ["So $\\boxed{4}$."]),  # the solution instead of the answer
        (MATH, "math", ["We get $\\boxed{\\frac{3}{4}}$."]),
        (DEEPSCALER, "math500", ["204", "17"]),
        (OLYMPIAD, "olympiadbench", ["x=1, x=2"]),
    ],
)
def test_an_explicit_schema_is_used(tmp_path, records, schema, expected):
    problems = load_problems(write(tmp_path / "d.parquet", records), schema)
    assert [p.reference for p in problems] == expected


@pytest.mark.parametrize(
    "records,schema,message",
    [
        (QWEN_MATH, "gsm8k", "record 1: answer has no '#### <number>' final line (fields found: id, question, answer, url)"),
        (GSM8K, "math500", "record 1: missing field 'problem' of the MATH-500/DeepScaleR/AIME/AMC schema (fields found: question, answer)"),
        (DEEPSCALER, "qwen_math", "record 1: missing field 'question' of the Qwen2.5-Math evaluation schema (fields found: problem, answer)"),
        (MATH500, "olympiadbench", "record 1: missing field 'question' of the OlympiadBench schema (fields found: problem, solution, answer, unique_id)"),
        (DEEPSCALER, "math", "record 1: missing field 'solution' of the MATH schema (fields found: problem, answer)"),
        (OLYMPIAD, "gsm8k", "record 1: missing field 'answer' of the GSM8K, answer ending in '#### n' schema (fields found: question, final_answer, id)"),
    ],
)  # fmt: skip
def test_a_wrong_explicit_schema_names_file_record_and_fields(tmp_path, records, schema, message):
    path = write(tmp_path / "d.jsonl", records)
    with pytest.raises(EmapgError) as e:
        load_problems(path, schema)
    assert str(e.value) == f"math data {path}: {message}"


def test_schema_names_and_the_config_choices():
    from typing import get_args

    from emapg.tasks.math import MathSettings

    assert get_args(MathSettings.model_fields["schema"].annotation) == SCHEMA_NAMES
    assert SCHEMA_NAMES == ("auto", "olympiadbench", "gsm8k", "qwen_math", "math500", "math")
    with pytest.raises(EmapgError, match=r"^math data: unknown schema 'aime'; expected one of auto, "):
        load_problems("any.jsonl", "aime")
