"""`emapg eval --protocol paper-search`: Search-R1 data split by source, episodes through the
retriever, exact match and F1 per dataset, checked on a scripted model whose answers are known."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emapg.cli import main
from emapg.eval import files as eval_files
from emapg.eval import search as search_eval
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.rollout import eos_ids
from emapg.rollout.hf import HFEngine
from emapg.tasks.search.task import TINY_EXTRA_CHARS
from helpers import ScriptedLM

ROWS = [  # the scripted model searches "gida" and answers "nube the city" to everything
    {"question": "where does gida live?", "golden_answers": ["nube the city"], "data_source": "nq"},
    {"question": "where does gida work?", "golden_answers": ["paris"], "data_source": "nq"},
    {"question": "which city?", "golden_answers": ["the nube"], "data_source": "hotpotqa"},
]


@pytest.fixture
def search_data(tmp_path, monkeypatch):
    data, corpus = tmp_path / "test.parquet", tmp_path / "corpus.jsonl"
    pq.write_table(pa.Table.from_pylist(ROWS), data)
    corpus.write_text(json.dumps({"id": "0", "contents": "gida\ngida lives in nube."}) + "\n")
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    base = build_tiny_model(tok, max_position_embeddings=512)
    base.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    model = ScriptedLM(base.config)
    model.generation_config, model.tokenizer = base.generation_config, tok
    model.script = ("<search>gida</search>", "<answer>nube the city</answer>")

    def scripted(model_path, settings, device):
        return HFEngine(model, tok), tok, eos_ids(model, tok), 512

    monkeypatch.setattr(eval_files, "make_engine", scripted)
    return tmp_path, data, corpus


@pytest.mark.slow
def test_search_protocol_grades_each_source(search_data, capsys):
    tmp_path, data, corpus = search_data
    argv = ["eval", "--protocol", "paper-search", "--model", str(tmp_path / "model"), "--data", str(data),
            "--corpus", str(corpus), "--no-chat-template", "--no-progress", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert (
        results["settings"]["greedy"] and results["settings"]["topk"] == 3 and results["settings"]["n"] == 1
    )
    nq, hotpot = results["datasets"]["nq"], results["datasets"]["hotpotqa"]
    assert nq["questions"] == 2 and hotpot["questions"] == 1
    # "nube the city" is the first gold exactly, not "paris"; against "the nube" (articles dropped:
    # "nube") exact match fails and F1 is 2 * (1/2 * 1) / (1/2 + 1) = 2/3.
    assert nq["exact_match"] == 0.5 and nq["f1"] == 0.5
    assert hotpot["exact_match"] == 0.0 and hotpot["f1"] == pytest.approx(2 / 3)
    assert nq["searches_mean"] == hotpot["searches_mean"] == 1.0  # one search, through the BM25 index
    rows = [json.loads(line) for line in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert all("gida lives in nube." in r["response"] for r in rows)
    assert results["mean"]["exact_match"] == pytest.approx(0.25) and results["mean"]["questions"] == 3
    assert capsys.readouterr().out.splitlines()[0].split() == ["dataset", "questions", "EM", "F1", "searches",
                                                                "mean", "length", "(tokens)"]  # fmt: skip


def test_search_protocol_needs_one_retriever(search_data, capsys):
    tmp_path, data, corpus = search_data
    argv = ["eval", "--protocol", "paper-search", "--model", str(tmp_path / "model"), "--data", str(data),
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    assert "give one of --retriever-url and --corpus" in capsys.readouterr().err
    with pytest.raises(Exception, match="greedy decoding draws one response"):
        settings = search_eval.SearchEvalSettings(corpus=str(corpus), greedy=True, n=2)
        search_eval.evaluate(str(tmp_path / "model"), [str(data)], str(tmp_path / "o"), settings)
