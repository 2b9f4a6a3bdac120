"""The search task's answers (emapg.tasks.search.answers, .task.final_answer): the turn's action,
the final answer, SQuAD's EM and F1, and property tests of the tag parser."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emapg.tasks.search.answers import (
    INVALID_ACTION,
    exact_match,
    f1,
    last_tag,
    normalize_answer,
    turn_action,
)
from emapg.tasks.search.task import final_answer


def test_em_and_f1_by_hand():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an Eiffel-Tower") == "eiffeltower"  # SQuAD deletes punctuation
    assert exact_match("the eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("eiffel", ["Eiffel Tower", "Paris"]) == 0.0
    assert exact_match("  PARIS ", ["Eiffel Tower", "Paris"]) == 1.0
    assert exact_match(None, ["x"]) == 0.0
    # "eiffel" vs "eiffel tower": precision 1, recall 1/2 -> F1 2/3; the best gold counts.
    assert f1("eiffel", ["eiffel tower"]) == pytest.approx(2 / 3)
    assert f1("a big red dog", ["red cat", "big dog"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1("nothing", ["else"]) == 0.0 and f1("the", ["a"]) == 0.0


def test_turn_actions_and_final_answer():
    assert turn_action("think <search> who is x </search>") == ("search", "who is x")
    assert turn_action("<answer> rome </answer>") == ("answer", "rome")
    assert turn_action("no tags at all") == ("stop", None)
    assert turn_action("<search>a</search> trailing") == ("stop", None)
    # An answer inside retrieved text is not the model's.
    assert final_answer("<information><answer>x</answer></information>\n") is None
    assert final_answer("<information>y</information>\n<answer>z</answer>") == "z"
    # The invalid-action message's example tags are the environment's, whole or cut.
    assert final_answer(f"x{INVALID_ACTION}") is None
    assert final_answer(f"x{INVALID_ACTION[:-12]}") is None
    assert final_answer(f"x{INVALID_ACTION}<answer>z</answer>") == "z"
    assert final_answer(f"<answer>a</answer>{INVALID_ACTION}<answer>z</answer>") == "z"


tag_text = st.lists(
    st.sampled_from(
        [
            "<search>",
            "</search>",
            "<answer>",
            "</answer>",
            "<information>",
            "</information>",
            "<",
            ">",
            "a b",
            "/",
        ]
    )
    | st.text(max_size=8),
    max_size=40,
).map("".join)


@pytest.mark.slow
@settings(max_examples=300, deadline=200)
@given(tag_text)
def test_tag_parser_never_raises_or_hangs(text):
    action, content = turn_action(text)
    assert action in ("search", "answer", "stop")
    assert (content is None) == (action == "stop")
    last_tag(text, ("<search>", "</search>"))
    final_answer(text)
    assert 0.0 <= f1(final_answer(text), ["a b"]) <= 1.0


@given(st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=30))
def test_a_closed_search_returns_its_query(query):
    assert turn_action(f"x<search>{query}</search>") == ("search", query.strip())
