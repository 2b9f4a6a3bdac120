"""A task made of your data and your reward functions: `task.name=dataset`.

Data (`task.train_files`, `task.eval_files`): `.jsonl`, `.json` (a list of records),
`.parquet` and `.csv` files, a directory written by `datasets.save_to_disk`, a local dataset
directory, or a dataset name resolved by `datasets.load_dataset` (from the local Hugging Face
cache when offline). The prompt is the `task.prompt_field` column: text, or chat messages (a
list of {role, content}) given to the chat template. Every other column is passed to the
reward functions (`task.reward_fns`, TRL's signature, see emapg.tasks.reward_fns).

Scoring one response calls each function on a batch of one and sums the values times their
`task.reward_weights`; a function that returns None abstains (left out of the sum, as TRL's
nansum does). When every function abstains, or one raises or returns a bad value, the response
gets reward 0 and is counted in reward/errors. Rewards are any finite number (TRL rewards are
unbounded); each function's mean over the responses it scored is logged as reward/<name>/mean.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import model_validator

from emapg.errors import EmapgError
from emapg.prompts import ChatPrompt
from emapg.settings import Float, check, setting
from emapg.tasks.base import Example, ProblemSettings, Task, TaskInputs, WarmStartRecipe
from emapg.tasks.records import FILE_TYPES, read_records
from emapg.tasks.reward_fns import RewardFunction, RewardReturnError, load_reward_functions
from emapg.tasks.rewards import ABSTAINED, Reward

INSTALL_DATASETS = "pip install 'datasets>=3' (or: pip install 'emapg[datasets]')"


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise EmapgError(f"{what} needs the datasets package: {INSTALL_DATASETS}") from None
    return datasets


def _read_file(file: Path, field: str) -> list[dict]:
    rows = read_records(file, f"{field}:")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise EmapgError(f"{field}: {file} record {n}: expected an object of columns, got {row!r:.60}")
    return rows


def _pick_split(data, source: str, split: str, field: str):
    if isinstance(data, dict):  # a DatasetDict
        if split not in data:
            raise EmapgError(
                f"{field}: {source} has no split {split!r} (splits: {', '.join(data)}); set "
                f"task.{'train' if field.endswith('train_files') else 'eval'}_split"
            )
        return data[split]
    return data


def load_rows(source: str, split: str, config: str = "", field: str = "task.train_files") -> list[dict]:
    """The records of one data source (a file, a directory or a dataset name), in order."""
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path, field)
    if path.is_dir():
        datasets = _datasets(f"{field}: loading the directory {source}")
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        try:
            data = (
                datasets.load_from_disk(str(path))
                if saved
                else datasets.load_dataset(str(path), config or None)
            )
        except Exception as e:
            raise EmapgError(
                f"{field}: cannot load {source} ({type(e).__name__}: {_first_line(e)})"
            ) from None
        return _pick_split(data, source, split, field).to_list()
    if source.startswith(("/", ".", "~")) or path.suffix.lower() in FILE_TYPES:
        raise EmapgError(f"{field}: {source!r}: no such file or directory")
    datasets = _datasets(f"{field}: the dataset name {source!r}")
    try:
        data = datasets.load_dataset(source, config or None, split=split)
    except Exception as e:
        raise EmapgError(
            f"{field}: cannot load the dataset {source!r} split {split!r} ({type(e).__name__}: {_first_line(e)})"
        ) from None
    return data.to_list()


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _prompt(value, where: str):
    """A text prompt as is; chat messages as a ChatPrompt (one user message: its text, so that it
    is templated exactly like a text prompt)."""
    if isinstance(value, str):
        return value
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise EmapgError(
            f"{where}: expected text or a list of chat messages {{role, content}}, got {value!r:.80}"
        )
    if value[-1]["role"] == "assistant":
        raise EmapgError(
            f"{where}: the prompt's messages end with an assistant message; expected the turn to answer"
        )
    if len(value) == 1 and value[0]["role"] == "user":
        return value[0]["content"]
    return ChatPrompt(value)


class DatasetSettings(ProblemSettings):
    """`task.name=dataset`: your data and TRL-style reward functions (docs/custom-tasks.md)."""

    train_files: list[str] = setting(
        [], "training data: files (.jsonl/.json/.parquet/.csv), save_to_disk directories or dataset names"
    )
    eval_files: list[str] = setting(
        [], "held-out data (same forms); empty: the last num_eval training records"
    )
    prompt_field: str = setting(
        "prompt", "the prompt's column: text, or chat messages [{role, content}]", min_length=1
    )
    answer_field: str = setting(
        "", "column of reference completions; builtin:tiny warm-starts on them (empty: on arithmetic)"
    )
    reward_fns: list[str] = setting(
        [], "reward functions module:function or path/to/file.py:function, TRL's signature"
    )
    reward_weights: list[Float] = setting([], "one weight per reward function (empty: all 1)")
    train_split: str = setting("train", "split of a dataset name or of a saved DatasetDict, for training")
    eval_split: str = setting("test", "split of a dataset name or of a saved DatasetDict, for evaluation")
    dataset_config: str = setting("", "configuration name of a dataset (e.g. main for gsm8k)")

    @model_validator(mode="after")
    def _needs_data(self):
        check(
            bool(self.train_files),
            "task.train_files: the dataset task needs training data (files, a directory or a dataset name)",
        )
        return self


class DatasetTask(Task):
    """Prompts from rows of data, rewards from TRL-style reward functions; see the module doc."""

    name = "dataset"
    reward_range = (-math.inf, math.inf)

    def __init__(
        self,
        train_rows: list[dict],
        eval_rows: list[dict],
        reward_fns: list[RewardFunction],
        *,
        prompt_field: str = "prompt",
        answer_field: str = "",
        sources: tuple[str, str] = ("train data", "eval data"),
    ):
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.fns = reward_fns
        self.reward_parts = tuple(f.name for f in reward_fns)
        self._train = self._examples(train_rows, sources[0], "task.train_files")
        self._eval = self._examples(eval_rows, sources[1], "task.eval_files")

    def _examples(self, rows: list[dict], source: str, field: str) -> list[Example]:
        if not rows:
            raise EmapgError(f"{field}: {source} has no records")
        columns = list(rows[0])
        for key, what in ((self.prompt_field, "task.prompt_field"), (self.answer_field, "task.answer_field")):
            if key and key not in columns:
                raise EmapgError(f"{what}: {source} has no column {key!r} (columns: {', '.join(columns)})")
        passed = [c for c in columns if c != self.prompt_field]
        for f in self.fns:
            f.check_columns(passed, source)
        out = []
        for n, row in enumerate(rows, 1):
            where = f"{source} record {n}"
            if set(row) != set(columns):
                raise EmapgError(
                    f"{where}: columns {sorted(row)} differ from the first record's {sorted(columns)}"
                )
            prompt = _prompt(row[self.prompt_field], f"{where}, column {self.prompt_field!r}")
            answer = ""
            if self.answer_field:
                answer = row[self.answer_field]
                if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                    raise EmapgError(
                        f"{where}: task.answer_field {self.answer_field!r} must be text, got {answer!r:.60}"
                    )
                answer = str(answer)
            columns_of_row = {c: row[c] for c in passed}
            out.append(Example(prompt, answer, {"prompt": row[self.prompt_field], "columns": columns_of_row}))
        return out

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, response: str, example: Example) -> Reward:
        prompt = example.meta["prompt"]
        completion = response if isinstance(prompt, str) else [{"role": "assistant", "content": response}]
        parts = {f.name: f(prompt, completion, example.meta["columns"]) for f in self.fns}
        given = [(f.weight, parts[f.name]) for f in self.fns if parts[f.name] is not None]
        if not given:
            raise RewardReturnError(ABSTAINED)
        return Reward(sum(w * v for w, v in given), parts)

    # The reward worker needs the functions, not the data: send their import paths.
    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in ("fns", "_train", "_eval")}
        state["specs"] = [(f.spec, f.weight) for f in self.fns]
        return state

    def __setstate__(self, state: dict) -> None:
        specs = state.pop("specs")
        self.__dict__.update(state)
        self.fns = [RewardFunction.load(spec, weight) for spec, weight in specs]
        self._train = self._eval = []


def warm_start(task: DatasetTask):
    """The built-in model's warm start: the data's reference completions (task.answer_field),
    else the quickstart's arithmetic one (whose cache it then shares)."""
    from emapg.tasks.arithmetic import ArithmeticTask

    if not task.answer_field:
        base = ArithmeticTask()
        return WarmStartRecipe(base, base.train_examples())
    examples = task.train_examples()
    return WarmStartRecipe(
        task, examples, extra_chars=_chars(e.prompt + e.answer for e in examples + task.eval_examples())
    )


def _chars(texts) -> str:
    from emapg.model.models import ALPHABET

    seen = set().union(*map(set, texts)) - set(ALPHABET)
    return "".join(sorted(seen))


def check_returns(task: DatasetTask, timeout_s: float, isolation: str) -> None:
    """Before any step: score the first training example's reference completion (or an empty
    one) through the guarded scorer, and stop when a function raises (as TRL would) or returns
    something that is not a list of one number or None. A timeout here is left to training,
    which counts it, and so is every function abstaining."""
    from emapg.tasks.rewards import RewardScorer

    example = task.train_examples()[0]
    # hold_warning: a problem here stops the run with its one line, or is training's to report
    with RewardScorer(task, timeout_s=timeout_s, isolation=isolation, hold_warning=True) as scorer:
        problems = [p for p in scorer([example.answer], [example]).problems if p != ABSTAINED]
    if problems:
        probe = f"its task.answer_field {task.answer_field!r}" if task.answer_field else "an empty completion"
        raise EmapgError(f"task.reward_fns: {problems[0]} (called on the first training record with {probe})")


def from_config(inputs: TaskInputs) -> DatasetTask:
    """The dataset task of a `task` section: data loaded, functions imported, signatures and columns
    checked, and each function's return type probed, all before the model loads."""
    t = inputs.task
    fns = load_reward_functions(t.reward_fns, t.reward_weights)

    def rows(sources: list[str], split: str, field: str) -> list[dict]:
        return [r for s in sources for r in load_rows(s, split, t.dataset_config, field)]

    train = rows(t.train_files, t.train_split, "task.train_files")
    names = (", ".join(t.train_files), ", ".join(t.eval_files))
    if t.eval_files:
        eval_rows = rows(t.eval_files, t.eval_split, "task.eval_files")[: t.num_eval]
    else:  # hold out the last num_eval records of the training data
        if len(train) <= t.num_eval:
            raise EmapgError(
                f"task.eval_files is empty and the training data has {len(train)} records, not more than "
                f"task.num_eval={t.num_eval}; give task.eval_files or a smaller task.num_eval"
            )
        train, eval_rows = train[: -t.num_eval], train[-t.num_eval :]
        names = (names[0], f"{names[0]} (last {t.num_eval} records)")
    task = DatasetTask(
        train[: t.num_train],
        eval_rows,
        fns,
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        sources=names,
    )
    check_returns(task, t.reward_timeout_s, t.reward_isolation)
    return task
