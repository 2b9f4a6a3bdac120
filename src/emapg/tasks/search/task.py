"""Question answering with a search engine (Search-R1): the built-in world or Search-R1 parquet data.

The policy's response is a multi-turn episode (emapg.rollout.multiturn with emapg.tasks.search.environment); the reward is exact match
of its final `<answer>` with any gold answer after SQuAD normalisation, optionally
`format_reward` for a well-formed but wrong answer.
"""

from __future__ import annotations

import random
import string
from collections import defaultdict
from pathlib import Path

from pydantic import model_validator

from emapg.errors import EmapgError
from emapg.settings import Float, check, exists, setting, validated
from emapg.tasks.base import Example, ProblemSettings, Task, TaskInputs, WarmStartRecipe
from emapg.tasks.search import world as synthetic
from emapg.tasks.search.answers import ANSWER, INFORMATION, INVALID_ACTION, exact_match, f1, last_tag
from emapg.tasks.search.environment import SearchEnvironment, information_block
from emapg.tasks.search.retriever import Retriever

# Search-R1's instruction, in our words, for parquet data without a `prompt` column.
INSTRUCTION = (
    "Answer the question. Think step by step inside <think> and </think>. When you need facts, "
    "search with <search> query </search> and the results come back between <information> and "
    "</information>; search as often as you need. When you know the answer, give it without "
    "explanation as <answer> answer </answer>, e.g. <answer> Beijing </answer>. Question: "
)


_INVALID_HEAD = INVALID_ACTION[: INVALID_ACTION.index("<")]  # the message up to its first tag


def final_answer(response: str) -> str | None:
    """The last `<answer>` the model wrote: text the environment inserted (passages, the
    invalid-action message, whose example tags must not count) never counts."""
    tail = response.rpartition(INFORMATION[1])[2]
    before, found, rest = tail.rpartition(_INVALID_HEAD)
    if found:  # after the message, or nothing if the message was cut (the episode ended there)
        rest_of_message = INVALID_ACTION[len(_INVALID_HEAD) :]
        tail = rest[len(rest_of_message) :] if rest.startswith(rest_of_message) else ""
    return last_tag(tail, ANSWER)


def _example(row: dict, prompt: str) -> Example:
    golds = [str(g) for g in row["golden_answers"]]
    meta = {"golden_answers": golds, "data_source": str(row.get("data_source") or "unknown")}
    meta.update({k: row[k] for k in ("hops", "person") if k in row})
    return Example(prompt, golds[0] if golds else "", meta)


def row_prompt(row: dict, instruction: str) -> str:
    """The prompt text of a data row: the content of its `prompt` column when present (Search-R1's
    files carry the full prompt as one user message; the chat template, if any, is applied at
    encoding as Search-R1's loader does), else `instruction` + question + newline."""
    messages = row.get("prompt")
    if messages is None:
        return f"{instruction}{row['question']}\n"
    return messages[0]["content"]


def load_parquet(path: str) -> list[dict]:
    """Rows of a Search-R1 parquet file: `question`, `golden_answers` (a list), `data_source`, and
    optionally `prompt` (a list with one user message, `[{"role": "user", "content": ...}]`)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EmapgError(
            "reading parquet data needs pyarrow, a dependency of emapg: pip install 'pyarrow>=15' "
            "(or reinstall emapg: pip install -e .)"
        ) from None
    file = Path(path).expanduser()
    if not file.is_file():
        raise EmapgError(f"search data {path!r}: no such file")
    table = pq.read_table(file)
    missing = {"question", "golden_answers"} - set(table.column_names)
    if missing:
        raise EmapgError(f"search data {path!r}: missing columns {sorted(missing)}")
    rows = table.to_pylist()
    for n, row in enumerate(rows):
        golds = row["golden_answers"]
        if isinstance(golds, str):
            row["golden_answers"] = [golds]
        elif not golds:
            raise EmapgError(f"search data {path!r}: row {n} has no golden_answers")
        messages = row.get("prompt")
        if messages is not None and not (
            len(messages) == 1
            and isinstance(messages[0], dict)
            and messages[0].get("role") == "user"
            and isinstance(messages[0].get("content"), str)
        ):
            raise EmapgError(f"search data {path!r}: row {n}'s prompt is not one user message with content")
    return rows


# The tags, "Doc 1(Title: ...)" and the invalid-action message need them in the built-in
# character tokenizer.
TINY_EXTRA_CHARS = "<>" + string.ascii_uppercase


class SearchSettings(ProblemSettings):
    """`task.name=search`: multi-turn question answering with a retriever (Search-R1's episodes)."""

    seed: int = setting(1234, "seed of the built-in world (independent of train.seed)")
    corpus: str = setting("", "jsonl corpus (id, contents = title line + text); empty: the built-in world's")
    url: str = setting("", "a Search-R1 retrieval server (http://host:port/retrieve) instead of BM25")
    max_queries_per_request: int = setting(
        512,
        "most queries per POST to task.url; bigger batches are split into several requests "
        "(emapg serve-retriever accepts 4096 by default: --max-queries)",
        ge=1,
    )
    max_query_chars: int = setting(
        1000,
        "queries sent to task.url are cut to this many characters "
        "(emapg serve-retriever refuses longer ones by default: --max-query-chars)",
        ge=1,
    )
    busy_timeout_s: float = setting(
        600.0, "a busy retrieval server (HTTP 503) is retried for this long, then the run stops", gt=0
    )
    topk: int = setting(3, "passages returned per query", ge=1)
    max_turns: int = setting(
        4, "rounds with the environment (search or invalid-action message), then one final turn", ge=1
    )
    max_observation_tokens: int = setting(
        500, "inserted text (passages, messages) cut to this many tokens", ge=1
    )
    max_context: int = setting(
        4096, "prompt + episode tokens cap; a turn gets at most the room left, a full episode ends", ge=1
    )
    format_reward: Float = setting(0.0, "reward of a well-formed but wrong <answer>", ge=0, lt=1)
    train_file: str = setting("", "Search-R1 parquet training data; empty: the built-in world")
    eval_file: str = setting("", "Search-R1 parquet evaluation data (needed with train_file)")
    world_people: int = setting(100, "built-in world: people (two questions each)", ge=2)
    world_cities: int = setting(10, "built-in world: cities", ge=1)

    @model_validator(mode="after")
    def _data(self):
        check(bool(self.train_file) == bool(self.eval_file), "task.train_file and task.eval_file go together")
        check(
            not self.train_file or bool(self.corpus or self.url),
            "task.train_file needs task.corpus or task.url",
        )
        for key in ("train_file", "eval_file", "corpus"):
            path = getattr(self, key)
            check(not path or exists(path, file=True), f"task.{key}: {path!r} does not exist")
        return self


class SearchTask(Task):
    name = "search"
    score_is_safe = True  # string matching: no worker process needed

    def __init__(
        self,
        retriever: Retriever,
        train: list[dict],
        eval: list[dict],
        *,
        topk: int = 3,
        max_turns: int = 4,
        format_reward: float = 0.0,
        instruction: str = "",
        world: dict | None = None,
        max_observation_tokens: int | None = None,
        max_context: int | None = None,
    ):
        validated(
            SearchSettings,
            {"name": "search", "topk": topk, "max_turns": max_turns, "format_reward": format_reward},
            "task",
        )
        self.retriever, self.topk, self.max_turns = retriever, topk, max_turns
        self.format_reward, self.world = format_reward, world
        self.max_observation_tokens, self.max_context = max_observation_tokens, max_context
        self._train = [_example(r, row_prompt(r, instruction)) for r in train]
        self._eval = [_example(r, row_prompt(r, instruction)) for r in eval]

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def score(self, response: str, example: Example) -> float:
        answer = final_answer(response)
        if exact_match(answer, example.meta["golden_answers"]):
            return 1.0
        return self.format_reward if answer is not None else 0.0

    def metrics(self, responses: list[str], examples: list[Example]) -> dict[str, float]:
        """Mean F1, searches per episode (also by hop count when known), exact match per source."""
        groups: dict[str, list[float]] = defaultdict(list)
        for text, ex in zip(responses, examples, strict=True):
            answer, golds = final_answer(text), ex.meta["golden_answers"]
            searches = float(text.count(INFORMATION[0]))
            groups["search/f1"].append(f1(answer, golds))
            groups["search/calls_mean"].append(searches)
            groups[f"search/em/{ex.meta['data_source']}"].append(exact_match(answer, golds))
            if "hops" in ex.meta:
                groups[f"search/calls_mean/{ex.meta['hops']}hop"].append(searches)
        return {k: sum(v) / len(v) for k, v in groups.items()}

    def environment(self) -> SearchEnvironment:
        return SearchEnvironment(
            self.retriever,
            docs_per_search=self.topk,
            max_turns=self.max_turns,
            max_observation_tokens=self.max_observation_tokens,
            max_context=self.max_context,
        )

    def demonstrations(self) -> list[Example]:
        """Demonstration episodes for the warm start (built-in world only); inserted information is
        marked as not written by the model, so SFT does not learn it."""
        if self.world is None:
            raise EmapgError("search task: SFT demonstrations exist only for the built-in world")

        def information(query: str) -> str:
            return information_block(self.retriever.retrieve([query], self.topk)[0])

        out = []
        for ex in self._train:
            segments = synthetic.demonstration(self.world, ex.meta["person"], ex.meta["hops"], information)
            out.append(Example(ex.prompt, "".join(t for t, _ in segments), {**ex.meta, "segments": segments}))
        return out


def from_config(inputs: TaskInputs) -> SearchTask:
    """The search task of a `task` section: parquet data with the given corpus/server, or the built-in world."""
    from emapg.tasks.search.retriever import make_retriever

    t = inputs.task
    episodes = {
        "topk": t.topk,
        "max_turns": t.max_turns,
        "format_reward": t.format_reward,
        "max_observation_tokens": t.max_observation_tokens,
        "max_context": t.max_context,
    }
    if t.train_file:
        train, eval = load_parquet(t.train_file), load_parquet(t.eval_file)
        retriever = make_retriever(
            t.corpus, t.url, t.max_queries_per_request, t.max_query_chars, t.busy_timeout_s
        )
        return SearchTask(
            retriever, train[: t.num_train], eval[: t.num_eval], instruction=INSTRUCTION, **episodes
        )
    world = synthetic.build_world(t.seed, t.world_people, t.world_cities)
    rows = synthetic.questions(world)
    random.Random(f"search-split-{t.seed}").shuffle(rows)
    if t.num_eval >= len(rows):
        raise EmapgError(f"task.num_eval={t.num_eval}: the built-in world has only {len(rows)} questions")
    where = inputs.cache_dir / f"search-world-{t.seed}-{t.world_people}-{t.world_cities}"
    corpus = synthetic.write_corpus(world, where / "corpus.jsonl")
    retriever = make_retriever(
        str(corpus), t.url, t.max_queries_per_request, t.max_query_chars, t.busy_timeout_s
    )
    return SearchTask(
        retriever, rows[t.num_eval :][: t.num_train], rows[: t.num_eval], world=world, **episodes
    )


def warm_start(task: SearchTask):
    """The built-in model's warm start: demonstration episodes of the built-in world."""
    return WarmStartRecipe(task, task.demonstrations(), extra_chars=TINY_EXTRA_CHARS)
