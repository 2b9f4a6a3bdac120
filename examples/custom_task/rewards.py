"""Reward functions for the docs example (docs/custom-tasks.md), in TRL's signature: the
prompts, the completions and the dataset's other columns (here `answer`) as lists."""


def exact(prompts, completions, answer, **kwargs):
    """1.0 when the completion is exactly the answer, else 0.0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def digits(prompts, completions, answer, **kwargs):
    """The share of the answer's digits in place; None (abstain) when the completion is not a number."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        c = c.strip()
        if not c.isdecimal():
            out.append(None)
            continue
        out.append(sum(x == y for x, y in zip(c, a, strict=False)) / max(len(a), len(c)))
    return out
