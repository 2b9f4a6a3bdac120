"""Grading of math answers: the last `\\boxed{}` of a response against a reference, by math-verify.

math-verify (with latex2sympy2-extended) parses both sides into SymPy and decides equivalence
(fractions vs decimals, `\\dfrac`, thousands separators, percentages, units, intervals, ...).
Being SymPy, it can be made to compute without end: `2^{10^{100}}` asks for a number with
10^100 digits, a C-level big-integer computation that no signal can interrupt. So `score`
never hands math-verify anything it cannot finish quickly:

0. what is graded: of a response, its last boxed answer after its last `</think>` (the whole
   response without one); of a reference, its boxed answer, or all its distinct boxed answers
   as one list when it has several (see reference_boxed).
1. size: only the text from the last `\\boxed` on, at most MAX_ANSWER_CHARS, is parsed
   (the last boxed answer counts); a reference is at most as long. Brace nesting deeper than
   MAX_BRACE_DEPTH is refused (the LaTeX parser's time grows steeply with depth).
2. magnitude: parsing does not evaluate (`2^{10^{100}}` stays a Pow tree), so before the
   comparison, which does evaluate, both trees are checked: a number, power or factorial
   whose value would have more than MAX_DIGITS digits is refused, and so is a sum or product
   of more than MAX_TERMS terms. Only what is provably big: a decimal counts the digits of its
   magnitude (`2^{0.5}` passes), a symbolic exponent (`x^{n+1}`) only the numbers in it, and a
   sum or product over a symbolic range (`\\sum_{k=1}^{n} k`), which SymPy never expands, passes
   when its term is at most MAX_SYMBOLIC_TERM_DIGITS digits.
3. time: math-verify's own per-parse and per-comparison limits (signal based, so only in the
   main thread; elsewhere steps 1-2 are the guard). Training also runs `score` in a worker
   process with a hard time limit (emapg.rewards), since MathTask does not claim to be safe.

Refused or failing inputs score 0, except a boxed answer written exactly as the reference.
"""

from __future__ import annotations

import functools
import logging
import math
import threading

import sympy
from math_verify import LatexExtractionConfig, parse, verify

from emapg.tasks.math_data import BOXED

THINK_END = "</think>"  # R1-style reasoning ends here; only what follows is graded
MAX_ANSWER_CHARS = 1000  # from "\boxed" on; real answers are far shorter
MAX_BRACE_DEPTH = 20
MAX_REFERENCE_BOXES = 20  # a solution boxes one answer, or a few
MAX_DIGITS = 10_000  # of any number the comparison may compute
MAX_TERMS = 1000  # of a sum or product the comparison may expand
MAX_SYMBOLIC_TERM_DIGITS = 50  # of the term of a sum or product over k = 1..n (its closed form)
TIME_LIMIT_S = 1  # per parse and per comparison (math-verify takes whole seconds)

_EXTRACTION = [LatexExtractionConfig(boxed_match_priority=0)]
# math-verify logs every parse failure and timeout; a policy produces thousands of those.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)


def score(response: str, reference: str) -> float:
    """1.0 when the last `\\boxed{}` answer of `response` (after its last `</think>`) equals
    `reference`, else 0.0.

    `reference` is the answer itself ("\\frac{1}{2}", "18", "[1, 2)"), or a text whose boxed
    answer is the reference (a MATH solution; several boxed answers are one list). Never raises; see the module doc for why
    it always returns quickly.
    """
    if not isinstance(response, str) or not isinstance(reference, str):
        return 0.0
    answer = last_boxed(final_part(response))
    gold_text = reference_boxed(reference)
    if answer is None or gold_text is None:
        return 0.0
    written = _content(answer)
    if written is not None and written == _content(gold_text):  # the one way a refused answer scores
        return 1.0
    if not (_small_text(answer) and _small_text(gold_text)):
        return 0.0
    gold = _parse(gold_text)
    pred = _parse(answer)
    if not gold or not pred or not all(map(_small_value, gold + pred)):
        return 0.0
    try:
        return 1.0 if verify(gold, pred, timeout_seconds=_time_limit()) else 0.0
    except Exception:  # math-verify swallows its own errors; this is for what it cannot
        return 0.0


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


def _small_text(text: str) -> bool:
    depth = deepest = 0
    for c in text:
        depth += (c == "{") - (c == "}")
        deepest = max(deepest, depth)
    return deepest <= MAX_BRACE_DEPTH


@functools.lru_cache(maxsize=4096)  # a reference is parsed once per group, not once per response
def _parse_cached(text: str, time_limit: int | None) -> tuple:
    return tuple(parse(text, _EXTRACTION, parsing_timeout=time_limit))


def _parse(text: str) -> list:
    try:
        return list(_parse_cached(text, _time_limit()))
    except Exception:
        return []


def _time_limit() -> int | None:
    # signal.alarm, which math-verify uses, only works in the main thread.
    return TIME_LIMIT_S if threading.current_thread() is threading.main_thread() else None


def _small_value(expr) -> bool:
    """Whether evaluating `expr` (a parsed answer: SymPy or a fallback string) stays small."""
    if not isinstance(expr, sympy.Basic):
        return isinstance(expr, str) or _small_matrix(expr)
    try:
        return _digits(expr) <= MAX_DIGITS
    except Exception:  # RecursionError on a deep tree, or a node _digits cannot size
        return False


def _small_matrix(expr) -> bool:
    return isinstance(expr, sympy.MatrixBase) and all(_small_value(e) for e in expr)


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
    children = [_digits(a) for a in expr.args]
    if isinstance(expr, sympy.Mul):
        return sum(children)
    return max(children, default=1.0) + 1


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

    A symbolic exponent (`x^{n+1}`) computes nothing big by itself, but the numbers in it must
    be small (`x^{10^{9} n}` is refused); a numeric one, integer, fraction or decimal
    (`2^{0.5}`, `10^{1.5}`), is evaluated to 15 digits, which is cheap once its own size is
    bounded, and refused when base**value would be too long. An infinite exponent
    (`2^{\\infty}`) is SymPy's business: it computes no digits.
    """
    size = _digits(exponent)
    if size > 6:  # an exponent of 10^6 or more: even 2**exponent is too big
        return math.inf
    if not exponent.is_number:
        return max(base_digits, size)
    try:
        value = abs(complex(exponent.evalf(15)))  # the exponent is small: evaluating it is cheap
    except (TypeError, ValueError, OverflowError):
        return math.inf
    if math.isnan(value) or (math.isinf(value) and exponent.is_infinite):
        return max(base_digits, size)
    return max(base_digits, size, base_digits * value + 1)
