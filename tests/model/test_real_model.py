"""The real model: SmolLM2-135M-Instruct from its GGUF file (bash scripts/install-smollm2.sh).

Converted once per test session (conftest.smollm2). Checked against what it came from: the
converted weights against gguf-py's own dequantization, emapg's fused log-probs and top-k
against transformers' forward, and two RL steps that move the weights. CI sets
EMAPG_REQUIRE_REAL_MODEL=1, which turns the "not installed" skip into a failure.
"""

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from emapg.model import lm_head
from emapg.model.gguf import gguf_file
from emapg.model.models import load_model_and_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import Rollout
from emapg.training import loop as trainer
from emapg.training.config import load_config

# Slow: SmolLM2-135M-Instruct converted, run and trained (12-136 s a test at load 3-4).
pytestmark = pytest.mark.slow

# GGUF tensor names (llama.cpp's) and the Hugging Face Llama names they become.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def unrotate(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q and k with each head's rotary halves interleaved (row 2j + i of a head is
    Hugging Face's row i * d/2 + j): put every row back where Hugging Face's rotary wants it."""
    d = weight.shape[0] // heads
    j, i = np.meshgrid(np.arange(d // 2), np.arange(2))  # i, j: [2, d/2], HF row order i * d/2 + j
    within = (2 * j + i).reshape(-1)
    rows = (np.arange(heads)[:, None] * d + within[None, :]).reshape(-1)
    return weight[rows]


def test_converted_weights_equal_the_gguf_readers_dequantized_tensors(smollm2):
    gguf = pytest.importorskip("gguf")
    _, folder = smollm2
    saved = load_file(folder / "model.safetensors")
    reader = gguf.GGUFReader(gguf_file("smollm2"))
    heads, kv_heads = 9, 3  # SmolLM2-135M: 9 query heads, 3 key/value heads of 64
    seen = set()
    for tensor in reader.tensors:
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if ".attn_q." in tensor.name:
            want = unrotate(want, heads)
        elif ".attn_k." in tensor.name:
            want = unrotate(want, kv_heads)
        name = hf_name(tensor.name)
        got = saved[name].numpy()
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(got, want), name  # exactly: dequantizing is deterministic
        seen.add(name)
    assert seen == set(saved)  # nothing else in the folder: the head is tied to the embedding
    assert len(seen) == 2 + 9 * 30


def _sampled_batch(model, tokenizer, prompts: list[str], length: int) -> Rollout:
    """Chat-templated prompts, left-padded, each with `length` sampled response tokens."""
    ids = encode_prompts(tokenizer, prompts, True)
    p = max(map(len, ids))
    seqs = torch.full((len(ids), p), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), p, dtype=torch.long)
    for row, x in enumerate(ids):
        seqs[row, p - len(x) :], mask[row, p - len(x) :] = torch.tensor(x), 1
    torch.manual_seed(0)
    with torch.no_grad():
        seqs = model.generate(
            input_ids=seqs, attention_mask=mask, max_new_tokens=length, min_new_tokens=length,
            do_sample=True, temperature=1.0, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    n = len(ids)
    return Rollout(
        sequences=seqs,
        attention_mask=torch.cat([mask, torch.ones(n, length, dtype=torch.long)], 1),
        prompt_len=p,
        response_mask=torch.ones(n, length, dtype=torch.bool),
        sampling_logp=torch.zeros(n, length),
        topk_ids=torch.zeros(n, length, 0, dtype=torch.long),
        entropy=torch.zeros(n, length),
        texts=[""] * n,
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def _own_logp(model, sequences, mask, p):
    """transformers' own logits, log-softmaxed at the response positions."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=mask, position_ids=pos).logits
    return torch.log_softmax(logits[:, p - 1 : -1].float(), -1)


def test_fused_logprobs_and_topk_equal_transformers_forward(smollm2):
    """The bound is measured here, on this CPU, as the larger of two probes of the float32 noise
    of these kernels: two transformers forwards of the same rows, as one batch and row by row,
    differ only in their GEMMs' blocking (5.9e-5 where this was written; exactly 0 on a CPU
    whose kernels block both alike), and twice the largest gap between the float32 forward and
    a float64 one (two float32 computations of one value, each about that far from it). emapg's
    fused head was 1.7e-5 from transformers' own; it must stay within the bound."""
    _, folder = smollm2
    model, tokenizer = load_model_and_tokenizer(folder)
    model.eval()
    prompts = ["What is 23 + 45?", "Name a color of the sky.", "Which is larger, 17 or 71?", "Spell 'cat'."]
    batch = _sampled_batch(model, tokenizer, prompts, length=24)
    p, k = batch.prompt_len, 32
    with torch.no_grad():
        want = _own_logp(model, batch.sequences, batch.attention_mask, p)
        rows = torch.cat([_own_logp(model, batch.sequences[i : i + 1], batch.attention_mask[i : i + 1], p)
                          for i in range(len(prompts))])  # fmt: skip
        exact = _own_logp(copy.deepcopy(model).double(), batch.sequences, batch.attention_mask, p)
        noise = max((want - rows).abs().max().item(), 2 * (want - exact).abs().max().item())
        entropy = -(want.exp() * want).sum(-1).mean().item()
        got = lm_head.response_summary(
            model, batch, batch.responses.unsqueeze(-1), temperature=1.0, topk_self=k
        )
    assert lm_head.head_of(model) is not None  # the fused head ran, not the logits fallback
    assert 1.0 < entropy < 4.0  # a real model's regime (a random one's is near log V = 10.8)
    assert 0 < noise < 1e-3
    sampled = want.gather(-1, batch.responses.unsqueeze(-1))
    assert (got.logp() - sampled).abs().max().item() <= noise
    top = want.topk(k + 1, -1)
    assert (got.topk_logp - top.values[..., :k]).abs().max().item() <= noise
    # The same top-k tokens wherever the k-th and (k+1)-th are told apart by more than the noise.
    clear = (top.values[..., k - 1] - top.values[..., k]) > 2 * noise
    assert clear.float().mean() > 0.9
    same = torch.sort(got.topk_ids, -1).values == torch.sort(top.indices[..., :k], -1).values
    assert same.all(-1)[clear].all()


def test_two_rl_steps_on_the_real_model_change_its_weights(smollm2, tmp_path):
    cache, folder = smollm2
    cfg = load_config(
        None,
        [
            "model.path=smollm2",
            f"model.cache_dir={cache}",
            f"train.output_dir={tmp_path}",
            "task.num_train=16",
            "task.num_eval=4",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=12",
            "algo.micro_batch_size=8",
            "train.steps=2",
            "train.eval_every=2",
            "train.save_every=2",
            "train.progress=false",
            "train.tensorboard=false",
            "optim.lr=1e-5",
            "kl.estimator=k1",
            "kl.beta=1.0",
            "eval.samples=1",
        ],
    )  # fmt: skip  (k1's sampled gradient moves the policy even where no answer is rewarded)
    trainer.train(cfg)
    before = load_file(folder / "model.safetensors")
    after = load_file(tmp_path / "quickstart" / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    assert set(after) == set(before)
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(moved) > 0.9 * len(before)  # every layer trains (norms and embedding included)
    for name in moved:
        assert (after[name] - before[name]).abs().max() < 1e-2  # two Adam steps of 1e-5: small
