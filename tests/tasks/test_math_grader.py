"""emapg.tasks.math_grader.score: hand-written equivalence cases, inputs built to hang or crash it,
and property tests (no input may raise or hang; the last boxed integer is graded right)."""

import random
import string
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify import parse, verify

from emapg.tasks import math_grader
from emapg.tasks.math_grader import MAX_ANSWER_CHARS, _guard, _parse, has_boxed_answer, score

# (response, reference, expected score), each written and judged by hand.
CASES = [
    # fractions, decimals, \dfrac
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    ("\\boxed{\\frac{-2}{3}}", "-\\frac{2}{3}", 1.0),
    ("\\boxed{-\\frac{2}{3}}", "-2/3", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.3333333", 1.0),  # equal to 6 decimals
    ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{3}{2}", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    # thousands separators
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{12,345,678}", "12345678", 1.0),
    # percentages
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50}", "50\\%", 1.0),
    ("\\boxed{0.5}", "50\\%", 1.0),
    # units and text around the number
    ("The answer is \\boxed{18}.", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{18\\text{ cm}^2}", "18", 1.0),
    ("\\boxed{5 apples}", "5", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    # negative numbers
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    # intervals and sets
    ("\\boxed{[1,2)}", "[1,2)", 1.0),
    ("\\boxed{(1,2]}", "[1,2)", 0.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{1, 2}", "2, 1", 1.0),
    # several boxed answers: the last one counts
    ("\\boxed{1} so \\boxed{3}", "3", 1.0),
    ("\\boxed{3} so \\boxed{1}", "3", 0.0),
    # nested braces, and a reference given as a boxed solution (the MATH schema)
    ("\\boxed{\\boxed{5}}", "5", 1.0),
    ("\\boxed{5}", "We add them: \\boxed{5}.", 1.0),
    ("\\boxed{\\frac{\\frac{1}{2}}{2}}", "\\frac{1}{4}", 1.0),
    # algebraic equivalence, constants, letters
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{2\\pi}", "2 \\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{\\text{(A)}}", "A", 1.0),
    # no answer
    ("The answer is 5.", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{5", "5", 0.0),
]


@pytest.mark.parametrize("response,reference,expected", CASES)
def test_equivalence_cases(response, reference, expected):
    assert score(response, reference) == expected


# Ordinary answers the size guard once refused; each is graded as plain math-verify grades it.
# (boxed answer, reference, expected score)
EXPONENTS = [  # decimal or symbolic exponents
    ("4^{0.5}", "2", 1.0),
    ("x^{2.5}", "x^{5/2}", 1.0),
    ("9^{1.5}", "27", 1.0),
    ("10^{1.5}", "31.6227766", 1.0),
    ("10^{-2.5}", "0.00316227766", 1.0),
    ("2^{-0.5}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("x^{0.5}", "\\sqrt{x}", 1.0),
    ("0.5^{n}", "2^{-n}", 1.0),
    ("x^{n+1}", "x \\cdot x^{n}", 1.0),
    ("2^{n+1}", "2 \\cdot 2^{n}", 1.0),
    ("2^{2n}", "4^{n}", 1.0),
    ("x^{a+b}", "x^a x^b", 1.0),
    ("e^{i \\pi}", "e^{\\pi i}", 1.0),
    ("a^{b}", "a^b", 1.0),
    ("x^{n+1}", "x^{n}", 0.0),
    ("10^{0.3010}", "2", 0.0),  # 1.99986...
    ("e^{0.5x}", "e^{x/2}", 0.0),  # math-verify does not equate the decimal with the fraction
]


SYMBOLIC_SUMS = [  # sums and products whose bounds are symbols
    ("\\sum_{k=1}^{n} k", "\\frac{n(n+1)}{2}", 1.0),
    ("\\sum_{k=1}^{n} k^2", "\\frac{n(n+1)(2n+1)}{6}", 1.0),
    ("\\sum_{k=1}^{n} k^3", "\\left(\\frac{n(n+1)}{2}\\right)^2", 1.0),
    ("\\sum_{k=0}^{n} 2^k", "2^{n+1}-1", 1.0),
    ("\\sum_{k=1}^{n} (2k-1)", "n^2", 1.0),
    ("\\sum_{k=1}^{2n} k", "n(2n+1)", 1.0),
    ("\\sum_{k=n}^{n+5} k", "6n+15", 1.0),  # symbolic bounds, six terms
    ("\\sum_{k=m}^{n} 1", "n-m+1", 1.0),
    ("\\sum_{k=1}^{n} x", "n x", 1.0),
    ("\\prod_{k=1}^{n} 2", "2^n", 1.0),
    ("\\sum_{k=1}^{n} k", "\\frac{n^2}{2}", 0.0),
    ("\\prod_{i=1}^{m} i", "m!", 0.0),  # SymPy leaves the product unevaluated
    ("\\prod_{k=1}^{n} \\frac{k+1}{k}", "n+1", 0.0),
]


POLYNOMIALS = [  # powers and products of sums, and nesting, within the multiplied-out and depth limits
    ("(x+1)^{10}", "(1+x)^{10}", 1.0),
    ("(a+b)^{2}", "a^2+2ab+b^2", 1.0),
    (
        "(x+1)(x+2)(x+3)(x+4)(x+5)(x+6)(x+7)(x+8)(x+9)(x+10)",  # 2^10 products, 11 terms
        "(x+10)(x+9)(x+8)(x+7)(x+6)(x+5)(x+4)(x+3)(x+2)(x+1)",
        1.0,
    ),
    ("\\left(\\left(x+1\\right)^{2}+1\\right)^{2}", "(x^2+2x+2)^2", 1.0),
    ("\\frac{1}{1+\\frac{1}{1+\\frac{1}{1+\\frac{1}{2}}}}", "\\frac{5}{8}", 1.0),  # nested 5 deep
    ("(a+b+c)^{3}", "(a+b+c)^{2}", 0.0),
]


def _plain_math_verify(answer: str, reference: str) -> float:
    return float(verify(parse(f"\\boxed{{{reference}}}"), parse(f"\\boxed{{{answer}}}")))


@pytest.mark.parametrize("answer,reference,expected", EXPONENTS + SYMBOLIC_SUMS + POLYNOMIALS)
def test_ordinary_answers_grade_as_plain_math_verify(answer, reference, expected, monkeypatch):
    # math-verify's default time limits on both sides: on a busy machine 1 s may cut one short
    monkeypatch.setattr(math_grader, "TIME_LIMIT_S", 5)
    assert not any(_guard(e) for e in _parse(f"\\boxed{{{answer}}}") + _parse(f"\\boxed{{{reference}}}"))
    assert score(f"so \\boxed{{{answer}}}.", reference) == expected == _plain_math_verify(answer, reference)


ROOTS = "The roots are $\\boxed{2}$ and $\\boxed{3}$."


# A reference with several boxed answers is all of them, as one list (math-verify: a set).
SEVERAL_BOXED = [
    ("\\boxed{3}", ROOTS, 0.0),  # only the last one
    ("\\boxed{2}", ROOTS, 0.0),
    ("\\boxed{2} and \\boxed{3}", ROOTS, 1.0),  # boxes joined by "and": one list
    ("\\boxed{2} so \\boxed{3}", ROOTS, 0.0),  # prose between them: the last box alone
    ("\\boxed{2, 3, 4}", ROOTS, 0.0),
    ("\\boxed{2, 3}", ROOTS, 1.0),
    ("\\boxed{3, 2}", ROOTS, 1.0),
    ("\\boxed{\\{2, 3\\}}", ROOTS, 1.0),
    ("\\boxed{(2, 3)}", ROOTS, 1.0),
    ("\\boxed{x=2, x=3}", ROOTS, 1.0),
    ("\\boxed{2 \\text{ and } 3}", ROOTS, 1.0),
    ("\\boxed{0.5, -1}", "\\boxed{\\frac{1}{2}} and \\boxed{-1}", 1.0),
    ("\\boxed{(1, 2)}", "$x=\\boxed{1}$, $y=\\boxed{2}$", 1.0),
    ("\\boxed{[1,2), (3,4]}", "\\boxed{[1,2)} or \\boxed{(3,4]}", 1.0),
    ("\\boxed{5}", "So \\boxed{5}, that is \\boxed{ 5 }.", 1.0),  # the same answer twice is one
    ("\\boxed{5}", "\\boxed{\\boxed{5}}", 1.0),  # a box inside a box is one answer
    ("\\boxed{5}", "\\boxed{5 and \\boxed{5}", 1.0),  # a box that never closes is skipped
    ("\\boxed{1}", "".join(f"\\boxed{{{i}}}" for i in range(1, 30)), 0.0),  # too many boxes
]


# Only the text after the last </think> is graded; without one, the whole response.
THINK = [
    ("<think>so 5</think>The answer is \\boxed{5}.", "5", 1.0),
    ("<think>\\boxed{5}</think> so \\boxed{4}", "5", 0.0),
    ("<think>\\boxed{5}</think> so \\boxed{4}", "4", 1.0),
    ("<think>\\boxed{5}</think> and no answer", "5", 0.0),  # a box in the reasoning does not count
    ("\\boxed{5}</think>", "5", 0.0),
    ("\\boxed{5}</think>\n\n", "5", 0.0),
    ("<think>a</think>b</think>\\boxed{5}", "5", 1.0),  # the last </think>
    ("<think>a</think>\\boxed{5}</think>done", "5", 0.0),
    ("<think>\\boxed{5} never closed", "5", 1.0),  # no </think>: the whole response
    ("no think at all: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>long reasoning</think>\n**Answer**: $\\boxed{2, 3}$", ROOTS, 1.0),
]


@pytest.mark.parametrize("response,reference,expected", SEVERAL_BOXED + THINK)
def test_several_boxed_references_and_think_blocks(response, reference, expected):
    assert score(response, reference) == expected


def test_format_reward_looks_after_think_too():
    assert has_boxed_answer("<think>\\boxed{1}</think> it is \\boxed{7}")
    assert not has_boxed_answer("<think>\\boxed{1}</think> it is 7")
    assert has_boxed_answer("<think>still thinking \\boxed{1}")


def _garbage(n: int) -> str:
    return "".join(random.Random(0).choice(string.printable) for _ in range(n))


# Inputs that make an unguarded SymPy compute for hours or recurse without end.
ADVERSARIAL = [
    ("\\boxed{2^{10^{100}}}", "2", 0.0),  # 10^100-digit number
    ("\\boxed{2^{10^{100}}}", "2^{10^{100}}", 1.0),  # written exactly as the reference
    ("\\boxed{9^{9^{9}}}", "1", 0.0),
    ("\\boxed{999999^{999999}}", "1", 0.0),
    ("\\boxed{(10^{7})!}", "5", 0.0),
    ("\\boxed{\\binom{10^{9}}{10^{8}}}", "3", 0.0),
    ("\\boxed{10^{-10^{10}}}", "0", 0.0),
    ("\\boxed{e^{e^{e^{100}}}}", "1", 0.0),
    ("\\boxed{\\sum_{i=1}^{10^{9}} i!}", "5", 0.0),  # a billion terms
    ("\\boxed{\\prod_{i=1}^{10^{7}} i}", "5", 0.0),
    ("\\boxed{\\sum_{i=1}^{100} i}", "5050", 1.0),  # a short sum is still graded
    ("\\boxed{5}", "2^{10^{100}}", 0.0),  # an absurd reference is refused as well
    ("\\boxed{" + "{" * 3000 + "5" + "}" * 3000 + "}", "5", 0.0),  # deeply nested braces
    ("{" * 5000 + " so \\boxed{5}", "5", 1.0),  # garbage before a good answer
    ("\\boxed{" * 20000, "5", 0.0),
    (_garbage(100_000), "5", 0.0),  # 100 kB of garbage
    (_garbage(100_000) + "\\boxed{5}", "5", 1.0),
    ("\\boxed{5" + "x" * 100_000, "5", 0.0),
    ("x" * 100_000, "5", 0.0),
    # decimal and symbolic exponents, symbolic sums: still refused when provably huge
    ("\\boxed{10^{10^{5.5}}}", "1", 0.0),  # a 316228-digit number
    ("\\boxed{10^{99999.5}}", "1", 0.0),
    ("\\boxed{1.5^{10^{7}}}", "1", 0.0),
    ("\\boxed{e^{10^{6.5}}}", "1", 0.0),
    ("\\boxed{(10^{5.5})!}", "1", 0.0),
    ("\\boxed{\\binom{10^{5.5}}{3}}", "1", 0.0),
    ("\\boxed{2^{10^{100} x}}", "1", 0.0),  # a symbol does not hide the number
    ("\\boxed{x^{10^{100}}}", "x", 0.0),
    ("\\boxed{\\sum_{k=1}^{n} k^{1000}}", "1", 0.0),  # a closed form of degree 1001
    ("\\boxed{\\prod_{k=1}^{n} k^{10^{9}}}", "1", 0.0),
    ("\\boxed{\\sum_{k=n}^{n+10^{4}} k!}", "1", 0.0),  # symbolic bounds, 10001 terms
    ("\\boxed{\\prod_{k=n}^{n+10^{6}} k}", "1", 0.0),
    ("\\boxed{\\sum_{k=1}^{n+10^{9}} k}", "1", 0.0),
    ("\\boxed{\\sum_{k=1}^{10^{9}} k}", "1", 0.0),
    ("\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "1", 0.0),
    # off the main thread these took 110 s and over 120 s before the nesting and expansion guards
    ("\\boxed{" + "{" * 19 + "1" + "}" * 19 + "}", "1", 0.0),
    ("\\boxed{(a+b+c+d)^{60}}", "1", 0.0),  # 39,711 terms multiplied out
    ("\\boxed{" + "(" * 30 + "1" + ")" * 30 + "}", "1", 0.0),
    ("\\boxed{\\sin((a+b+c+d)^{60})}", "1", 0.0),
    ("\\boxed{(" + ", ".join(f"x_{{{i}}}" for i in range(100)) + ")}", "1", 0.0),  # only the time limit
]


# The bound is 2 s a response. 10 s leaves a loaded test machine room while still failing
# on the hangs these cases caused (110 s, over 120 s): a case is cut at TIME_LIMIT_S, 1 s.
LIMIT_S = 10.0


def _in_thread(where: str, fn):
    """fn() in the main thread or a worker one (where math-verify's signal timeouts cannot work,
    as in a reward function called from a thread pool); None if it has not returned in LIMIT_S."""
    if where == "main thread":
        return fn()
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)  # a hang must not block exit
    thread.start()
    thread.join(timeout=LIMIT_S)
    return result[0] if result else None


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
@pytest.mark.parametrize("response,reference,expected", ADVERSARIAL, ids=lambda v: repr(v)[:30])
def test_adversarial_inputs_are_graded_within_the_limit_in_any_thread(response, reference, expected, where):
    start = time.perf_counter()
    assert _in_thread(where, lambda: score(response, reference)) == expected
    assert time.perf_counter() - start < LIMIT_S


def test_the_time_limit_stops_python_in_a_worker_thread():
    def spin():
        try:
            with math_grader._time_limit(0.1):
                while True:
                    pass
        except math_grader.OutOfTime:
            return "stopped"

    assert _in_thread("worker thread", spin) == "stopped"


@pytest.mark.slow
def test_the_time_limit_never_fires_past_its_block():
    """Blocks that end about when their limit passes: OutOfTime is raised inside the `with`
    statement or not at all, never in the code after it."""

    def run() -> tuple[int, int]:
        stopped = leaked = 0
        for i in range(200):
            ended = False
            try:
                with math_grader._time_limit(0.001):
                    sum(range(5000 * i))  # from well under the limit to well over it (~10 ms)
                ended = True
                sum(range(20_000))
            except math_grader.OutOfTime:
                stopped += not ended
                leaked += ended
        return stopped, leaked

    stopped, leaked = _in_thread("worker thread", run)
    assert leaked == 0 and stopped > 0


def test_safe_off_the_main_thread():
    """math-verify's signal timeouts only work in the main thread: the guards must hold anyway."""
    results = []

    def work():
        results.extend(
            score(r, g)
            for r, g in [
                ("\\boxed{0.5}", "\\frac{1}{2}"),
                ("\\boxed{2^{10^{100}}}", "2"),
                ("\\boxed{\\sum_{i=1}^{10^{9}} i!}", "5"),
            ]
        )

    thread = threading.Thread(target=work, daemon=True)  # a hang must not block pytest's exit
    thread.start()
    thread.join(timeout=LIMIT_S)
    assert results == [1.0, 0.0, 0.0]  # all three scored before the limit: none hung


def test_bad_types_score_zero():
    assert score(None, "5") == 0.0
    assert score("\\boxed{5}", None) == 0.0


def test_only_the_tail_of_the_last_boxed_is_read():
    # The answer region ends MAX_ANSWER_CHARS after "\boxed": a longer answer never closes.
    assert score("\\boxed{" + "1" * (MAX_ANSWER_CHARS - 9) + "}", "1" * (MAX_ANSWER_CHARS - 9)) == 1.0
    assert score("\\boxed{" + " " * MAX_ANSWER_CHARS + "5}", "5") == 0.0


def test_has_boxed_answer():
    assert has_boxed_answer("so \\boxed{7}.")
    assert has_boxed_answer("\\boxed{}")
    assert not has_boxed_answer("\\boxed{7")
    assert not has_boxed_answer("7")


@pytest.mark.parametrize(
    "response,reference,guard",
    [
        ("\\boxed{2^{10^{100}}}", "2", "digits"),
        ("\\boxed{x^{10^{100}}}", "x", "digits"),
        ("\\boxed{5}", "(10^{7})!", "digits"),  # the reference is guarded too
        ("\\boxed{\\sum_{i=1}^{10^{9}} i}", "5", "terms"),
        ("\\boxed{(a+b+c+d)^{60}}", "1", "terms"),  # multiplied out
        ("\\boxed{(a+b+c)^{3}}", "1", None),
        ("\\boxed{" + "{" * 30 + "5" + "}" * 30 + "}", "5", "nesting"),
        ("\\boxed{" + "(" * 8 + "5" + ")" * 8 + "}", "5", "nesting"),  # parentheses count too
        ("\\boxed{" + ")" * 20 + "(" * 9 + "5}", "5", "nesting"),  # stray closers make no room
        ("\\boxed{[1, 2) \\cup ((3, 4] \\cup [5, 6))}", "1", None),  # an interval closes as it opens
        ("\\boxed{1}", "".join(f"\\boxed{{{i}}}" for i in range(1, 30)), "boxes"),
        ("\\boxed{" + "1" * MAX_ANSWER_CHARS + "}", "1", "length"),
        ("\\boxed{e^{-x^2}}", "\\exp(-x^2)", None),
        ("\\boxed{5}", "6", None),  # compared, and wrong: not a refusal
        ("no box", "6", None),
    ],
)
def test_refusal_names_the_guard(response, reference, guard):
    assert math_grader.refusal(response, reference) == guard
    assert guard is None or guard in math_grader.GUARDS


def test_refusal_names_the_time_limit(monkeypatch):
    def parse_forever(text):  # a parse that only the time limit ends: no bet on how fast a CPU parses
        while True:
            pass

    monkeypatch.setattr(math_grader, "TIME_LIMIT_S", 0.05)
    monkeypatch.setattr(math_grader, "_parse_cached", parse_forever)
    assert math_grader.refusal("\\boxed{x+1}", "\\boxed{1}") == "time"


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


@pytest.mark.slow
@HANG
@given(LATEX | st.text(max_size=200), LATEX | st.text(max_size=30))
def test_boxed_grading_never_raises_and_is_zero_or_one(response, reference):
    assert score(response, reference) in (0.0, 1.0)
    assert has_boxed_answer(response) in (True, False)


@pytest.mark.slow
@HANG
@given(st.integers(-(10**12), 10**12), st.text(max_size=50), st.sampled_from(["", " ", "\n"]))
def test_the_last_boxed_integer_is_graded_right(n, before, space):
    assert score(f"{before} \\boxed{{{n + 1}}} then \\boxed{{{space}{n}{space}}}", str(n)) == 1.0
    assert score(f"{before} \\boxed{{{n}}} then \\boxed{{{n + 1}}}", str(n)) == 0.0


def test_deadlines_that_fall_as_blocks_end_neither_deadlock_nor_escape():
    """Four threads run blocks whose deadlines (1 ms to 1 us) fall as the blocks end, for 2 s.
    The watchdog's lock was a Condition, whose Python-level __enter__ could take an OutOfTime
    just after acquiring it: the lock stayed held and every later grade hung (three of four
    threads stuck within 5 s here, and the full suite hung in a grader test). No thread may
    hang, and no OutOfTime may escape past its block."""
    stop, escaped = threading.Event(), []

    def work():
        i = 0
        try:
            while not stop.is_set():
                try:
                    with math_grader._time_limit(10.0 ** -(3 + i % 4)):
                        sum(range(200 * (i % 7)))
                except math_grader.OutOfTime:
                    pass
                i += 1
        except math_grader.OutOfTime:
            escaped.append(i)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(4)]  # a hang must not block exit
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=LIMIT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert escaped == []
