"""The vLLM engine's pure parts on CPU, with fakes shaped like vLLM's objects; the real engine
runs only where vLLM and a GPU are (and in benchmarks/gpu_check_vllm.py)."""

import importlib.util
import math
import os
from dataclasses import dataclass

import pytest
import torch

from emapg.config import load_config
from emapg.errors import EmapgError
from emapg.models import build_tiny_model, build_tiny_tokenizer
from emapg.rollout.vllm import VllmEngine, group_requests, push_weights, to_rollout, weights_to_push

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (the fields read here)
    token_ids: list
    logprobs: list


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    outputs: list


def sample(tokens, logits, temperature, k):
    """What vLLM returns in processed_logprobs mode: top-k of log softmax(logits / T) + the sampled token."""
    steps = []
    for token, row in zip(tokens, logits, strict=True):
        logp = torch.log_softmax(torch.tensor(row, dtype=torch.float64) / temperature, -1)
        rank = {int(t): r + 1 for r, t in enumerate(logp.argsort(descending=True))}
        keep = {t for t, r in rank.items() if r <= k} | {token}
        steps.append({t: Logprob(float(logp[t]), rank[t]) for t in keep})
    return CompletionOutput(tokens, steps)


def test_conversion_matches_enumeration_over_a_tiny_vocab():
    tok = build_tiny_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    a, b, c = tok.convert_tokens_to_ids(["1", "2", "+"])
    V, T, k = len(tok), 0.7, 2
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, V, generator=g).tolist()
    p0, p1 = [1, a, b], [1, c]  # ragged prompts
    outputs = [
        RequestOutput([sample([a, b, eos], logits[0][:3], T, k), sample([eos], logits[1][:1], T, k)]),
        RequestOutput([sample([c, a, b, a], logits[2], T, k)]),  # hit max_tokens, no EOS
    ]
    out = to_rollout(outputs, [p0, p1], topk=k, pad_id=pad, tokenizer=tok)

    # rows: prompt 0 sample 0, prompt 0 sample 1, prompt 1 sample 0 (the trainer's group layout)
    assert out.prompt_len == 3
    assert out.sequences.tolist() == [
        [1, a, b, a, b, eos, pad],
        [1, a, b, eos, pad, pad, pad],
        [pad, 1, c, c, a, b, a],
    ]
    assert out.attention_mask.tolist() == [[1] * 6 + [0], [1] * 4 + [0] * 3, [0] + [1] * 6]
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    rows = [(logits[0][:3], [a, b, eos]), (logits[1][:1], [eos]), (logits[2], [c, a, b, a])]
    for r, (lg, tokens) in enumerate(rows):
        logp = torch.log_softmax(torch.tensor(lg, dtype=torch.float64) / T, -1)
        n = len(tokens)
        want = logp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(out.sampling_logp[r, :n].double(), want, rtol=0, atol=1e-6)
        assert (out.sampling_logp[r, n:] == 0).all() and (out.topk_ids[r, n:] == 0).all()
        assert out.topk_ids[r, :n].tolist() == logp.topk(k, -1).indices.tolist()
        head = logp.topk(k, -1).values
        rest = 1 - head.exp().sum(-1)
        bucket = -(head.exp() * head).sum(-1) - rest * rest.log()
        torch.testing.assert_close(out.entropy[r, :n].double(), bucket, rtol=0, atol=1e-6)
        full = -(logp.exp() * logp).sum(-1)
        assert (out.entropy[r, :n].double() <= full + 1e-6).all()  # a lower bound of the true entropy
    assert out.texts == [tok.decode([a, b]), "", tok.decode([c, a, b, a])]


def test_sampled_token_outside_the_top_k_keeps_its_log_prob_and_k0_has_no_ids():
    step = {5: Logprob(-0.1, 1), 6: Logprob(-2.5, 2), 3: Logprob(-7.0, 6)}  # token 3 sampled, rank 6
    out = to_rollout(
        [RequestOutput([CompletionOutput([3], [step])])],
        [[1]],
        topk=2,
        pad_id=0,
        tokenizer=build_tiny_tokenizer(),
    )
    assert out.sampling_logp.tolist() == [[pytest.approx(-7.0)]]
    assert out.topk_ids.tolist() == [[[5, 6]]]
    only = {3: Logprob(-0.2, 1)}
    out0 = to_rollout(
        [RequestOutput([CompletionOutput([3], [only])])],
        [[1]],
        topk=0,
        pad_id=0,
        tokenizer=build_tiny_tokenizer(),
    )
    assert out0.topk_ids.shape == (1, 1, 0)
    p = math.exp(-0.2)
    assert out0.entropy.item() == pytest.approx(-p * -0.2 - (1 - p) * math.log(1 - p))


def test_missing_log_probs_is_one_clear_error():
    with pytest.raises(EmapgError, match="no log-probs"):
        to_rollout([RequestOutput([CompletionOutput([3], None)])], [[1]], topk=0, pad_id=0, tokenizer=None)


def test_repeated_prompts_become_one_request_with_n_samples_in_order():
    assert group_requests([[1, 2], [1, 2], [1, 2], [3], [1, 2]]) == [([1, 2], 3), ([3], 1), ([1, 2], 1)]


class FakeModel:
    def __init__(self):
        self.calls = []

    def load_weights(self, weights):
        self.calls.append(("load", list(weights)))


class FakeLLM:
    """Just the attribute path push_weights walks, recording calls in order."""

    def __init__(self):
        self.model = FakeModel()
        runner = type("R", (), {"model": self.model})()
        worker = type("W", (), {"worker": type("X", (), {"model_runner": runner})()})()
        self.llm_engine = type("E", (), {"model_executor": type("M", (), {"driver_worker": worker})()})()

    def reset_prefix_cache(self):
        self.model.calls.append(("reset", None))


def test_weight_push_sends_every_parameter_once_in_engine_dtype_then_resets_cache():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, num_heads=2)  # tied lm_head
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a trained-looking change must be what gets pushed
    fake = FakeLLM()
    push_weights(fake, weights_to_push(model, torch.bfloat16))
    (kind, pushed), (last, _) = fake.model.calls
    assert (kind, last) == ("load", "reset")  # reset after the load, never before
    names = [n for n, _ in pushed]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: once
    params = dict(model.named_parameters())
    assert sorted(names) == sorted(params) and len(names) == len(set(names))
    for name, tensor in pushed:
        assert tensor.dtype == torch.bfloat16 and not tensor.requires_grad
        assert torch.equal(tensor, params[name].detach().to(torch.bfloat16))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.engine=sglang"], "rollout.engine: unknown 'sglang'"),
        (["rollout.engine=vllm", "rollout.top_p=0.9"], "rollout.engine=vllm needs rollout.top_p=1"),
        (["rollout.engine=vllm", "task.name=search"], "does not run the search task"),
        (["rollout.engine=vllm", "train.device=cpu"], "needs a CUDA GPU; train.device=cpu"),
        (["rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=1.5"], "must be in \\(0, 1\\)"),
        (["rollout.engine=vllm"], "vLLM cannot load builtin:tiny"),
    ],
)
def test_engine_config_errors(overrides, message):
    with pytest.raises(EmapgError, match=message):
        load_config(None, overrides)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed: the missing-package message cannot show")
def test_missing_vllm_is_one_line_telling_how_to_install(tmp_path):
    with pytest.raises(EmapgError, match=r"pip install 'emapg\[vllm\]'"):
        VllmEngine(load_config(None, ["rollout.engine=vllm", f"model.path={tmp_path}"]))


@pytest.mark.skipif(
    not (HAS_VLLM and torch.cuda.is_available() and os.environ.get("EMAPG_VLLM_MODEL")),
    reason="needs vLLM, a CUDA GPU and EMAPG_VLLM_MODEL=<local HF model dir>",
)
def test_real_engine_samples_a_group_layout():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.environ["EMAPG_VLLM_MODEL"]
    cfg = load_config(None, [f"model.path={path}", "rollout.engine=vllm", "model.dtype=bfloat16"])
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda()
    tok = AutoTokenizer.from_pretrained(path)
    out = VllmEngine(cfg)(model, tok, ["1+1=", "1+1=", "2+2="], max_new_tokens=4, topk=4)
    assert out.sequences.shape[0] == 3 and out.topk_ids.shape[-1] == 4
    assert (out.sampling_logp[out.response_mask] <= 0).all()
