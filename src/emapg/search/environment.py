"""The search environment: a turn that ends in `<search> query </search>` gets the retrieved
passages inserted as `<information> ... </information>`; any other turn ends the episode, and so
does a search past `max_turns` (the model then has no more turns)."""

from __future__ import annotations

from collections.abc import Sequence

from emapg.search.answers import INFORMATION, STOP, turn_action
from emapg.search.retriever import Retriever, format_information


def information_block(docs: list[dict]) -> str:
    """The text the environment inserts after a search."""
    return f"\n{INFORMATION[0]}{format_information(docs)}{INFORMATION[1]}\n"


class SearchEnvironment:
    """One batch of search episodes (the `emapg.rollout.multiturn.Environment` protocol)."""

    stop = tuple(STOP)

    def __init__(self, retriever: Retriever, *, docs_per_search: int, max_turns: int):
        self.retriever, self.docs_per_search, self.max_turns = retriever, docs_per_search, max_turns
        self.searches: list[int] = []

    def reset(self, prompts: Sequence[str]) -> None:
        self.searches = [0] * len(prompts)

    def step(self, episodes: Sequence[int], turns: Sequence[str]) -> list[str | None]:
        out: list[str | None] = [None] * len(episodes)
        asking, queries = [], []
        for j, (i, turn) in enumerate(zip(episodes, turns, strict=True)):
            action, query = turn_action(turn)
            if action == "search" and self.searches[i] < self.max_turns:
                asking.append(j)
                queries.append(query)
        for j, docs in zip(
            asking, self.retriever.retrieve(queries, self.docs_per_search) if asking else [], strict=True
        ):
            self.searches[episodes[j]] += 1
            out[j] = information_block(docs)
        return out
