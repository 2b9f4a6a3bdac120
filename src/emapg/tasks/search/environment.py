"""The search environment, with Search-R1's episode rules.

Each model turn is one round. In the first `max_turns` rounds a turn that ends in
`<search> query </search>` gets the retrieved passages inserted (`information_block`), a turn
with `<answer> ... </answer>` ends the episode, and any other turn (no complete tag pair, or cut
by the per-turn token limit) gets `INVALID_ACTION` inserted and the episode goes on. The round
after the `max_turns`-th is the final answer turn: nothing is inserted whatever the model writes,
and the episode ends. Inserted text is the environment's (response mask 0). The token limits
(`max_observation_tokens`, `max_context`) are applied by the multi-turn loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from emapg.tasks.search.answers import INFORMATION, INVALID_ACTION, STOP, turn_action
from emapg.tasks.search.retriever import Retriever, format_information


def information_block(docs: list[dict]) -> str:
    """The text the environment inserts after a search (Search-R1's spacing)."""
    return f"\n\n{INFORMATION[0]}{format_information(docs)}{INFORMATION[1]}\n\n"


class SearchEnvironment:
    """One batch of search episodes (the `emapg.tasks.base.Environment` protocol)."""

    stop = tuple(STOP)

    def __init__(
        self,
        retriever: Retriever,
        *,
        docs_per_search: int,
        max_turns: int,
        max_observation_tokens: int | None = None,
        max_context: int | None = None,
    ):
        self.retriever, self.docs_per_search, self.max_turns = retriever, docs_per_search, max_turns
        self.max_observation_tokens, self.max_context = max_observation_tokens, max_context
        self.turns: list[int] = []  # model turns seen per episode
        self.searches: list[int] = []

    def reset(self, prompts: Sequence[str]) -> None:
        self.turns, self.searches = [0] * len(prompts), [0] * len(prompts)

    def step(self, episodes: Sequence[int], turns: Sequence[str]) -> list[str | None]:
        out: list[str | None] = [None] * len(episodes)
        asking, queries = [], []
        for j, (i, turn) in enumerate(zip(episodes, turns, strict=True)):
            self.turns[i] += 1
            if self.turns[i] > self.max_turns:  # the final answer turn: nothing more is inserted
                continue
            action, query = turn_action(turn)
            if action == "search":
                asking.append(j)
                queries.append(query)
            elif action != "answer":
                out[j] = INVALID_ACTION
        for j, docs in zip(
            asking, self.retriever.retrieve(queries, self.docs_per_search) if asking else [], strict=True
        ):
            self.searches[episodes[j]] += 1
            out[j] = information_block(docs)
        return out
