"""The synthetic world of the search tests and its BM25 retriever, built once per session (the tests
only read it: test_bm25.py, test_server.py, test_search_task.py)."""

import pytest

from emapg.tasks.search.bm25 import BM25Retriever
from emapg.tasks.search.world import build_world, write_corpus


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    w = build_world(seed=0, num_people=20, num_cities=4)
    corpus = write_corpus(w, tmp_path_factory.mktemp("world") / "corpus.jsonl")
    return w, BM25Retriever(corpus)
