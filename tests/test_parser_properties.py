"""Property tests for every parser of model output or user text: boxed-answer grading, the
arithmetic answer, config overrides. None may raise (overrides: only EmapgError) or hang."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from emapg.errors import EmapgError
from emapg.tasks.arithmetic import exact_match
from emapg.tasks.math_grader import has_boxed_answer, score
from emapg.training.config import load_config
from emapg.training.config_reference import reference

# Fragments a policy writes around answers: unbalanced braces, nested boxes, huge powers.
LATEX = st.lists(
    st.sampled_from(
        [
            "\\boxed{",
            "{",
            "}",
            "\\frac",
            "^",
            "10",
            "9",
            "-",
            ".",
            ",",
            "x",
            " ",
            "\\sqrt",
            "\\infty",
            "(",
            "]",
            "\\\\",
            "$",
            "\\left(",
            "=",
            "\\pi",
            "e",
            "!",
            "\n",
        ]
    ),  # fmt: skip
    max_size=40,
).map("".join)
HANG = settings(max_examples=150, deadline=5000)  # a call over 5 s counts as a hang


@HANG
@given(LATEX | st.text(max_size=200), LATEX | st.text(max_size=30))
def test_boxed_grading_never_raises_and_is_zero_or_one(response, reference):
    assert score(response, reference) in (0.0, 1.0)
    assert has_boxed_answer(response) in (True, False)


@HANG
@given(st.integers(-(10**12), 10**12), st.text(max_size=50), st.sampled_from(["", " ", "\n"]))
def test_the_last_boxed_integer_is_graded_right(n, before, space):
    assert score(f"{before} \\boxed{{{n + 1}}} then \\boxed{{{space}{n}{space}}}", str(n)) == 1.0
    assert score(f"{before} \\boxed{{{n}}} then \\boxed{{{n + 1}}}", str(n)) == 0.0


WORDS = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=60)


@settings(max_examples=300, deadline=200)
@given(st.integers(0, 10**6).map(str), st.sampled_from([" ", "\n", "\t", "<", "<eos>"]), WORDS, WORDS)
def test_arithmetic_answer_is_the_first_word(answer, end, rest, anything):
    assert exact_match(f"  {answer}{end}{rest}", answer) == 1.0
    assert exact_match(f"x{answer}{end}{rest}", answer) == 0.0
    assert exact_match(anything, answer) in (0.0, 1.0)


KEYS = sorted({name for _, _, rows in reference() for name, _, _ in rows})  # every task's, every engine's


# Values YAML reads as other types, and paths that make pathlib raise ("~nobody": unknown user).
ODD_VALUES = st.sampled_from(
    ["~nobody/x", "[~nobody]", "[a, 1]", ".nan", "-.inf", "[]", "{}", "null", "1e400"]
)


@settings(max_examples=300, deadline=1000)
@example("model.path", "~nobody/x", True)  # once a RuntimeError from Path.expanduser
@example("task.train_files", "[~nobody]", True)
@example("rollout.engine", "[~nobody]", True)  # once a TypeError: a list as a registry key
@given(st.sampled_from(KEYS) | st.text(max_size=20), ODD_VALUES | st.text(max_size=30), st.booleans())
def test_overrides_load_or_fail_with_emapg_error(key, value, with_equals):
    try:
        load_config(None, [f"{key}={value}" if with_equals else key])
    except EmapgError as e:
        assert "\n" not in str(e)


@settings(max_examples=50, deadline=1000)
@given(st.integers(-(10**6), 10**6))
def test_integer_override_is_parsed_exactly(k):
    if k < 0:
        with pytest.raises(EmapgError, match="kl.k: input should be greater than or equal to 0"):
            load_config(None, [f"kl.k={k}"])
    else:
        assert load_config(None, [f"kl.k={k}"]).kl.k == k
