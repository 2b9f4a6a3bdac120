"""The fused LM head against each architecture's own logits: tiny models built from configs."""

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from emapg.model import lm_head, prompt_cache
from emapg.rollout import Rollout

V, P, L, N = 61, 4, 5, 3
SIZES = {
    "vocab_size": V,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}


def llama():
    return LlamaForCausalLM(LlamaConfig(**SIZES)), 30.0


def cohere():
    return CohereForCausalLM(CohereConfig(**SIZES, logit_scale=0.3)), 30.0


def granite():
    return GraniteForCausalLM(GraniteConfig(**SIZES, logits_scaling=8.0)), 100.0


def gemma2():
    config = Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=2.0, sliding_window=4)
    return Gemma2ForCausalLM(config), 10.0  # pre-cap logits up to ~5: the cap binds, without ties


def build(make):
    """A tiny float32 model whose output embedding is scaled up so that its logits are far from 0."""
    torch.manual_seed(0)
    model, boost = make()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(boost)
    return model.float().eval()


def rollout() -> Rollout:
    """Left-padded prompts, responses with padding after the end."""
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(1, V, (N, P + L), generator=g)
    attention_mask = torch.ones(N, P + L, dtype=torch.long)
    attention_mask[1, :2] = 0  # a shorter prompt
    attention_mask[2, P + 3 :] = 0  # a response that ended early
    return rollout_of(sequences, attention_mask)


def rollout_of(sequences, attention_mask) -> Rollout:
    """A Rollout of these rows ([prompt of P | response of L]), padding zeroed."""
    n = len(sequences)
    sequences[attention_mask == 0] = 0
    return Rollout(
        sequences=sequences,
        attention_mask=attention_mask,
        prompt_len=P,
        response_mask=attention_mask[:, P:].bool(),
        sampling_logp=torch.zeros(n, L),
        topk_ids=torch.zeros(n, L, 0, dtype=torch.long),
        entropy=torch.zeros(n, L),
        texts=[""] * n,
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def own_logp(model, batch: Rollout, temperature: float):
    """log_softmax of the model's own logits at the response positions."""
    mask = batch.attention_mask
    logits = model(
        input_ids=batch.sequences, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
    ).logits
    return torch.log_softmax(logits[:, P - 1 : -1].float() / temperature, -1), logits


def ids_of(batch: Rollout):
    g = torch.Generator().manual_seed(2)
    return torch.cat([batch.responses.unsqueeze(-1), torch.randint(0, V, (N, L, 3), generator=g)], -1)


def grads(model, logp):
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad((logp * weights).sum(), params, allow_unused=True)


def assert_matches(model, temperature: float, k: int):
    batch = rollout()
    ids = ids_of(batch)
    want, _ = own_logp(model, batch, temperature)
    got = lm_head.response_summary(model, batch, ids, temperature=temperature, topk_self=k)
    assert torch.allclose(got.logp(), want.gather(-1, ids), atol=1e-5, rtol=1e-5)
    assert torch.allclose(got.lse - got.gathered[..., 0], -want.gather(-1, ids[..., :1])[..., 0], atol=1e-5)
    if k:
        top = want.topk(k, -1)
        assert torch.equal(got.topk_ids, top.indices)
        assert torch.allclose(got.topk_logp, top.values, atol=1e-5, rtol=1e-5)
    fused = grads(model, got.logp())
    reference = grads(model, own_logp(model, batch, temperature)[0].gather(-1, ids))
    for a, b in zip(fused, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())  # float32 rounding


@pytest.mark.parametrize(
    "make,scale,softcap",
    [(llama, 1.0, None), (cohere, 0.3, None), (granite, 1 / 8.0, None), (gemma2, 1.0, 2.0)],
    ids=["llama", "cohere", "granite", "gemma2"],
)
@pytest.mark.parametrize("temperature,k", [(1.0, 0), (0.7, 3)])
def test_fused_head_equals_own_logits(make, scale, softcap, temperature, k):
    model = build(make)
    head = lm_head.head_of(model)
    assert head is not None and head.weight is model.get_output_embeddings().weight
    assert head.scale == pytest.approx(scale) and head.softcap == softcap
    if softcap is not None:  # the cap binds: some logits before it are well past it
        hidden, _ = lm_head.final_hidden(model, input_ids=rollout().sequences)
        assert (hidden @ head.weight.T).abs().max() > 2 * softcap
    assert_matches(model, temperature, k)
    assert lm_head.head_of(model) is not None  # confirmed against the model's logits: still fused


def test_head_logits_equal_the_models():
    """Head.logits is the model's own head, modifier included, on the same hidden state."""
    for make in (llama, cohere, granite, gemma2):
        model = build(make)
        batch = rollout()
        hidden, head = lm_head.final_hidden(
            model, input_ids=batch.sequences, attention_mask=batch.attention_mask
        )
        logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
        assert torch.allclose(head.logits(hidden), logits, atol=1e-5, rtol=1e-5)


def test_known_unhandled_modifier_falls_back():
    model = build(llama)
    model.config.lm_head_multiplier = 2.0  # Falcon-H1's field: not reproduced by the fused head
    assert lm_head.head_of(model) is None
    assert_matches(model, 0.7, 3)


def test_scale_and_softcap_together_fall_back():
    model = build(gemma2)
    model.config.logit_scale = 0.5  # order of scale and cap unknown: not fused
    assert lm_head.head_of(model) is None


class _Doubled(LlamaForCausalLM):
    """A head modifier no config field announces: forward doubles the logits."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        out.logits = out.logits * 2
        return out


def test_unannounced_modifier_is_caught_and_falls_back():
    torch.manual_seed(0)
    model = _Doubled(LlamaConfig(**SIZES)).float().eval()
    model.config._attn_implementation = "eager"
    assert lm_head.head_of(model) is not None  # the config says plain
    with pytest.warns(UserWarning, match="does not reproduce"):
        assert_matches(model, 0.7, 3)
    assert lm_head.head_of(model) is None  # remembered


class _NoKeep(LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_no_logits_to_keep_or_bias_falls_back():
    torch.manual_seed(0)
    model = _NoKeep(LlamaConfig(**SIZES)).float().eval()
    model.config._attn_implementation = "eager"
    assert lm_head.head_of(model) is None
    assert_matches(model, 1.0, 0)
    biased = build(llama)
    biased.lm_head.bias = torch.nn.Parameter(torch.randn(V))
    assert lm_head.head_of(biased) is None
    assert_matches(biased, 0.7, 3)


def grouped_rollout() -> Rollout:
    """Groups of 2, 1 and 3 rows sharing a prompt (the first left-padded), responses that differ
    and one that ended early."""
    batch = rollout()
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    g = torch.Generator().manual_seed(3)
    sequences, mask = batch.sequences[rows].clone(), batch.attention_mask[rows].clone()
    mask[:, P:] = 1
    mask[4, P + 2 :] = 0
    sequences[:, P:] = torch.randint(1, V, (len(rows), L), generator=g) * mask[:, P:]
    mask[[0, 1], :2] = 0
    return rollout_of(sequences, mask)


def test_prompt_groups_are_runs_of_equal_prompts():
    assert prompt_cache.prompt_groups(*grouped_rollout().prompts).tolist() == [2, 1, 3]
    assert prompt_cache.prompt_groups(*rollout().prompts) is None  # no two neighbours share a prompt


def rows_seen(model) -> list[tuple[int, int]]:
    """(rows, columns) of every backbone pass from now on."""
    seen = []
    lm_head.backbone(model).register_forward_pre_hook(
        lambda _m, args, kwargs: (
            seen.append(tuple(kwargs["input_ids"].shape))
            if "input_ids" in kwargs
            else seen.append(tuple(args[0].shape))
        ),
        with_kwargs=True,
    )
    return seen


def llama_with_bias():
    """No fused head (a bias): its shared passes return full logits."""
    model, boost = llama()
    model.lm_head.bias = torch.nn.Parameter(torch.randn(V))
    return model, boost


@pytest.mark.parametrize(
    "make", [llama, llama_with_bias, gemma2], ids=["llama", "llama-biased-head", "gemma2-sliding-window"]
)
@pytest.mark.parametrize("temperature,k", [(1.0, 0), (0.7, 3)])
def test_a_groups_prompt_is_computed_once_and_changes_nothing(make, temperature, k):
    """Values and gradients equal the model's own whole-row logits to float32 rounding (the
    bound of the whole-row fused head above); a sliding-window model keeps whole rows."""
    model = build(make)
    lm_head.response_summary(model, rollout(), ids_of(rollout()), temperature=1.0)  # confirms the head
    batch, seen = grouped_rollout(), rows_seen(model)
    ids = torch.cat([batch.responses.unsqueeze(-1), torch.randint(0, V, (6, L, 3))], -1)
    got = lm_head.response_summary(
        model, batch, ids, temperature=temperature, topk_self=k, share_prompts=True
    )
    shared = make is not gemma2
    assert seen == ([(3, P), (6, L)] if shared else [(6, P + L)])
    want = torch.log_softmax(
        model(input_ids=batch.sequences, attention_mask=batch.attention_mask,
              position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, P - 1 : -1] / temperature,
        -1,
    )  # fmt: skip
    real = batch.response_mask
    assert torch.allclose(got.logp()[real], want.gather(-1, ids)[real], atol=1e-5, rtol=1e-5)
    if k:
        assert torch.equal(got.topk_ids[real], want.topk(k, -1).indices[real])
    weights = real.unsqueeze(-1).float()
    for a, b in zip(
        grads(model, got.logp() * weights), grads(model, want.gather(-1, ids) * weights), strict=True
    ):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())  # float32 rounding
