"""The search protocol's tags, and SQuAD-style answer metrics.

The model writes `<search> query </search>` to ask the environment, which answers with
`<information> ... </information>` (or `INVALID_ACTION` after a turn with neither tag);
`<answer> ... </answer>` ends the episode. Parsing is plain
string search (no regular expressions), so it is linear in the text and cannot raise.
"""

from __future__ import annotations

import collections
import re
import string

SEARCH = ("<search>", "</search>")
ANSWER = ("<answer>", "</answer>")
INFORMATION = ("<information>", "</information>")
STOP = [SEARCH[1], ANSWER[1]]  # a model turn ends at either closing tag (or EOS)
# Inserted after a turn with neither a search nor an answer: Search-R1's message, word for word,
# since it is part of what the policy reads (and of what a Search-R1-trained model expects).
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between "
    "<answer> and </answer>. Let me try again.\n"
)


def last_tag(text: str, tags: tuple[str, str]) -> str | None:
    """The content of the last complete `open ... close` pair in `text`, stripped; None if none."""
    end = text.rfind(tags[1])
    if end < 0:
        return None
    start = text.rfind(tags[0], 0, end)
    return None if start < 0 else text[start + len(tags[0]) : end].strip()


def turn_action(turn: str) -> tuple[str, str | None]:
    """What a model turn asks for: ("answer", text), ("search", query) or ("stop", None).

    The turn ends at its first closing tag, so the last complete pair is the one it closed.
    """
    answer, query = last_tag(turn, ANSWER), last_tag(turn, SEARCH)
    if answer is not None and turn.rstrip().endswith(ANSWER[1]):
        return "answer", answer
    if query is not None and turn.rstrip().endswith(SEARCH[1]):
        return "search", query
    return "stop", None


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(prediction: str | None, golds: list[str]) -> float:
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golds))


def f1(prediction: str | None, golds: list[str]) -> float:
    """Best token-overlap F1 of the prediction against any gold answer (SQuAD)."""
    if prediction is None:
        return 0.0
    best = 0.0
    pred = normalize_answer(prediction).split()
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
        if common:
            precision, recall = common / len(pred), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
