"""HF rollouts: recorded sampling statistics against a full forward, ends of responses."""

import torch

from emapg.models import load_model_and_tokenizer
from emapg.rollout.hf import generate


def test_recorded_logp_topk_and_entropy_match_a_full_forward(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    out = generate(model, tokenizer, ["1+2=", "345+67=", "8="], max_new_tokens=6, temperature=0.7, topk=5)
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


def test_responses_end_at_eos_or_stop_string(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    eos = tokenizer.eos_token_id
    torch.manual_seed(1)
    free = generate(model, tokenizer, ["12+"] * 16, max_new_tokens=8)
    torch.manual_seed(1)
    stopped = generate(model, tokenizer, ["12+"] * 16, max_new_tokens=8, stop=["1"])
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
    a = generate(model, tokenizer, ["9+9=", "1="], max_new_tokens=5, greedy=True, batch_size=1)
    b = generate(model, tokenizer, ["9+9=", "1="], max_new_tokens=5, greedy=True)
    assert a.texts == b.texts and torch.equal(a.sequences, b.sequences)


def test_chat_template_is_applied_without_a_second_bos(tiny_model_dir):
    from emapg.rollout import format_prompts

    _, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    plain, special = format_prompts(tokenizer, ["1+1="], chat_template=True)
    assert (plain, special) == (["1+1="], True)  # the tiny tokenizer has no template
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}q: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a: {% endif %}"
    )
    texts, special = format_prompts(tokenizer, ["1+1="], chat_template=True)
    assert texts == ["<bos>q: 1+1=\na: "] and special is False
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"][0]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert format_prompts(tokenizer, ["1+1="], chat_template=False) == (["1+1="], True)
