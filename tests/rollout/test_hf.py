"""HF rollouts: recorded sampling statistics against a full forward, ends of responses, and the
batch-invariant sampler (hash against a reference, invariance, frequencies against the policy)."""

import pytest
import torch

from emapg.model.lm_head import backbone
from emapg.model.models import load_model_and_tokenizer
from emapg.prompts import encode_prompts
from emapg.rollout import SamplingParams
from emapg.rollout.hf import HFEngine, row_uniforms, splitmix64
from helpers import sample


def test_recorded_logp_topk_and_entropy_match_a_full_forward(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    out = sample(model, tokenizer, ["1+2=", "345+67=", "8="], max_new_tokens=6, temperature=0.7, topk=5)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=out.attention_mask).logits
    logp = torch.log_softmax(logits[:, out.prompt_len - 1 : -1] / 0.7, -1)
    mask = out.response_mask
    token_logp = logp.gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out.sampling_logp[mask], token_logp[mask], atol=1e-5)
    assert torch.equal(out.topk_ids[mask], logp.topk(5, -1).indices[mask])
    entropy = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(out.entropy[mask], entropy[mask], atol=1e-5)
    # Past the end: padding, no mask, zero log-prob.
    assert (out.responses[~mask] == tokenizer.pad_token_id).all()
    assert (out.sampling_logp[~mask] == 0).all()


@pytest.mark.slow
def test_responses_end_at_eos_or_stop_string(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    eos = tokenizer.eos_token_id
    torch.manual_seed(1)
    free = sample(model, tokenizer, ["12+"] * 16, max_new_tokens=8)
    torch.manual_seed(1)
    stopped = sample(model, tokenizer, ["12+"] * 16, max_new_tokens=8, stop=["1"])
    for i, text in enumerate(free.texts):
        n = int(free.response_mask[i].sum())
        ids = free.responses[i, :n].tolist()
        assert eos not in ids[:-1] and (ids[-1] == eos or n == 8)
        # Same random stream: the stopped response is the free one cut after its first "1".
        cut = text.find("1")
        want = text if cut < 0 else text[: cut + 1]
        assert stopped.texts[i] == want
    assert any("1" in t for t in free.texts)


def test_greedy_is_deterministic(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    a = sample(model, tokenizer, ["9+9=", "1="], max_new_tokens=5, greedy=True, batch_size=1)
    b = sample(model, tokenizer, ["9+9=", "1="], max_new_tokens=5, greedy=True)
    assert a.texts == b.texts and torch.equal(a.sequences, b.sequences)


def test_chat_template_is_applied_without_a_second_bos(tiny_model_dir):
    from emapg.prompts import encode_prompts

    _, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    plain = tokenizer(["1+1="])["input_ids"]
    assert (
        encode_prompts(tokenizer, ["1+1="], chat_template=True) == plain
    )  # the tiny tokenizer has no template
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}q: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a: {% endif %}"
    )
    ids = encode_prompts(tokenizer, ["1+1="], chat_template=True)[0]
    assert ids == tokenizer("<bos>q: 1+1=\na: ", add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert encode_prompts(tokenizer, ["1+1="], chat_template=False) == plain


def _splitmix64_reference(x: int) -> int:
    """splitmix64's finaliser on Python ints (unbounded), reduced to 64 bits by hand."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_splitmix64_on_int64_tensors_equals_the_unsigned_reference():
    values = [0, 1, 2, 12345, (1 << 63) - 1, -1, -(1 << 63), 0x9E3779B97F4A7C15 - (1 << 64)]
    got = splitmix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_splitmix64_reference(v & ((1 << 64) - 1)) for v in values]


def test_row_uniforms_are_the_hash_of_seed_row_and_step():
    """The table drawn once per call holds, at (i, t), the uniform of (seed, rows[i], t):
    53 bits of splitmix64(splitmix64(seed ^ row) + t), centred in its bin."""
    seed, rows, steps = (1 << 61) + 12345, [0, 7, 1 << 40], 5
    got = row_uniforms(seed, torch.tensor(rows), steps)
    m = (1 << 64) - 1
    for i, row in enumerate(rows):
        for t in range(steps):
            bits = _splitmix64_reference((_splitmix64_reference(seed ^ row) + t) & m)
            assert got[i, t].item() == ((bits >> 11) + 0.5) / 2**53


@pytest.mark.slow
def test_a_rows_samples_do_not_depend_on_its_batch_chunk_or_position(tiny_model_dir):
    """What makes N processes sample like one: rank r generating rows [a, b) with first_row=a
    gets the very tokens the whole batch gets there, whatever the chunking."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    prompts = ["1=", "2+2=", "34+56=", "7=", "78+9=", "1+1=", "12+34=", "5+5="] * 2
    torch.manual_seed(3)
    whole = sample(model, tokenizer, prompts, max_new_tokens=6, topk=3)
    parts = []
    for a, b, chunk in ((0, 5, 2), (5, 16, 4)):
        torch.manual_seed(3)
        parts.append(
            sample(model, tokenizer, prompts[a:b], max_new_tokens=6, topk=3, batch_size=chunk, first_row=a)
        )
    assert whole.texts == parts[0].texts + parts[1].texts
    for part, a in zip(parts, (0, 5), strict=True):
        n, width = part.response_mask.shape
        mine = slice(a, a + n)
        assert torch.equal(whole.responses[mine, :width], part.responses)
        assert torch.equal(whole.topk_ids[mine, :width], part.topk_ids)
        # Different left padding: the same log-probs up to float rounding.
        assert torch.allclose(whole.sampling_logp[mine, :width], part.sampling_logp, atol=1e-5)
    torch.manual_seed(4)  # a different call seed: different samples
    assert sample(model, tokenizer, prompts, max_new_tokens=6).texts != whole.texts


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_tokens_follow_the_tempered_nucleus_policy(tiny_model_dir, temperature, top_p):
    """Frequencies of 6000 first tokens against softmax(logits / T) cut to the top-p nucleus
    (renormalised): within 4.5 standard errors everywhere, never a token outside the nucleus."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)  # logits x6: a peaked policy, where temperature matters
    n = 6000
    torch.manual_seed(0)
    out = sample(model, tokenizer, ["3+4="] * n, max_new_tokens=1, temperature=temperature, top_p=top_p,
                   batch_size=n)  # fmt: skip
    with torch.no_grad():
        logits = model(**tokenizer(["3+4="], return_tensors="pt")).logits[0, -1]
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.sort(descending=True)
    keep = order.values.cumsum(0) - order.values < top_p  # the smallest set with mass >= top_p
    nucleus = torch.zeros_like(p).scatter_(0, order.indices[keep], order.values[keep])
    want = nucleus / nucleus.sum()
    freq = torch.bincount(out.responses[:, 0], minlength=p.numel()).double() / n
    assert (freq[want == 0] == 0).all()
    assert ((freq - want).abs() <= 4.5 * (want * (1 - want) / n).sqrt() + 1e-12).all()


def grouped_prompts() -> list[str]:
    """Groups of 3, 1 and 4 samples of prompts of different lengths (so some are left-padded)."""
    return ["34+56="] * 3 + ["7="] + ["1+1="] * 4


def with_lora(model):
    """`model` with a LoRA adapter that changes its outputs (peft starts B at zero)."""
    from emapg.model.lora import LoraSettings, adapter_params, wrap

    wrapped = wrap(model, LoraSettings(r=4))
    torch.manual_seed(0)
    for name, p in adapter_params(wrapped, "policy").items():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return wrapped


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("temperature,topk", [(1.0, 3), (0.7, 0)])
def test_a_groups_prompt_is_prefilled_once_and_samples_the_same(tiny_model_dir, temperature, topk, lora):
    """The shared prefill computes each distinct prompt but its last token once, then the rows
    sample what every row prefilling its own copy samples: the same tokens, and log-probs and
    entropy to float32 rounding (the 1e-5 bound of the batch-invariance test above, where rows
    differ only in their left padding). A peft model's adapters apply in the prefill too."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    if lora:
        model = with_lora(model)
    prompts = grouped_prompts()
    encoded = encode_prompts(tokenizer, prompts, True)
    width = max(len(p) for p in encoded)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, topk=topk, seed=5)
    out = {}
    for share in (False, True):
        seen = []
        hook = backbone(model).register_forward_pre_hook(
            lambda _m, _a, kw, seen=seen: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        out[share] = HFEngine(model, tokenizer, share_prompts=share).sample(encoded, params)
        hook.remove()
        # The 3 distinct prompts but their last token once, then generate's passes over all 8
        # rows: the last prompt token, then one token a step (or whole prompts, then a token a step).
        assert seen[0] == ((3, width - 1) if share else (8, width))
        assert all(shape == (8, 1) for shape in seen[1:])
    whole, shared = out[False], out[True]
    assert shared.texts == whole.texts
    assert torch.equal(shared.responses, whole.responses)
    assert torch.equal(shared.topk_ids, whole.topk_ids)
    assert torch.allclose(shared.sampling_logp, whole.sampling_logp, atol=1e-5)
    assert torch.allclose(shared.entropy, whole.entropy, atol=1e-5)
    # And against a full forward of the sampled rows (the reference of the first test above).
    with torch.no_grad():
        mask = shared.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=shared.sequences, attention_mask=mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, shared.prompt_len - 1 : -1] / temperature, -1)
    token = logp.gather(-1, shared.responses.unsqueeze(-1)).squeeze(-1)
    real = shared.response_mask
    assert torch.allclose(shared.sampling_logp[real], token[real], atol=1e-5)
