"""Grading of math answers: the last `\\boxed{}` of a response against a reference, by math-verify.

math-verify (with latex2sympy2-extended) parses both sides into SymPy and decides equivalence
(fractions vs decimals, `\\dfrac`, thousands separators, percentages, units, intervals, ...).
Being SymPy, it can be made to compute without end: `2^{10^{100}}` asks for a number with
10^100 digits, a C-level big-integer computation that no signal can interrupt. So `score`
never hands math-verify anything it cannot finish quickly:

0. what is graded (`final_answer`, `reference_boxed`): of a response, after its last `</think>`
   (the whole response without one), its last boxed answer together with the boxes just before
   it that only separators divide from it (commas, "and", "or", `\\quad`, `$`, `\\text{ and }`:
   `\\boxed{2} and \\boxed{3}` is the list 2, 3, which math-verify compares as a set; prose ends
   the list: `\\boxed{1} so \\boxed{3}` is 3; a `\\text{}` note inside the math and a label such
   as `y_2 =` do not). A reference is a plain answer, or a solution whose distinct boxed answers
   are all its answers, as one list (a solution boxes what it proves, wherever it stands). An
   answer that is not boxed is not read (Minerva's "The final answer is $10,455$. I hope it is
   correct." is graded by its last box, if any).
   Both sides: a decimal exponent is the exact fraction it writes (`2^{0.5}` is `2^{1/2}`), so
   neither order of a pair grades differently from the other.
1. size ("length", "boxes", "nesting"): only the text from a `\\boxed` on, at most MAX_ANSWER_CHARS
   of it, is read, and a list of boxes is at most as long (a longer answer never closes); a
   reference has at most MAX_REFERENCE_BOXES boxes. Brackets (braces, parentheses, square
   brackets) nested deeper than MAX_NESTING are refused: the LaTeX parser's time, and for
   braces (nested sets) the comparison's, grow about 1.5-2x with each level (braces 19 deep
   took 110 s), while real answers nest a few levels (at most 4, the box's own brace included,
   in math-verify's 266 cases).
2. magnitude ("digits", "terms"): parsing does not evaluate (`2^{10^{100}}` stays a Pow tree), so
   before the comparison, which does evaluate, both trees are checked: a number, power or
   factorial whose value would have more than MAX_DIGITS digits is refused (`2^{10^{100}}`,
   `(10^{7})!`, `x^{10^{100}}`), and so is a sum or product of more than MAX_TERMS terms, written
   (`\\sum_{i=1}^{10^{9}} i`) or multiplied out: SymPy's simplification expands, and
   `(a+b+c+d)^{60}` is a sum of 39,711 terms (over 120 s), so an integer power of a sum counts
   its multinomial terms and a product multiplies its factors' terms. The bound is on values,
   not on how an expression is written: a decimal counts the digits of its magnitude
   (`2^{0.5}` passes), a symbolic exponent (`e^{-x^2}`, `2^{n(n+1)/2}`) only the numbers in it
   (`2^{10^{100} x}` is refused), and a sum or product over a symbolic range
   (`\\sum_{k=1}^{n} k`), which SymPy never expands, passes when its term is at most
   MAX_SYMBOLIC_TERM_DIGITS digits.
3. time ("time"): parsing and comparing one pair stop at TIME_LIMIT_S, in whatever thread `score`
   runs. math-verify's own limits use signal.alarm, which only works in the main thread, and a
   reward function called from a thread pool (as TRL's are) would have none; so math-verify runs
   without them and `_time_limit` raises in the grading thread itself (the interpreter's
   asynchronous exception, which like a signal handler interrupts Python code, not one C call:
   steps 1-2 keep those short). This bounds what no rule foresees (a 100-element tuple takes
   seconds to parse). Training also runs `score` in a worker process with a hard time limit
   (emapg.tasks.rewards), since MathTask does not claim to be safe.

Refused or failing inputs score 0, except a boxed answer written exactly as the reference;
`refusal` names the guard (GUARDS) that refused a pair.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import queue
import re
import threading
import time

import sympy
from math_verify import LatexExtractionConfig, parse, verify

from emapg.tasks.math_data import BOXED

THINK_END = "</think>"  # R1-style reasoning ends here; only what follows is graded
MAX_ANSWER_CHARS = 1000  # from "\boxed" on; real answers are far shorter
MAX_NESTING = 8  # of brackets, the box's own brace included
MAX_REFERENCE_BOXES = 20  # a solution boxes one answer, or a few
MAX_DIGITS = 10_000  # of any number the comparison may compute
MAX_TERMS = 1000  # of a sum or product the comparison may expand, or multiply out
MAX_SYMBOLIC_TERM_DIGITS = 50  # of the term of a sum or product over k = 1..n (its closed form)
TIME_LIMIT_S = 1.0  # to parse and compare one pair

GUARDS = {  # what `refusal` returns, each a class of answer the grader will not compare
    "length": f"a boxed answer (or list of them) longer than MAX_ANSWER_CHARS = {MAX_ANSWER_CHARS} characters",
    "boxes": f"a reference with more than MAX_REFERENCE_BOXES = {MAX_REFERENCE_BOXES} boxed answers",
    "nesting": f"brackets ({{ ( [) nested deeper than MAX_NESTING = {MAX_NESTING}",
    "digits": f"a number with more than MAX_DIGITS = {MAX_DIGITS} digits, e.g. 2^{{10^{{100}}}}",
    "terms": f"a sum or product of more than MAX_TERMS = {MAX_TERMS} terms, written or multiplied out",
    "time": f"parsing takes longer than TIME_LIMIT_S = {TIME_LIMIT_S:g} s (comparing has the same limit)",
}
# What may divide the boxes of one final answer: whitespace, punctuation, math delimiters, LaTeX
# spacing and line breaks, the words "and" / "or", a \text{} note inside the math, and a label
# (`y_2 =`) before the next box.
SEPARATOR = re.compile(
    r"(?:\s|[,;.&~$]|\\[()\[\]]|\\\\|\\[,;:! ]|\\q?quad|\\(?:text|textrm|mbox|mathrm)\{[^{}]*\}"
    r"|\band\b|\bor\b|\b[a-z](?:_\{?\w+\}?)?\s*=)*",
    re.IGNORECASE,
)
_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0)]
# math-verify logs every parse failure and timeout; a policy produces thousands of those.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)


def score(response: str, reference: str) -> float:
    """1.0 when the final boxed answer of `response` (`final_answer`) equals `reference`, else 0.0.

    `reference` is the answer itself ("\\frac{1}{2}", "18", "[1, 2)"), or a text whose boxed
    answer is the reference (a MATH solution; several boxed answers are one list). Never raises;
    see the module doc for why it always returns quickly.
    """
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    answer, gold_text = final_answer(response), reference_boxed(reference)
    if answer is None or gold_text is None:
        return 0.0
    written = _content(answer)
    if written is not None and written == _content(gold_text):  # the one way a refused answer scores
        return 1.0
    if not (_shallow(answer) and _shallow(gold_text)):
        return 0.0
    try:
        with _time_limit(TIME_LIMIT_S):
            gold, pred = _parse(gold_text), _parse(answer)
            if not gold or not pred or any(_guard(e) for e in gold + pred):
                return 0.0
            return 1.0 if verify(_exact(gold), _exact(pred), timeout_seconds=None) else 0.0
    except (Exception, OutOfTime):  # math-verify swallows its own errors; this is for what it cannot
        return 0.0


def refusal(response: str, reference: str) -> str | None:
    """The guard (a key of GUARDS) that keeps `score` from comparing this pair, or None when it
    compares them (or has no boxed answer to compare)."""
    if not isinstance(response, str) or not isinstance(reference, str):
        return None
    if reference.count(BOXED) > MAX_REFERENCE_BOXES:
        return "boxes"
    answer, gold_text = final_answer(response), reference_boxed(reference)
    if answer is None or gold_text is None:
        too_long = answer is None and last_boxed(final_part(response)) is not None
        return "length" if too_long or (gold_text is None and BOXED in reference) else None
    if _content(answer) is None:  # the last box does not close within MAX_ANSWER_CHARS: does it ever?
        text = final_part(response)
        return "length" if _box_end(text[text.rfind(BOXED) :]) is not None else None
    if not (_shallow(answer) and _shallow(gold_text)):
        return "nesting"
    try:
        with _time_limit(TIME_LIMIT_S):
            return next((why for e in _parse(gold_text) + _parse(answer) if (why := _guard(e))), None)
    except OutOfTime:
        return "time"


def final_answer(response: str) -> str | None:
    """What is graded of a response, as one boxed answer: `boxed_list` of its text after its last
    `</think>` (`\\boxed{2} and \\boxed{3}` gives `\\boxed{2, 3}`)."""
    return boxed_list(final_part(response))


def boxed_list(text: str) -> str | None:
    """The last `\\boxed{}` of `text` and the boxes before it that only SEPARATOR text divides from
    it, their distinct contents as one boxed list. A last box that never closes is returned as it
    is (it will not parse); None without a box, or when the list is longer than MAX_ANSWER_CHARS."""
    contents: list[str] = []  # last box first
    first = end = len(text)  # `first`: where the earliest box of the list starts
    while len(contents) < MAX_REFERENCE_BOXES:
        start = text.rfind(BOXED, 0, end)
        if start < 0:
            break
        close = _box_end(text[start : start + MAX_ANSWER_CHARS])
        if close is None:  # never closes: the list ends here (the last box: nothing to grade)
            if not contents:
                return last_boxed(text)
            break
        inside = text[start + len(BOXED) + 1 : start + close].strip()
        if contents and start + close >= first:  # encloses the box found before: it is that answer
            contents[-1] = inside
        elif contents and not SEPARATOR.fullmatch(text[start + close + 1 : first]):
            break
        else:
            contents.append(inside)
        first, end = start, start
    if not contents:
        return None
    distinct: dict[str, str] = {}  # whitespace-free form -> the first written form, in order
    for inside in reversed(contents):
        distinct.setdefault("".join(inside.split()), inside)
    joined = ", ".join(distinct.values())
    return f"{BOXED}{{{joined}}}" if len(joined) <= MAX_ANSWER_CHARS - len(BOXED) - 2 else None


def final_part(response: str) -> str:
    """What is graded of a response: the text after its last `</think>`, or all of it without
    one (as rLLM grades R1-style reasoning; a boxed answer inside the reasoning does not count)."""
    return response.rpartition(THINK_END)[2]


def last_boxed(text: str) -> str | None:
    """The text from the last `\\boxed` on, at most MAX_ANSWER_CHARS; None without one."""
    start = text.rfind(BOXED)
    return None if start < 0 else text[start : start + MAX_ANSWER_CHARS]


def reference_boxed(reference: str) -> str | None:
    """The reference as one boxed answer: a plain answer boxed; the boxed answer of a solution;
    the distinct boxed answers of a solution that has several, as one list (`\\boxed{2}` and
    `\\boxed{3}` give `\\boxed{2, 3}`, which math-verify compares as a set), so that a
    response naming only one of them is wrong. None (every response is wrong) when the list is
    longer than a boxed answer may be, or the reference has over MAX_REFERENCE_BOXES boxes."""
    if BOXED not in reference:
        return f"{BOXED}{{{reference.strip()}}}"
    if reference.count(BOXED) > MAX_REFERENCE_BOXES:
        return None
    answers: dict[str, str] = {}  # whitespace-free form -> the first written form
    start = reference.find(BOXED)
    while start >= 0:
        end = _box_end(reference[start : start + MAX_ANSWER_CHARS])
        if end is None:  # never closes: the next \boxed may be inside it
            start = reference.find(BOXED, start + len(BOXED))
            continue
        inside = reference[start + len(BOXED) + 1 : start + end].strip()
        answers.setdefault("".join(inside.split()), inside)
        start = reference.find(BOXED, start + end)  # a \boxed nested in this one is part of it
    if not answers:  # no box closes: the last one, which will not parse
        return last_boxed(reference)
    joined = ", ".join(answers.values())
    return f"{BOXED}{{{joined}}}" if len(joined) <= MAX_ANSWER_CHARS - len(BOXED) - 2 else None


def has_boxed_answer(response: str) -> bool:
    """Whether the response ends its work with a `\\boxed{...}` that closes (format reward),
    after its last `</think>` when it has one."""
    answer = last_boxed(final_part(response)) if isinstance(response, str) else None
    return answer is not None and _content(answer) is not None


def _box_end(boxed: str) -> int | None:
    """Index of the brace that closes `\\boxed{...}`; None when it never closes."""
    if not boxed.startswith(BOXED + "{"):
        return None
    depth = 0
    for i, c in enumerate(boxed):
        depth += (c == "{") - (c == "}")
        if depth == 0 and c == "}":
            return i
    return None


def _content(boxed: str) -> str | None:
    """What `\\boxed{...}` holds, whitespace removed; None when its braces never close."""
    end = _box_end(boxed)
    return None if end is None else "".join(boxed[len(BOXED) + 1 : end].split())


def _shallow(text: str) -> bool:
    """Whether no bracket is nested deeper than MAX_NESTING, counting braces, parentheses and
    square brackets alike (an interval closes `(1, 2]`); a stray closing bracket makes no room."""
    depth = deepest = 0
    for c in text:
        if c in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "})]":
            depth = max(depth - 1, 0)
    return deepest <= MAX_NESTING


@functools.lru_cache(maxsize=4096)  # a reference is parsed once per group, not once per response
def _parse_cached(text: str) -> tuple:
    return tuple(parse(text, _EXTRACTION, parsing_timeout=None))  # _time_limit bounds it


def _parse(text: str) -> list:
    try:
        return list(_parse_cached(text))
    except Exception:  # not OutOfTime: that ends the whole pair
        return []


class OutOfTime(BaseException):
    """Raised in a grading thread at its time limit. A BaseException, as math-verify's own
    timeout is, so that the `except Exception` of math-verify and SymPy lets it through."""


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_deadlines: dict[int, float] = {}  # grading thread -> its time.monotonic() deadline
_fired: set[int] = set()  # grading threads sent OutOfTime, until their block ends
# A plain lock, not a Condition: `with` on it acquires in C, so an OutOfTime arriving then lands
# inside the block, whose exit releases it. A Condition's Python-level __enter__ could take the
# exception just after acquiring, and the lock stayed held: every later grade deadlocked.
_lock = threading.Lock()
_wake: queue.SimpleQueue = queue.SimpleQueue()  # C-level put, for the same reason
_watchdog: threading.Thread | None = None


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise OutOfTime in this thread once `seconds` have passed inside the block.

    Any thread, unlike signal.alarm: one watchdog thread asks the interpreter to raise the
    exception in the late thread (PyThreadState_SetAsyncExc), which happens at its next
    bytecode, as a signal handler's would. One thread for all calls, not a timer each: starting
    a thread costs more than grading an integer. The watchdog fires only under the lock, and an
    exception sent as the block ends is taken back under it, so it does not escape the block
    (one that lands before that is an OutOfTime of the block, as the deadline had passed)."""
    global _watchdog
    me = threading.get_ident()
    with _lock:
        if _watchdog is None or not _watchdog.is_alive():  # the first call, or after a fork
            _watchdog = threading.Thread(target=_watch_deadlines, name="math-grader-watchdog", daemon=True)
            _watchdog.start()
        _fired.discard(me)
        _deadlines[me] = deadline = time.monotonic() + seconds
        earliest = deadline <= min(_deadlines.values())
    if earliest:  # the watchdog may be waiting for a later one
        _wake.put(None)
    try:
        yield
    finally:
        with _lock:
            _deadlines.pop(me, None)
            if me in _fired:  # raised already, or pending: then dropped here
                _fired.discard(me)
                _set_async_exc(ctypes.c_ulong(me), None)


def _watch_deadlines() -> None:
    while True:
        with _lock:
            now = time.monotonic()
            for thread, deadline in list(_deadlines.items()):
                if deadline <= now:
                    del _deadlines[thread]  # one exception per block
                    _fired.add(thread)
                    _set_async_exc(ctypes.c_ulong(thread), ctypes.py_object(OutOfTime))
            wait = min(_deadlines.values(), default=now + 60) - now
        with contextlib.suppress(queue.Empty):
            _wake.get(timeout=wait)


def _guard(expr) -> str | None:
    """The GUARDS key that refuses evaluating `expr` (a parsed answer: SymPy or a fallback
    string), or None when it stays small."""
    if isinstance(expr, sympy.MatrixBase):
        return next((why for e in expr if (why := _guard(e))), None)
    if not isinstance(expr, sympy.Basic):
        return None if isinstance(expr, str) else "digits"
    try:
        if any(_terms(node.limits) == math.inf for node in expr.atoms(sympy.Sum, sympy.Product)):
            return "terms"
        if _digits(expr) > MAX_DIGITS:
            return "digits"
        # past the digits guard every numeric exponent is small enough to evaluate
        return "terms" if _expanded_terms(expr) > MAX_TERMS else None
    except Exception:  # RecursionError on a deep tree, or a node _digits cannot size
        return "digits"


def _exact(parsed: list) -> list:
    """Each parsed answer with its decimal exponents as the fractions they write (`2^{0.5}` is
    `2^{1/2}`): math-verify compares a float power only one way round."""
    return [
        e.replace(
            lambda x: isinstance(x, sympy.Pow) and isinstance(x.exp, sympy.Float),
            lambda x: sympy.Pow(x.base, sympy.Rational(str(x.exp))),
        )
        if isinstance(e, sympy.Basic)
        else e
        for e in parsed
    ]


def _digits(expr: sympy.Basic) -> float:
    """An upper bound on the decimal digits of any number that evaluating `expr` computes.

    Symbols and other non-numbers count as 1 digit: what matters is the numbers they meet.
    """
    if isinstance(expr, sympy.Integer):
        return expr.p.bit_length() * math.log10(2) + 1
    if isinstance(expr, sympy.Rational):
        return max(_digits(sympy.Integer(expr.p)), _digits(sympy.Integer(expr.q)))
    if isinstance(expr, sympy.Float):  # fixed precision: only its magnitude can grow
        return _float_digits(expr)
    if isinstance(expr, sympy.Pow | sympy.exp):
        base, exponent = expr.as_base_exp()
        return _power_digits(_digits(base), exponent)
    if isinstance(expr, sympy.factorial | sympy.gamma | sympy.binomial):
        n = expr.args[0]
        size = _digits(n)
        if size > 5:  # n! for n >= 10^5 has more than 450000 digits
            return math.inf
        value = abs(float(n)) if n.is_number else 1.0
        return max(size, value * math.log10(max(value, 2.0)) + 1)
    if isinstance(expr, sympy.Sum | sympy.Product):
        terms = _terms(expr.limits)
        body = _digits(expr.function)
        if terms is None:  # a symbolic number of terms: never expanded, only closed forms
            return body + 1 if body <= MAX_SYMBOLIC_TERM_DIGITS else math.inf
        return terms * body if isinstance(expr, sympy.Product) else body + math.log10(terms) + 1
    if not expr.args:  # a symbol or constant (x, pi, e, i, oo): no number of its own
        return 1.0
    children = [_digits(a) for a in expr.args]
    if isinstance(expr, sympy.Mul):
        return sum(children)
    return max(children) + 1


def _float_digits(x: sympy.Float) -> float:
    """Digits of a Float's magnitude, either way (1e300 and 1e-300 both count 301): the size of
    the integers an exact conversion to a fraction would make, less the fixed 17 of precision."""
    _, mantissa, exponent, bits = x._mpf_  # |x| = mantissa * 2**exponent, mantissa of `bits` bits
    if not mantissa:
        return 1.0 if not exponent else math.inf  # zero; inf and nan have an empty mantissa too
    return abs(exponent + bits) * math.log10(2) + 1


def _terms(limits) -> float | None:
    """Terms of a sum or product over `limits`: None when their number is symbolic (`k = 1..n`),
    inf past MAX_TERMS or with a bound of more than 6 digits."""
    terms = 1.0
    for _, low, high in limits:
        if max(_digits(low), _digits(high)) > 6:
            return math.inf
        count = high - low + 1  # bounds this small are cheap to subtract: n + 5 - n is 6
        if not count.is_number:
            return None
        try:
            terms *= max(0.0, float(count))
        except (TypeError, ValueError):  # a complex count: nothing a real sum would have
            return math.inf
    return terms if terms <= MAX_TERMS else math.inf


def _power_digits(base_digits: float, exponent: sympy.Basic) -> float:
    """Digits of base**exponent from the base's digits: the exponent's value is what matters.

    A symbolic exponent (`x^{n+1}`, `e^{-x^2}`) computes nothing big by itself, but the numbers in
    it must be small (`x^{10^{9} n}` is refused); a numeric one, integer, fraction or decimal
    (`2^{0.5}`, `10^{1.5}`, `e^{\\pi\\sqrt{3}/6}`), is evaluated to 15 digits once its own size is
    bounded, and refused when base**value would be too long. An infinite exponent (`2^{\\infty}`)
    is SymPy's business: it computes no digits.
    """
    if not exponent.is_number:
        size = _number_digits(exponent)
        return max(base_digits, size) if size <= 6 else math.inf
    size = _digits(exponent)
    if size > MAX_DIGITS:
        return math.inf
    try:
        value = abs(complex(exponent.evalf(15)))  # its numbers are bounded: evaluating is cheap
    except (TypeError, ValueError, OverflowError):
        return math.inf
    if math.isnan(value) or (math.isinf(value) and exponent.is_infinite):
        return max(base_digits, size)
    return max(base_digits, size, base_digits * value + 1)


def _expanded_terms(expr: sympy.Basic) -> float:
    """An upper bound on the terms of `expr` multiplied out, as SymPy's simplification may: the
    lesser of two counts. Sums add, products multiply and the n-th power of a t-term sum makes
    C(n+t-1, t-1) (`(a+b+c+d)^{60}`: 39,711); and a polynomial of degree d in g generators has at
    most C(d+g, g) terms (`(x+1)(x+2)...(x+10)`: 11, not 2^10). A generator is a symbol or a part
    that is not polynomial (`\\sin(x)`, `\\sqrt{x}`, `x^{n}`); the arguments of each are multiplied
    out on their own. A numeric exponent's integer part is what SymPy multiplies out
    (`(a+b)^{5/2}` is `(a+b)^2 \\sqrt{a+b}`); the digits guard has bounded it."""
    generators: set = set()
    inner = [1.0]  # the largest count of any generator's argument

    def walk(e: sympy.Basic) -> tuple[float, float]:  # (terms, degree)
        if isinstance(e, sympy.Number):
            return 1.0, 0.0
        if isinstance(e, sympy.Add | sympy.Mul):
            parts = [walk(a) for a in e.args]
            if isinstance(e, sympy.Add):
                return sum(t for t, _ in parts), max(d for _, d in parts)
            return math.prod(t for t, _ in parts), sum(d for _, d in parts)
        if isinstance(e, sympy.Pow) and e.exp.is_number:
            value = abs(complex(e.exp))
            if math.isfinite(value):
                terms, degree = walk(e.base)
                n = math.floor(value)
                root = n < value  # what is left, base^(value - n), is a generator
                if root:
                    generators.add((e.base, value - n))
                return _multinomial(n, terms), n * degree + root
        generators.add(e)
        inner.extend(_expanded_terms(a) for a in e.args)
        return 1.0, 1.0

    terms, degree = walk(expr)
    return max(min(terms, _multinomial(degree, len(generators) + 1)), *inner)


def _multinomial(n: float, t: float) -> float:
    """C(n+t-1, t-1): the terms of the n-th power of a sum of t terms (a float; inf when huge)."""
    if n == 0 or t <= 1:
        return 1.0
    if math.isinf(n) or math.isinf(t):
        return math.inf
    log = math.lgamma(n + t) - math.lgamma(n + 1) - math.lgamma(t)
    return float(round(math.exp(log))) if log < 700 else math.inf  # lgamma is a float: an integer


def _number_digits(expr: sympy.Basic) -> float:
    """Digits of the largest number written in a symbolic `expr`: of each part without symbols."""
    if expr.is_number:
        return _digits(expr)
    return max((_number_digits(a) for a in expr.args), default=1.0)
