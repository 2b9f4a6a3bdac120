"""A built-in synthetic world: people who live in cities and have bosses, and questions about them.

Every fact is random, so no model can know it: the answer must be looked up. A single-hop
question ("where does tavo live?") needs one search, a two-hop one ("where does the boss of
tavo live?") two: the boss's name is in tavo's passage, the city in the boss's. Names are
short and passages one line, so a whole two-search episode fits in ~200 characters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from emapg.tasks.search.answers import ANSWER, SEARCH

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2)))
    return sorted(names)


def build_world(seed: int, num_people: int, num_cities: int) -> dict:
    """{"people": {name: {"city", "boss"}}, "passages": [{"id", "contents"}]}, a function of the seed."""
    rng = random.Random(f"search-world-{seed}")
    names = _names(rng, num_people + num_cities)
    rng.shuffle(names)
    people, cities = names[:num_people], names[num_people:]
    world = {
        p: {"city": rng.choice(cities), "boss": rng.choice([q for q in people if q != p])} for p in people
    }
    passages = [
        {"id": str(i), "contents": f"{p}\n{p} lives in {f['city']}, boss {f['boss']}."}
        for i, (p, f) in enumerate(sorted(world.items()))
    ]
    return {"people": world, "passages": passages}


def questions(world: dict) -> list[dict]:
    """Every single-hop and two-hop question: {"question", "golden_answers", "data_source", "hops"}."""
    out = []
    for p, facts in sorted(world["people"].items()):
        out.append(
            {"question": f"where does {p} live?", "golden_answers": [facts["city"]], "hops": 1, "person": p}
        )
        boss_city = world["people"][facts["boss"]]["city"]
        out.append(
            {
                "question": f"where does the boss of {p} live?",
                "golden_answers": [boss_city],
                "hops": 2,
                "person": p,
            }
        )
    for q in out:
        q["data_source"] = f"world_{q['hops']}hop"
    return out


def demonstration(world: dict, person: str, hops: int, information) -> list[tuple[str, bool]]:
    """The ideal trajectory as (text, written by the model) segments, for SFT.

    `information(query)` is the text the environment inserts after that search."""
    segments: list[tuple[str, bool]] = []
    for name in [person, world["people"][person]["boss"]][:hops]:
        segments += [(f"{SEARCH[0]}{name}{SEARCH[1]}", True), (information(name), False)]
    target = person if hops == 1 else world["people"][person]["boss"]
    segments.append((f"{ANSWER[0]}{world['people'][target]['city']}{ANSWER[1]}", True))
    return segments


def write_corpus(world: dict, path: Path) -> Path:
    """Write the passages as a jsonl corpus, only when the contents differ (keeps the BM25 index)."""
    text = "".join(json.dumps(d) + "\n" for d in world["passages"])
    if not (path.is_file() and path.read_text() == text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path
