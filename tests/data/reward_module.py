"""Reward functions used by tests/tasks/test_dataset.py (imported by path and by module name)."""

import time


def first_char(prompts, completions, answer, **kwargs):
    """1.0 when the completion starts with the answer's first character."""
    return [1.0 if c[:1] == a[:1] else 0.0 for c, a in zip(completions, answer, strict=True)]


def hostile(completions, **kwargs):
    """Misbehaves on some completions: raises, hangs, abstains; else 1.0."""
    out = []
    for c in completions:
        if c == "raise":
            raise ValueError("bad completion")
        if c == "sleep":
            time.sleep(30)
        out.append(None if c in ("none", "half") else 1.0)
    return out


def half(completions, **kwargs):
    """0.5 on "half", abstains otherwise."""
    return [0.5 if c == "half" else None for c in completions]


def chat_kind(prompts, completions, **kwargs):
    """1.0 when prompts and completions come in TRL's conversational form."""
    ok = isinstance(prompts[0], list) and completions[0][0]["role"] == "assistant"
    return [1.0 if ok else 0.0 for _ in completions]


def wrong_signature(response, example):
    return 1.0


def not_a_number(completions, **kwargs):
    return ["yes" for _ in completions]


def needs_solution(completions, solution):
    return [0.0 for _ in completions]


def broken(completions, **kwargs):
    """Raises on every completion: a bug in the function."""
    raise ZeroDivisionError("division by zero")


def text_only(completions, **kwargs):
    """TRL's common mistake: a reward for text completions, which fails on chat messages."""
    return [1.0 if c.strip() else 0.0 for c in completions]


def only_the_answer(completions, answer, **kwargs):
    """Scores the reference answer and raises on anything else (a model's responses)."""
    for c, a in zip(completions, answer, strict=True):
        if c != a:
            raise ValueError(f"not a number: {c!r}")
    return [1.0 for _ in completions]


CALLS = [0]


def every_other(completions, **kwargs):
    """1.0, then raises on every second call of its process."""
    CALLS[0] += 1
    if CALLS[0] % 2 == 0:
        raise ValueError("every other call")
    return [1.0 for _ in completions]
