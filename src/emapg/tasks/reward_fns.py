"""Reward functions named by import path and called with TRL's signature.

`task.reward_fns` entries are `package.module:function` (imported from sys.path) or
`path/to/file.py:function` (loaded from that file). A function is called like TRL's
GRPOTrainer calls it:

    fn(prompts=[...], completions=[...], <column>=[...], ...) -> [float | None, ...]

with the dataset's other columns as keyword arguments, one list entry per completion. A
function that takes **kwargs gets every column; one that does not gets the arguments it
names, so `def exact(completions, answer)` works too. The signature is checked when the run
starts, against the data's columns; what it returns is checked on every call.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from emapg.errors import EmapgError
from emapg.tasks.rewards import ScoreError
from emapg.user_code import load_function

FIXED = ("prompts", "completions")  # what every call passes besides the columns

# TRL's most common mistake: a reward written for text completions, run on chat data.
CHAT_HINT = (
    " (the prompts are chat messages, so each completion is a list of messages, as in TRL: "
    "its text is completion[0]['content'])"
)


class RewardReturnError(ScoreError):
    """A reward function returned something other than one number or None per completion."""


class RewardFunctionError(ScoreError):
    """A reward function raised: the message names it and its exception."""


@dataclass
class RewardFunction:
    """One reward function of a run: where it comes from, its weight, and what it is passed."""

    spec: str
    weight: float
    fn: Callable
    takes_all: bool  # has **kwargs: gets every column
    names: frozenset[str]  # the keyword arguments it accepts by name

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", self.spec.rpartition(":")[2])

    @classmethod
    def load(cls, spec: str, weight: float = 1.0) -> RewardFunction:
        fn = load_function(spec, "task.reward_fns")
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            raise EmapgError(f"task.reward_fns: {spec!r}: its signature cannot be read") from None
        kinds = inspect.Parameter
        positional_only = [p.name for p in params if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty]
        if positional_only:
            raise EmapgError(
                f"task.reward_fns: {spec!r} takes {', '.join(positional_only)} by position only; a reward "
                "function is called with keyword arguments (prompts, completions, the data's columns)"
            )
        takes_all = any(p.kind == kinds.VAR_KEYWORD for p in params)
        names = frozenset(
            p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        )
        if not takes_all and "completions" not in names:
            raise EmapgError(
                f"task.reward_fns: {spec!r}{_signature(fn)} does not take `completions`; expected TRL's "
                "signature fn(prompts, completions, **kwargs) -> list of float or None"
            )
        return cls(spec, float(weight), fn, takes_all, names)

    def required(self) -> set[str]:
        """The arguments without default that it names: each must be passed."""
        params = inspect.signature(self.fn).parameters.values()
        return {
            p.name
            for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }

    def check_columns(self, columns: Sequence[str], source: str) -> None:
        """Stop when it requires an argument that neither TRL's signature nor the data provides."""
        missing = sorted(self.required() - set(FIXED) - set(columns))
        if missing:
            raise EmapgError(
                f"task.reward_fns: {self.spec!r}{_signature(self.fn)} needs {', '.join(missing)}, which is "
                f"not a column of {source} (columns: {', '.join(columns) or 'none'})"
            )

    def __call__(self, prompt, completion, columns: dict) -> float | None:
        """Its value for one completion (a batch of one), checked: a finite number or None."""
        kwargs = {"prompts": [prompt], "completions": [completion], **{k: [v] for k, v in columns.items()}}
        if not self.takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in self.names}
        try:
            out = self.fn(**kwargs)
        except Exception as e:
            hint = CHAT_HINT if isinstance(completion, list) and _on_a_list(e) else ""
            raise RewardFunctionError(
                f"reward function {self.spec} raised {type(e).__name__}: {e}{hint}"
            ) from None
        if isinstance(out, str | bytes) or not hasattr(out, "__len__") or len(out) != 1:
            raise RewardReturnError(
                f"reward function {self.spec} returned {out!r:.60} for 1 completion; expected a list "
                "with one float or None per completion"
            )
        value = out[0]
        if value is None:
            return None
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise RewardReturnError(
            f"reward function {self.spec} returned [{value!r:.60}]; expected a finite float or None per completion"
        )


def _on_a_list(e: Exception) -> bool:
    """Whether `e` is what treating a list as text raises (`'list' object has no attribute
    'strip'`, `expected string or bytes-like object, got 'list'`)."""
    return isinstance(e, AttributeError | TypeError) and "list" in str(e)


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def load_reward_functions(specs: Sequence, weights: Sequence) -> list[RewardFunction]:
    """The functions of `task.reward_fns` with the weights of `task.reward_weights` (default 1)."""
    if not specs:
        raise EmapgError("task.reward_fns: expected at least one reward function, e.g. [my_rewards:exact]")
    if not all(isinstance(s, str) for s in specs):
        raise EmapgError(f"task.reward_fns: expected strings module:function, got {list(specs)!r:.80}")
    if weights and len(weights) != len(specs):
        raise EmapgError(
            f"task.reward_weights: {len(weights)} weights for {len(specs)} reward functions; expected one each"
        )
    fns = [RewardFunction.load(s, w) for s, w in zip(specs, weights or [1.0] * len(specs), strict=True)]
    seen: dict[str, str] = {}
    for f in fns:
        if f.name in seen:
            raise EmapgError(
                f"task.reward_fns: {seen[f.name]!r} and {f.spec!r} are both named {f.name!r}; each "
                "function's mean is logged under its name, so names must differ"
            )
        seen[f.name] = f.spec
    return fns
