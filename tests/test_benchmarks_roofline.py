"""benchmarks/roofline.py's counts and benchmarks/eval_throughput.py's command, at a tiny size and
without running a real model: the FLOP count of a forward against torch's own count, the shape
read from a Llama config (tied embeddings, GQA, SmolLM2's), and the `emapg eval` command and
prompts of the SmolLM2 evaluation. (The benchmarks' runs: tests/test_benchmarks.py, slow.)"""

import argparse
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from emapg.batch import Rollout
from emapg.cli import build_parser
from emapg.model.models import build_tiny_model, build_tiny_tokenizer
from emapg.tasks.math import PROMPT, SAMPLE_EVAL, TINY_EXTRA_CHARS
from emapg.tasks.math_data import load_problems
from emapg.training.config import load_config
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import eval_throughput  # noqa: E402
import roofline  # noqa: E402


def llama(tied: bool, vocab=40, hidden=48, intermediate=80, layers=2, heads=4, kv_heads=2, head_dim=16):
    """A small random Llama; eager attention, so that every matmul is one torch.flop_counter sees."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=tied, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def rollout(rows: int, prompt: int, response: int, vocab: int) -> Rollout:
    """A batch without padding: every row `prompt` tokens then `response` sampled ones."""
    width = prompt + response
    return Rollout(
        sequences=torch.randint(vocab, (rows, width)), attention_mask=torch.ones(rows, width, dtype=torch.long),
        prompt_len=prompt, response_mask=torch.ones(rows, response, dtype=torch.bool),
        sampling_logp=torch.zeros(rows, response), topk_ids=torch.zeros(rows, response, 0, dtype=torch.long),
        entropy=torch.zeros(rows, response), texts=[""] * rows, truncated=torch.zeros(rows, dtype=torch.bool),
    )  # fmt: skip


def test_forward_flops_equal_torch_flop_counter_less_what_the_docstring_leaves_out():
    model = llama(tied=True)
    batch = rollout(rows=3, prompt=5, response=4, vocab=40)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        # The trainer's forward: the backbone over every token, the LM head over the positions
        # whose next token is a response token.
        hidden = model.model(input_ids=batch.sequences, attention_mask=batch.attention_mask).last_hidden_state
        model.lm_head(hidden[:, batch.prompt_len - 1 : -1])
    counted = counter.get_total_flops()
    # Left out by the roofline: the rotary embedding's matmul where torch counts one (a few FLOP),
    # and the upper triangle of each layer's QK^T and AV that eager attention computes and masks:
    # s^2 - s(s+1)/2 of the s^2 pairs, 4 d_attn FLOP each, 2 layers x 3 rows.
    counts = counter.get_flop_counts()
    rotary = sum(sum(ops.values()) for name, ops in counts.items() if name.endswith("rotary_emb"))
    s, d_attn = batch.sequences.shape[1], 4 * 16
    masked = 2 * 3 * 4 * d_attn * (s * s - s * (s + 1) // 2)
    assert roofline.forward_flops(roofline.shape_of(model), batch) == counted - rotary - masked


def test_shared_prompt_flops_count_each_groups_prompt_once():
    """Rows 0-2 share a prompt, rows 3-4 another: the whole-row count less the prompt copies'
    linear layers (2 N_lin a token) and attention over the prompt (4 d_attn (i + 1) a position)."""
    model = llama(tied=True)
    shape, batch = roofline.shape_of(model), rollout(rows=5, prompt=6, response=3, vocab=40)
    batch.sequences[1:3, :6], batch.sequences[4, :6] = batch.sequences[0, :6], batch.sequences[3, :6]
    copies, p = 2 + 1, 6
    prompt_cost = 2 * shape.linear * p + shape.layers * 2 * shape.d_attn * p * (p + 1)
    whole = roofline.forward_flops(shape, batch)
    assert roofline.forward_flops(shape, batch, share_prompts=True) == whole - copies * prompt_cost


def test_the_hf_engines_rollout_counts_a_groups_prompt_once_and_vllms_every_row():
    """algo.share_prompts also prefills a group's prompt once in the hf engine (rollout/hf.py);
    vLLM's rollout is counted whole."""
    model = llama(tied=True)
    shape, batch = roofline.shape_of(model), rollout(rows=4, prompt=6, response=3, vocab=40)
    batch.sequences[1:4, :6] = batch.sequences[0, :6]
    hf = load_config("quickstart")
    vllm = hf.model_copy(update={"rollout": hf.rollout.model_copy(update={"engine": "vllm"})})
    shared, whole = roofline.forward_flops(shape, batch, True), roofline.forward_flops(shape, batch)
    assert shared < whole
    assert roofline.phase_work(hf, shape, batch, 0)["rollout"][0] == shared
    assert roofline.phase_work(vllm, shape, batch, 0)["rollout"][0] == whole


@pytest.mark.parametrize("tied", [True, False])
def test_shape_of_reads_the_config_and_counts_a_tied_head_once(tied):
    model = llama(tied)  # 4 heads x head_dim 16 = 64, not the width 48: read, not derived
    s = roofline.shape_of(model)
    params = dict(model.named_parameters())  # a tied matrix once, under the embedding's name
    decoder_matrices = sum(p.numel() for n, p in params.items() if ".layers." in n and p.dim() == 2)
    assert (s.linear, s.layers, s.d_attn, s.d_kv, s.hidden, s.vocab) == (decoder_matrices, 2, 64, 32, 48, 40)
    assert s.tied == tied and ("lm_head.weight" in params) == (not tied)
    assert s.weight_bytes == 4 * sum(p.numel() for p in params.values())
    assert s.weight_bytes == 4 * (s.linear + (1 if tied else 2) * 40 * 48 + (2 * 2 + 1) * 48)  # + norms
    assert s.trainable == sum(p.numel() for p in params.values())


def test_shape_of_smollm2_matches_the_docstring():
    # SmolLM2-135M-Instruct's config (as emapg's converted folder has it), built without weights.
    with torch.device("meta"):
        model = llama(
            True, vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64
        )
    s = roofline.shape_of(model)
    per_layer = 2 * 576 * 576 + 2 * 576 * 3 * 64 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    assert s.linear == 30 * per_layer == 106_168_320  # N_lin 106.2M
    assert (s.d_attn, s.d_kv, s.vocab, s.tied) == (576, 192, 49152, True)
    assert s.weight_bytes == 4 * 134_515_008  # 134.5M parameters


def test_smollm2_eval_is_emapg_eval_of_the_shipped_problems_with_the_chat_template(tmp_path):
    data = eval_throughput.shipped_problems(tmp_path, 5)
    assert [p.question for p in load_problems(data)] == [p.question for p in load_problems(SAMPLE_EVAL)[:5]]
    model = tmp_path / "model"
    bench = argparse.Namespace(n=2, max_new_tokens=16)
    command = eval_throughput.eval_command(model, data, "vllm", bench, tmp_path / "out")
    assert command[:4] == [sys.executable, "-m", "emapg", "eval"]
    parsed = build_parser("eval").parse_args(command[3:])  # emapg's own command line reads it
    assert (parsed.model, parsed.data, parsed.engine) == (str(model), [str(data)], "vllm")
    assert (parsed.protocol, parsed.n, parsed.max_new_tokens) == ("paper-math", 2, 16)
    assert not parsed.no_chat_template and parsed.prompt is None  # the protocol's prompt, templated


def test_first_prompt_is_the_problem_through_the_models_chat_template(tmp_path):
    tokenizer = build_tiny_tokenizer(TINY_EXTRA_CHARS)
    tokenizer.chat_template = "{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}ANSWER:"
    build_tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = eval_throughput.shipped_problems(tmp_path, 1)
    question = load_problems(SAMPLE_EVAL)[0].question
    expected = "USER: " + PROMPT.replace("{question}", question) + "\nANSWER:"
    assert eval_throughput.first_prompt(tmp_path / "model", data) == expected
