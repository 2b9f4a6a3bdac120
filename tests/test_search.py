"""Agentic search: tags, QA metrics, retrieval over HTTP, multi-turn rollouts and state masking."""

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

import emapg
from conftest import engine_old, http
from emapg.algo.policy_loss import aggregate
from emapg.cli import main
from emapg.errors import EmapgError
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams, eos_ids
from emapg.rollout.hf import HFEngine
from emapg.rollout.multiturn import run_episodes
from emapg.tasks.base import Example
from emapg.tasks.search.answers import (
    INVALID_ACTION,
    exact_match,
    f1,
    last_tag,
    normalize_answer,
    turn_action,
)
from emapg.tasks.search.bm25 import BM25Retriever
from emapg.tasks.search.environment import SearchEnvironment, information_block
from emapg.tasks.search.retriever import HttpRetriever, format_information
from emapg.tasks.search.server import MAX_QUERIES, MAX_QUERY_CHARS, body_cap, make_server
from emapg.tasks.search.task import TINY_EXTRA_CHARS, SearchTask, final_answer, load_parquet
from emapg.tasks.search.world import build_world, questions, write_corpus
from emapg.training.config import Config, load_config
from emapg.training.sft import IGNORE_INDEX, sft_batch
from emapg.training.update import token_losses


def search_rollout(model, tok, prompts, retriever, *, docs_per_search, max_turns, **params):
    """Search episodes through the HF engine and the search environment."""
    env = SearchEnvironment(retriever, docs_per_search=docs_per_search, max_turns=max_turns)
    return run_episodes(
        HFEngine(model, tok),
        env,
        tok,
        prompts,
        encode_prompts(tok, prompts),
        SamplingParams(**params),
        eos=eos_ids(model, tok),
    )


# --- tags and metrics ---------------------------------------------------------------------------


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


# --- retrieval ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = build_world(seed=0, num_people=20, num_cities=4)
    corpus = write_corpus(w, tmp_path_factory.mktemp("world") / "corpus.jsonl")
    return w, BM25Retriever(corpus)


def test_world_questions_and_bm25_find_each_person(world):
    w, retriever = world
    qs = questions(w)
    assert len(qs) == 40 and {q["hops"] for q in qs} == {1, 2}
    for q in qs:
        p = w["people"][q["person"]]
        city = p["city"] if q["hops"] == 1 else w["people"][p["boss"]]["city"]
        assert q["golden_answers"] == [city]
    for person in w["people"]:
        assert retriever.retrieve([person], 1)[0][0]["contents"].startswith(f"{person}\n")
    assert (retriever.index_dir / "meta.json").is_file()  # built once, saved beside the corpus


@pytest.fixture(scope="module")
def server(world):
    srv = make_server(world[1], port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/retrieve"
    srv.shutdown()
    srv.server_close()


def test_server_and_client_round_trip(world, server):
    w, retriever = world
    names = sorted(w["people"])[:3]
    assert HttpRetriever(server).retrieve(names, 2) == retriever.retrieve(names, 2)
    status, _, data = http(server, json.dumps({"queries": names[:1], "topk": 2}).encode())
    assert status == 200 and data["result"] == [retriever.retrieve(names[:1], 2)[0]]  # no scores
    status, _, data = http(
        server, json.dumps({"queries": names[:1], "topk": 1, "return_scores": True}).encode()
    )
    assert set(data["result"][0][0]) == {"document", "score"} and data["result"][0][0]["score"] > 0


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"queries": "abc"}', "list of strings"),
        (b'{"queries": ["a"], "topk": 0}', "topk"),
    ],
)
def test_malformed_requests_get_400(server, body, message):
    status, _, data = http(server, body)
    assert status == 400 and message in data["error"]


def test_oversized_body_is_refused_before_reading(server):
    import http.client
    from urllib.parse import urlparse

    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
    conn.putrequest("POST", u.path)
    cap = body_cap(MAX_QUERIES, MAX_QUERY_CHARS)
    conn.putheader("Content-Length", str(cap + 1))
    conn.endheaders()
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 413 and f"body of {cap + 1} bytes; at most {cap}" in error
    assert f"{MAX_QUERIES} queries per request (--max-queries)" in error
    assert f"{MAX_QUERY_CHARS} characters per query (--max-query-chars)" in error
    conn.close()


def test_serve_retriever_command_round_trips(world, tmp_path):
    """`emapg serve-retriever` in a subprocess on a free port answers like the in-process BM25."""
    w, retriever = world
    corpus = write_corpus(w, tmp_path / "corpus.jsonl")
    cmd = [sys.executable, "-m", "emapg", "serve-retriever", "--corpus", str(corpus), "--port", "0"]
    src = str(Path(emapg.__file__).parents[1])  # the emapg under test, not another installed one
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {len(retriever.docs)} documents at http://127.0.0.1:"), (
            proc.stderr.read()
        )
        names = sorted(w["people"])[:2]
        assert HttpRetriever(line.split()[-1]).retrieve(names, 2) == retriever.retrieve(names, 2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_serve_retriever_bad_corpus_is_one_line(tmp_path, capsys):
    assert main(["serve-retriever", "--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.strip().endswith("none.jsonl': no such file")


def test_client_error_from_server_is_one_line(server):
    with pytest.raises(EmapgError, match="HTTP 400") as e:
        HttpRetriever(server).retrieve([""] * 2000, 1000)
    assert "\n" not in str(e.value) and "'topk' must be an integer" in str(e.value)


def test_dead_server_gives_a_clear_error_after_retries(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    attempts = []
    real = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: attempts.append(1) or real(*a, **k))
    client = HttpRetriever(f"http://127.0.0.1:{port}/retrieve", retries=2, backoff_s=0.01)
    with pytest.raises(EmapgError, match=r"no answer after 3 attempts"):
        client.retrieve(["q"], 3)
    assert len(attempts) == 3


# --- multi-turn rollout and masking -------------------------------------------------------------


class ScriptedLM(LlamaForCausalLM):
    """Emits a fixed first turn, then after any inserted information a fixed second turn, then EOS.

    Generation feeds the whole prompt once and then one token at a time, so the sequences seen
    so far are kept here and the next token is read off the script."""

    script: tuple[str, str] = ("", "")

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        tok = self.tokenizer
        self.seen = input_ids if input_ids.shape[1] > 1 else torch.cat([self.seen, input_ids], 1)
        logits = torch.full_like(out.logits[:, -1:], -30.0)
        for b, row in enumerate(self.seen.tolist()):
            text = tok.decode(row, skip_special_tokens=True).split("\n", 1)[1]  # after the prompt line
            turn, done = (
                (self.script[1], text.rpartition("</information>\n\n")[2])
                if "</information>" in text
                else (self.script[0], text)
            )
            nxt = tok.eos_token_id if len(done) >= len(turn) else tok.convert_tokens_to_ids(turn[len(done)])
            logits[b, 0, nxt] = 0.0
        out.logits = logits
        return out


class DictRetriever:
    def __init__(self, docs):
        self.docs, self.queries = docs, []

    def retrieve(self, queries, topk):
        self.queries += queries
        return [[self.docs[q]] for q in queries]


def test_scripted_two_turn_episode_masks_exactly_the_inserted_tokens():
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    base = build_tiny_model(tok, max_position_embeddings=256)
    model = ScriptedLM(base.config)
    model.generation_config = base.generation_config
    model.tokenizer = tok
    model.script = ("<search>gida</search>", "<answer>nube</answer>")
    doc = {"id": "0", "contents": "gida\ngida lives in nube."}
    retriever = DictRetriever({"gida": doc})
    out = search_rollout(
        model, tok, ["who?\n", "who?\n"], retriever, docs_per_search=1, max_turns=2, max_new_tokens=120,
        temperature=1.0, topk=3,
    )  # fmt: skip
    parts = [
        ("<search>gida</search>", True),
        (information_block([doc]), False),
        ("<answer>nube</answer>", True),
    ]
    # The episode ends at the closing </answer> tag, before the EOS the script would write next.
    ids = [i for text, _ in parts for i in tok(text, add_special_tokens=False)["input_ids"]]
    mask = [m for text, m in parts for _ in tok(text, add_special_tokens=False)["input_ids"]]
    assert retriever.queries == ["gida", "gida"]
    for row in range(2):
        assert out.responses[row].tolist() == ids
        assert out.response_mask[row].tolist() == mask
        assert out.attention_mask[row, out.prompt_len :].tolist() == [1] * len(ids)  # info is attended to
    # Model tokens carry their real sampling log-prob (about 0 here: one logit at 0, the rest at -30).
    assert (
        out.sampling_logp[out.response_mask].max() <= 0 and out.sampling_logp[out.response_mask].min() > -1e-6
    )
    assert (out.sampling_logp[~out.response_mask] == 0).all() and (
        out.topk_ids[~out.response_mask] == 0
    ).all()
    assert out.texts[0] == "".join(t for t, _ in parts)
    task = SearchTask(retriever, [], [])
    ex = Example("who?\n", "nube", {"golden_answers": ["nube"], "data_source": "w"})
    assert task.score(out.texts[0], ex) == 1.0
    assert task.metrics(out.texts, [ex, ex]) == {
        "search/f1": 1.0,
        "search/calls_mean": 1.0,
        "search/em/w": 1.0,
    }


def test_search_limit_ends_the_episode():
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    base = build_tiny_model(tok, max_position_embeddings=256)
    model = ScriptedLM(base.config)
    model.generation_config, model.tokenizer = base.generation_config, tok
    model.script = ("<search>gida</search>", "<search>gida</search>")  # searches forever
    retriever = DictRetriever({"gida": {"id": "0", "contents": "gida\nx."}})
    out = search_rollout(
        model, tok, ["who?\n"], retriever, docs_per_search=1, max_turns=2, max_new_tokens=200
    )
    assert len(retriever.queries) == 2 and out.texts[0].count("<search>") == 3


class NoisyAtMasked(torch.nn.Module):
    """The wrapped model's logits, plus large noise wherever the next token is masked out."""

    def __init__(self, model, noise):
        super().__init__()
        self.inner, self.noise, self.config = model, noise, model.config

    def get_output_embeddings(self):
        return None  # not a plain linear head: the trainer uses these full logits

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = out.logits + self.noise
        return out


def test_loss_and_kl_ignore_masked_tokens():
    torch.manual_seed(0)
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    policy = build_tiny_model(tok, max_position_embeddings=64, seed=1)
    anchor = build_tiny_model(tok, max_position_embeddings=64, seed=2)
    n, p, length, vocab = 3, 4, 10, len(tok)
    seq = torch.randint(4, vocab, (n, p + length))
    mask = torch.rand(n, length) < 0.5
    mask[:, 0] = True
    from emapg.batch import Rollout

    batch = Rollout(
        sequences=seq, attention_mask=torch.ones_like(seq), prompt_len=p, response_mask=mask,
        sampling_logp=torch.randn(n, length).clamp(max=0), topk_ids=torch.randint(0, vocab, (n, length, 4)),
        entropy=torch.zeros(n, length), texts=["."] * n,
        truncated=torch.zeros(n, dtype=torch.bool),
    )  # fmt: skip
    cfg = Config()
    cfg.kl.k = 4
    from emapg.model.anchor import Anchor
    from emapg.training.update import anchor_pass

    old = engine_old(batch)
    ref = anchor_pass(cfg, Anchor(anchor, 1.0, 1), batch, old, vocab)
    advantages = torch.randn(n)

    def loss_and_grad(noise_scale):
        noise = torch.zeros(n, p + length, vocab)
        # The logits at column P + t - 1 predict response token t: disturb those of masked tokens.
        noise[:, p - 1 : -1][~mask] = noise_scale * torch.randn(int((~mask).sum()), vocab)
        policy.zero_grad()
        pg, kl_tok, *_ = token_losses(cfg, NoisyAtMasked(policy, noise), batch, advantages, old, ref)
        loss = aggregate(pg + 0.1 * kl_tok, mask, "token_mean", float(mask.sum()))
        loss.backward()
        return loss.detach(), [q.grad.clone() for q in policy.parameters()]

    clean_loss, clean_grads = loss_and_grad(0.0)
    noisy_loss, noisy_grads = loss_and_grad(50.0)
    assert torch.equal(clean_loss, noisy_loss)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=0) for a, b in zip(clean_grads, noisy_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in clean_grads)


def test_sft_masks_inserted_information():
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    segments = [
        ("<search>a</search>", True),
        ("\n<information>x</information>\n", False),
        ("<answer>b</answer>", True),
    ]
    ex = Example("q\n", "".join(t for t, _ in segments), {"segments": segments})
    batch = sft_batch(tok, [ex])
    labels = batch["labels"][0].tolist()
    prompt = len(tok("q\n")["input_ids"])
    sizes = [len(tok(t, add_special_tokens=False)["input_ids"]) for t, _ in segments]
    learn = [m for (_, m), s in zip(segments, sizes, strict=True) for _ in range(s)] + [True]
    assert [lab != IGNORE_INDEX for lab in labels] == [False] * prompt + learn
    assert tok.decode(batch["input_ids"][0], skip_special_tokens=True) == "q\n" + ex.answer


# --- data and configuration ---------------------------------------------------------------------


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


def test_the_episode_cap_must_fit_the_models_context():
    from types import SimpleNamespace

    from emapg.training.setup import check_context

    cfg = load_config("search_tiny")
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256))
    examples = [Example("who?\n", "a", {})]
    task = SearchTask(DictRetriever({}), [], [], max_context=320)
    with pytest.raises(EmapgError, match=r"max_context=320 \(task.max_context .* context of 256$"):
        check_context(cfg, model, tok, examples, task)
    task.max_context = 60  # a 6-token prompt and a 64-token turn do not fit
    with pytest.raises(EmapgError, match="max_new_tokens=64 it exceeds the episode cap max_context=60$"):
        check_context(cfg, model, tok, examples, task)
    task.max_context = 70
    check_context(cfg, model, tok, examples, task)


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
