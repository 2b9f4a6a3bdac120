"""Rewards that cannot crash, stall or poison a run.

A task's `score` is user code. Whatever it does with one response (raise, return "abc", NaN
or 7, loop forever in Python or in C), that response gets reward 0 and is counted
(`errors`, `timeouts`), and the run goes on; but a run whose first training step could score
no response at all stops there (`check_first_step`): that score is broken. Only a separate
process can cut off a hang in C code (a signal alarm waits for the C call to return), so by
default scoring runs in one persistent worker process fed a whole batch at a time; a call
that overruns its limit kills the worker, and a fresh one scores the rest of the batch. A
task whose scorer is trivially safe says so (`score_is_safe = True`, e.g. arithmetic's exact
match) and is scored in-process, with the same checks on exceptions and values but no time
limit and no overhead.

A score is a number in the task's `reward_range` ([0, 1] unless the task says otherwise), or
a `Reward`: the number and its named parts (e.g. one per reward function of a dataset task),
whose means are logged beside the reward.
"""

from __future__ import annotations

import logging
import math
import numbers
import pickle
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from emapg import fresh_process
from emapg.errors import EmapgError
from emapg.settings import Float, Section, setting, validated

STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter importing the task's module (and what it imports)

log = logging.getLogger("emapg")


RANGE = (0.0, 1.0)


class ScoringSettings(Section):
    """How rewards are computed safely: every task's section starts with these."""

    key: ClassVar[str] = "task"
    reward_timeout_s: Float = setting(
        10.0, "time limit of one score call; past it the response gets reward 0", gt=0
    )
    reward_isolation: Literal["auto", "process", "inline"] = setting(
        "auto", "auto: a worker process unless the task declares score_is_safe; process; inline"
    )


class ScoreError(Exception):
    """Raised by a score whose message tells the whole failure, what failed included (e.g.
    "reward function m:f raised ..."): the problem is reported as that message."""


# The problem of a response the score has no value for (a dataset task's functions all
# abstained): reward 0 and counted in errors, but no sign that the score is broken.
ABSTAINED = "every reward function returned None"


@dataclass(frozen=True)
class Reward:
    """A score with its named parts; a part is None where it does not apply (abstains)."""

    value: float
    parts: dict[str, float | None]


@dataclass
class Scored:
    rewards: list[float]
    errors: int = 0  # raised, or returned something other than a number in the reward range
    timeouts: int = 0  # ran past the time limit
    parts: list[dict | None] = field(default_factory=list)  # per response: a Reward's parts, or None
    problems: list[str] = field(default_factory=list)  # what went wrong ("score raised ..."), one per error

    @property
    def failures(self) -> int:
        """The errors that show the score broken: all but abstentions."""
        return sum(p != ABSTAINED for p in self.problems)

    def part_sums(self, names) -> list[tuple[float, int]]:
        """(sum, count) of each named part over the responses where it has a value."""
        out = []
        for name in names:
            values = [p[name] for p in self.parts if p and p.get(name) is not None]
            out.append((float(sum(values)), len(values)))
        return out


def _range_text(low: float, high: float) -> str:
    if math.isinf(low) and math.isinf(high):
        return "a finite number"
    return f"a number in [{low:g}, {high:g}]"


def _check(value, low: float, high: float) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value) and low <= value <= high


def score_detail(score, response: str, example, reward_range=RANGE) -> tuple[float, str | None, dict | None]:
    """(reward, None, parts or None), or (0.0, what went wrong, None) when `score` raises or
    returns a bad value: not a number in `reward_range`, or a Reward with a bad value or part."""
    low, high = reward_range
    try:
        value = score(response, example)
    except ScoreError as e:
        return 0.0, str(e), None
    except Exception as e:  # user code: any failure is that response's problem only
        return 0.0, f"score raised {type(e).__name__}: {e}", None
    parts = None
    if isinstance(value, Reward):
        parts = value.parts
        bad = [k for k, v in parts.items() if v is not None and not _check(v, -math.inf, math.inf)]
        if bad:
            return (
                0.0,
                f"score returned part {bad[0]}={parts[bad[0]]!r:.60}, expected a finite number or None",
                None,
            )
        value = value.value
    if _check(value, low, high):
        return float(value), None, parts
    return 0.0, f"score returned {value!r:.60}, expected {_range_text(low, high)}", None


def _worker(fd: int) -> None:
    """The worker process: receive the parent's sys.path and the pickled `score`, then batches."""
    accepted = fresh_process.accept(fd)
    if accepted is None:
        return
    conn, (score, reward_range) = accepted
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the trainer is gone
            return
        for response, example in batch:
            conn.send(score_detail(score, response, example, reward_range))


class _NotPicklable(Exception):
    pass


class RewardScorer:
    """Scores batches of (response, example) with `task.score`, safely; see the module doc.

    isolation: "auto" (a worker process unless the task declares `score_is_safe` or cannot be
    pickled, which is logged), "process" (a task that cannot be pickled is an error) or "inline". `timeout_s` bounds each call in a worker. Use as a context
    manager (or call `close`) to stop the worker.

    The first problem of a run is logged (once: the counts tell the rest); with `hold_warning`
    only once `check_first_step` passes, so that a run stopped there prints its error alone.
    """

    def __init__(self, task, *, timeout_s: float, isolation: str = "auto", hold_warning: bool = False):
        validated(ScoringSettings, {"reward_timeout_s": timeout_s, "reward_isolation": isolation}, "task")
        self.task, self.timeout_s = task, timeout_s
        self.reward_range = tuple(getattr(task, "reward_range", RANGE))
        self.inline = isolation == "inline" or (isolation == "auto" and getattr(task, "score_is_safe", False))
        self._process = self._conn = None
        self._problem: str | None = None  # the run's first problem
        self._hold = hold_warning
        if not self.inline:
            try:
                self._start()  # now, so a task that cannot run in a worker fails before any work
            except _NotPicklable as e:
                if isolation == "process":
                    raise EmapgError(f"{e}; make it picklable or set task.reward_isolation=inline") from None
                log.warning("%s: scoring in-process, without a time limit", e)
                self.inline = True

    def __call__(self, responses: list[str], examples: list) -> Scored:
        items = list(zip(responses, examples, strict=True))
        out = Scored([])
        if self.inline:
            for response, example in items:
                self._record(out, *score_detail(self.task.score, response, example, self.reward_range))
            return out
        while items:
            done = self._score_in_worker(items, out)
            items = items[done:]
        return out

    def _score_in_worker(self, items: list, out: Scored) -> int:
        """Score `items` in the worker until one overruns or kills it; returns how many are done."""
        if self._process is None:
            self._start()
        self._conn.send(items)
        for done in range(len(items)):
            if not self._conn.poll(self.timeout_s):
                out.rewards.append(0.0)
                out.parts.append(None)
                out.timeouts += 1
                self._warn(f"score took longer than task.reward_timeout_s={self.timeout_s} s")
                self._stop()
                return done + 1
            try:
                self._record(out, *self._conn.recv())
            except EOFError:  # the score killed its process (os._exit, a crash in C code)
                self._record(out, 0.0, "score ended the worker process")
                self._stop()
                return done + 1
        return len(items)

    def _record(self, out: Scored, reward: float, problem: str | None, parts: dict | None = None) -> None:
        out.rewards.append(reward)
        out.parts.append(parts)
        if problem is not None:
            out.errors += 1
            out.problems.append(problem)
            self._warn(problem)

    def _warn(self, problem: str) -> None:
        if self._problem is None:
            self._problem = problem
            if not self._hold:
                self._log_problem()

    def _log_problem(self) -> None:
        log.warning(
            "task %r: %s on a response; it gets reward 0 (counted in reward/errors and "
            "reward/timeouts; further problems are not logged)",
            self._task_name(),
            self._problem,
        )

    def _task_name(self) -> str:
        return getattr(self.task, "name", type(self.task).__name__)

    def check_first_step(self, problems: list[str], failures: int, responses: int, step: int) -> None:
        """A run's first training step scored `responses` with `failures` (Scored.failures;
        every process's counts, `problems`: this process's). Stop when every one failed: a score
        that fails on every response is broken (e.g. a text reward on chat completions), and the
        run would learn nothing from rewards of 0. Else log the problem held back so far."""
        if failures == responses:
            raise EmapgError(
                f"task {self._task_name()!r}: {problems[0]}, on every one of the {responses} responses "
                f"of step {step}; with every reward 0 the run would learn nothing: fix the reward"
            )
        if self._hold:
            self._hold = False
            if self._problem is not None:
                self._log_problem()

    def _start(self) -> None:
        try:
            payload = pickle.dumps((self.task.score, self.reward_range))
        except Exception as e:
            raise _NotPicklable(
                f"task {type(self.task).__name__}: cannot be sent to a reward worker process "
                f"({type(e).__name__}: {e})"
            ) from None
        process, conn = fresh_process.start("emapg.tasks.rewards:_worker", payload)
        try:
            reply = conn.recv() if conn.poll(STARTUP_TIMEOUT_S) else "no reply"
        except EOFError:
            reply = "it exited"
        if reply != "ready":
            process.kill()
            process.wait()
            raise EmapgError(
                f"task {type(self.task).__name__}: the reward worker process did not start ({reply}); "
                "define the task in an importable module, or set task.reward_isolation=inline"
            )
        self._process, self._conn = process, conn

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._conn.close()
        self._process = self._conn = None

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
