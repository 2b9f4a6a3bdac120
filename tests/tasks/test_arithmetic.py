"""The built-in arithmetic task: deterministic data, disjoint splits, a reward that never raises
(a property test: the answer is the first word of any response)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emapg.tasks.arithmetic import ArithmeticTask, exact_match
from emapg.tasks.base import Example


def test_same_seed_same_data_other_seed_other_data() -> None:
    a = ArithmeticTask(seed=1, num_train=300, num_eval=50)
    b = ArithmeticTask(seed=1, num_train=300, num_eval=50)
    c = ArithmeticTask(seed=2, num_train=300, num_eval=50)
    assert a.train_examples() == b.train_examples() and a.eval_examples() == b.eval_examples()
    assert a.train_examples() != c.train_examples()


def test_splits_are_disjoint_and_unique() -> None:
    task = ArithmeticTask(seed=0, num_train=2000, num_eval=500, max_digits=2)
    train = [ex.prompt for ex in task.train_examples()]
    evals = [ex.prompt for ex in task.eval_examples()]
    assert len(train) == 2000 and len(evals) == 500
    assert len(set(train)) == len(train) and len(set(evals)) == len(evals)
    assert not set(train) & set(evals)


def test_eval_set_does_not_move_when_train_grows() -> None:
    small = ArithmeticTask(seed=0, num_train=10, num_eval=40)
    large = ArithmeticTask(seed=0, num_train=1000, num_eval=40)
    assert small.eval_examples() == large.eval_examples()


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_answers_are_correct_and_operands_in_range(op: str) -> None:
    task = ArithmeticTask(seed=0, num_train=500, num_eval=100, min_digits=2, max_digits=3, ops=[op])
    fns = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for ex in task.train_examples() + task.eval_examples():
        a, b = ex.prompt.removesuffix("=").split(op)
        assert 10 <= int(a) <= 999 and 10 <= int(b) <= 999
        assert ex.prompt == f"{int(a)}{op}{int(b)}="
        assert ex.answer == str(fns[op](int(a), int(b)))


def test_digit_counts_are_balanced() -> None:
    task = ArithmeticTask(seed=0, num_train=3000, num_eval=0, min_digits=1, max_digits=3)
    lengths = [len(str(ex.meta["a"])) for ex in task.train_examples()]
    for d in (1, 2, 3):
        assert 0.25 < lengths.count(d) / len(lengths) < 0.42


def test_score_hand_made_cases() -> None:
    task = ArithmeticTask(seed=0, num_train=1, num_eval=1)
    ex = Example("347+85=", "432")
    cases = {
        "432": 1.0,
        " 432 ": 1.0,
        "432\nthe sum": 1.0,  # text after the first whitespace is ignored
        "432<eos>": 1.0,  # a special token left in by the decoder ends the response
        "433": 0.0,
        "4321": 0.0,
        "432abc": 0.0,
        "the answer is 432": 0.0,
        "0432": 0.0,
        "": 0.0,
        "   ": 0.0,
        "<eos>432": 0.0,
        "\x00\uffff€漢字": 0.0,
    }
    for response, want in cases.items():
        assert task.score(response, ex) == want, repr(response)
    assert exact_match(None, "1") == 0.0  # type: ignore[arg-type]
    assert exact_match("-12", "-12") == 1.0


def test_bad_settings_fail_with_a_clear_line() -> None:
    with pytest.raises(ValueError, match="min_digits"):
        ArithmeticTask(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=["/"])
    with pytest.raises(ValueError, match="distinct problems"):
        ArithmeticTask(num_train=100, num_eval=0, max_digits=1)  # only 100 problems exist


WORDS = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=60)


@pytest.mark.slow
@settings(max_examples=300, deadline=200)
@given(st.integers(0, 10**6).map(str), st.sampled_from([" ", "\n", "\t", "<", "<eos>"]), WORDS, WORDS)
def test_arithmetic_answer_is_the_first_word(answer, end, rest, anything):
    assert exact_match(f"  {answer}{end}{rest}", answer) == 1.0
    assert exact_match(f"x{answer}{end}{rest}", answer) == 0.0
    assert exact_match(anything, answer) in (0.0, 1.0)
