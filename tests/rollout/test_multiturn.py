"""Multi-turn rollouts (emapg.rollout.multiturn): the engine protocol, the loop over any engine and
environment with exact masks, rows and response budgets, Search-R1's episode rules, and scripted
search episodes through the HF engine (inserted text masked, the search limit)."""

import pytest
import torch

from emapg.model.models import build_tiny_model, build_tiny_tokenizer, load_model_and_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import Rollout, RolloutEngine, SamplingParams, eos_ids, left_pad
from emapg.rollout.hf import HFEngine
from emapg.rollout.multiturn import run_episodes, sample_examples
from emapg.tasks.base import Environment, Example
from emapg.tasks.search.environment import INVALID_ACTION, SearchEnvironment, information_block
from emapg.tasks.search.task import TINY_EXTRA_CHARS, SearchTask
from helpers import DictRetriever, ScriptedLM


class ScriptedEngine:
    """Answers each row with the next text of its script (EOS appended when the text ends in
    "."), cut to the call's max_new_tokens; log-prob -0.5 per token, top-k ids 1..k."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]]):
        self.tokenizer, self.scripts, self.calls = tokenizer, {r: list(s) for r, s in scripts.items()}, []

    def sample(self, prompt_ids, params, *, rows=None) -> Rollout:
        self.calls.append((list(rows), [list(p) for p in prompt_ids], params.max_new_tokens))
        tok = self.tokenizer
        responses = []
        for row in rows:
            text = self.scripts[row].pop(0)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ids = (ids + [tok.eos_token_id] if text.endswith(".") else ids)[: params.max_new_tokens]
            responses.append(ids)
        prompts, prompt_mask = left_pad(prompt_ids, tok.pad_token_id)
        width = max(map(len, responses))
        body = torch.full((len(rows), width), tok.pad_token_id)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(responses):
            body[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        k = params.topk
        return Rollout(
            sequences=torch.cat([prompts, body], 1), attention_mask=torch.cat([prompt_mask, mask.long()], 1),
            prompt_len=prompts.shape[1], response_mask=mask, sampling_logp=torch.where(mask, -0.5, 0.0),
            topk_ids=torch.arange(1, k + 1).expand(len(rows), width, k).clone(), entropy=mask.float(),
            texts=[tok.decode(r, skip_special_tokens=True) for r in responses],
            truncated=torch.tensor([len(r) == params.max_new_tokens and r[-1] != tok.eos_token_id for r in responses]),
        )  # fmt: skip

    def sync_weights(self, model, version):
        pass

    def sleep(self):
        pass

    def close(self):
        pass


class ScriptedEnvironment:
    """Inserts "(ok)" after a turn that ends in "?" (at most twice per episode); anything else ends it."""

    stop = ("?",)
    max_context = max_observation_tokens = None

    def reset(self, prompts):
        self.prompts, self.answered, self.seen = list(prompts), [0] * len(prompts), []

    def step(self, episodes, turns):
        self.seen.append((list(episodes), list(turns)))
        out = []
        for i, turn in zip(episodes, turns, strict=True):
            ok = turn.endswith("?") and self.answered[i] < 2
            self.answered[i] += ok
            out.append("(ok)" if ok else None)
        return out


def test_engines_satisfy_the_protocol(tiny_model_dir):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    assert isinstance(HFEngine(model, tok), RolloutEngine)
    assert isinstance(ScriptedEngine(tok, {}), RolloutEngine)
    assert isinstance(ScriptedEnvironment(), Environment)
    assert isinstance(SearchEnvironment(None, docs_per_search=1, max_turns=1), Environment)


def test_multiturn_loop_drives_any_engine_with_exact_masks_rows_and_response_budget():
    tok = build_tiny_tokenizer()
    scripts = {
        10: ["a?", "b?", "c?"],  # two answers, then the environment ends it
        11: ["done."],  # EOS: the environment is not asked
        12: ["why?", "long tail here"],  # the second turn hits the episode's response budget
    }
    engine, env = ScriptedEngine(tok, scripts), ScriptedEnvironment()
    prompts = ["p:", "q:", "r:"]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    out = run_episodes(
        engine, env, tok, prompts, prompt_ids, SamplingParams(max_new_tokens=16, topk=2),
        eos=[tok.eos_token_id], rows=[10, 11, 12], max_response_tokens=16,
    )  # fmt: skip
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    want = [
        [("a?", True), ("(ok)", False), ("b?", True), ("(ok)", False), ("c?", True)],
        [("done.", True)],
        [("why?", True), ("(ok)", False), ("long tai", True)],  # cut at the episode's 16 tokens
    ]
    for row, parts in enumerate(want):
        tokens = [t for text, _ in parts for t in ids(text)]
        mask = [m for text, m in parts for _ in ids(text)]
        if row == 1:
            tokens, mask = tokens + [tok.eos_token_id], mask + [True]
        n = len(tokens)
        assert out.responses[row, :n].tolist() == tokens
        assert out.response_mask[row].tolist() == mask + [False] * (out.response_mask.shape[1] - n)
        assert out.attention_mask[row, out.prompt_len :].tolist()[:n] == [1] * n
        assert out.sampling_logp[row, :n].tolist() == [-0.5 if m else 0.0 for m in mask]
        assert out.topk_ids[row, :n].tolist() == [[1, 2] if m else [0, 0] for m in mask]
    # Each turn samples only the active episodes, under their own global rows, from their ids so far,
    # with the budget they have left; the environment sees the decoded turns.
    assert [c[0] for c in engine.calls] == [[10, 11, 12], [10, 12], [10]]
    assert engine.calls[1][1][0] == prompt_ids[0] + ids("a?(ok)")
    assert [c[2] for c in engine.calls] == [16, 16 - 6, 16 - 12]
    assert env.seen == [([0, 2], ["a?", "why?"]), ([0], ["b?"]), ([0], ["c?"])]
    assert out.texts == ["a?(ok)b?(ok)c?", "done.", "why?(ok)long tai"]
    assert out.truncated.tolist() == [False, False, True]  # only the last one ran out of tokens


def test_search_r1_episode_rules_turn_limit_truncation_invalid_message_and_context_cap():
    """Search-R1's rules: 24 new tokens per turn, inserted text cut to 30 tokens, prompt + episode
    capped at 140 tokens, two rounds with the environment, then a final answer turn."""
    tok = build_tiny_tokenizer(TINY_EXTRA_CHARS)  # one token per character
    docs = {q: {"id": q, "contents": f"{q}\n{q} lives in nube, boss kaso."} for q in ("gida", "nube")}
    retriever = DictRetriever(docs)
    env = SearchEnvironment(
        retriever, docs_per_search=1, max_turns=2, max_observation_tokens=30, max_context=140
    )
    search, answer = "<search>gida</search>", "<answer>nube</answer>"  # 21 tokens each
    scripts = {
        0: [search, "x" * 40, answer],  # search, an invalid turn cut at 24 tokens, the final answer
        1: [search, "<search>nube</search>"],  # the second passages fill the context: the end
        2: [search, "y" * 40],  # the second turn gets only the 13 tokens of room left: the end
    }
    prompts = ["q?\n", "b" * 56 + "\n", "c" * 74 + "\n"]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    assert [len(p) for p in prompt_ids] == [4, 58, 76]  # <bos> + characters
    engine = ScriptedEngine(tok, scripts)
    out = sample_examples(
        engine, tok, _EnvTask(env), [Example(p, "") for p in prompts],
        SamplingParams(max_new_tokens=24, topk=2), chat_template=False, eos=[tok.eos_token_id],
    )  # fmt: skip
    info = information_block([docs["gida"]])
    assert info.startswith("\n\n<information>Doc 1(Title: gida) gida lives")
    want = [
        [(search, True), (info[:30], False), ("x" * 24, True), (INVALID_ACTION[:30], False), (answer, True)],
        [(search, True), (info[:30], False), ("<search>nube</search>", True),
         (information_block([docs["nube"]])[:10], False)],  # 58 + 21 + 30 + 21 + 10 = 140
        [(search, True), (info[:30], False), ("y" * 13, True)],  # 76 + 21 + 30 + 13 = 140
    ]  # fmt: skip
    assert INVALID_ACTION[:30] == "\nMy previous action is invalid"
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for row, parts in enumerate(want):
        tokens = [t for text, _ in parts for t in ids(text)]
        mask = [m for text, m in parts for _ in ids(text)]
        n, width = len(tokens), out.response_mask.shape[1]
        assert out.responses[row, :n].tolist() == tokens
        assert out.response_mask[row].tolist() == mask + [False] * (width - n)  # inserted text masked
        assert out.attention_mask[row, out.prompt_len :].tolist() == [1] * n + [0] * (width - n)
        assert out.sampling_logp[row, :n].tolist() == [-0.5 if m else 0.0 for m in mask]
        assert out.texts[row] == "".join(text for text, _ in parts)
    assert [len(p) + int(out.attention_mask[r, out.prompt_len :].sum()) for r, p in enumerate(prompt_ids)] == [
        4 + 126, 140, 140,
    ]  # fmt: skip
    # Each turn asks for the per-turn limit, or less when no active episode has that much room;
    # the first episode's third turn is its last (the environment answers nothing after two
    # rounds), the third episode's second turn filled the context and never reached the environment.
    assert [(c[0], c[2]) for c in engine.calls] == [([0, 1, 2], 24), ([0, 1, 2], 24), ([0], 24)]
    assert env.turns == [3, 2, 1] and env.searches == [1, 2, 1]
    assert retriever.queries == ["gida", "gida", "gida", "nube"]


class _EnvTask:
    """Just enough of a task for `sample_examples`: its environment."""

    def __init__(self, env):
        self.env = env

    def environment(self):
        return self.env


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


@pytest.mark.slow
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


@pytest.mark.slow
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
