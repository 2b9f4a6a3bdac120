"""The search task (emapg.tasks.search.task): its parquet data and prompts, the format reward and
the passages' text, and its settings."""

import pytest

from emapg.errors import EmapgError
from emapg.model.models import build_tiny_tokenizer
from emapg.prompts import encode_prompts
from emapg.tasks.base import Example
from emapg.tasks.search.environment import information_block
from emapg.tasks.search.retriever import format_information
from emapg.tasks.search.task import TINY_EXTRA_CHARS, SearchTask, load_parquet
from emapg.training.config import load_config
from helpers import DictRetriever


def test_parquet_loader_and_exact_match_per_source(tmp_path, world):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"question": "who?", "golden_answers": ["Ann", "Anne"], "data_source": "nq"},
        {"question": "where?", "golden_answers": ["Rome"], "data_source": "hotpotqa"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    loaded = load_parquet(str(tmp_path / "d.parquet"))
    assert [r["golden_answers"] for r in loaded] == [["Ann", "Anne"], ["Rome"]]
    task = SearchTask(world[1], loaded, loaded, instruction="Q: ")
    exs = task.eval_examples()
    assert exs[0].prompt == "Q: who?\n"
    m = task.metrics(["<answer>anne</answer>", "<answer>paris</answer>"], exs)
    assert m["search/em/nq"] == 1.0 and m["search/em/hotpotqa"] == 0.0
    with pytest.raises(EmapgError, match="missing columns"):
        pq.write_table(pa.Table.from_pylist([{"q": "x"}]), tmp_path / "bad.parquet")
        load_parquet(str(tmp_path / "bad.parquet"))


def test_the_datas_prompt_column_is_the_prompt(tmp_path, world):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    full = "Answer the given question... Question: who?\n"
    rows = [
        {"question": "who?", "golden_answers": ["Ann"], "prompt": [{"role": "user", "content": full}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    loaded = load_parquet(str(tmp_path / "d.parquet"))
    task = SearchTask(world[1], loaded, loaded, instruction="Q: ")
    assert [e.prompt for e in task.train_examples() + task.eval_examples()] == [full, full]
    # Encoded as Search-R1's loader does: the chat template when the tokenizer has one.
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"
    assert tok.decode(encode_prompts(tok, [full])[0]) == f"<user>{full}<a>"
    assert tok.decode(encode_prompts(tok, [full], chat_template=False)[0], skip_special_tokens=True) == full
    rows[0]["prompt"] = [{"role": "system", "content": "x"}, {"role": "user", "content": full}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "two.parquet")
    with pytest.raises(EmapgError, match="row 0's prompt is not one user message with content"):
        load_parquet(str(tmp_path / "two.parquet"))


def test_format_reward_and_information_text():
    task = SearchTask(DictRetriever({}), [], [], format_reward=0.2)
    ex = Example("q", "a", {"golden_answers": ["a"], "data_source": "s"})
    assert [task.score(r, ex) for r in ("<answer>a</answer>", "<answer>b</answer>", "b")] == [1.0, 0.2, 0.0]
    # Search-R1's passage format: numbered, title in parentheses, the whole stripped.
    docs = [{"contents": "T\nbody"}, {"contents": "U\ntwo\nlines"}, {"contents": "only"}]
    assert format_information(docs) == "Doc 1(Title: T) body\nDoc 2(Title: U) two\nlines\nDoc 3(Title: only)"
    assert information_block(docs[:1]) == "\n\n<information>Doc 1(Title: T) body</information>\n\n"


def test_search_config_validation(tmp_path):
    assert load_config("search_tiny").task.name == "search"
    with pytest.raises(EmapgError, match="task.train_file: '/path/to/train.parquet' does not exist"):
        load_config("search_qwen", [f"model.path={tmp_path}"])  # the placeholders must be set
    files = [tmp_path / n for n in ("t.parquet", "e.parquet", "c.jsonl")]
    for f in files:
        f.touch()
    keys = ("task.train_file", "task.eval_file", "task.corpus")
    qwen = load_config(
        "search_qwen", [f"model.path={tmp_path}"] + [f"{k}={f}" for k, f in zip(keys, files, strict=True)]
    )
    assert (qwen.task.topk, qwen.task.max_turns, qwen.rollout.group_size) == (3, 4, 5)
    with pytest.raises(EmapgError, match="task.train_file and task.eval_file"):
        load_config("search_tiny", ["task.train_file=x.parquet"])
    with pytest.raises(EmapgError, match="task.topk"):
        load_config("search_tiny", ["task.topk=0"])
