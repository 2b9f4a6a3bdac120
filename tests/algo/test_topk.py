"""Chunked summaries against plain autograd, and the summary KL path against token_kl."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from emapg.algo import kl, topk

DT = torch.float64
B, T, V, H, K = 2, 5, 11, 6, 3


def reference(logits, ids, temperature, k):
    x = logits / temperature
    lse = torch.logsumexp(x, -1)
    logp = torch.log_softmax(x, -1)
    top = logp.topk(k, -1) if k else None
    entropy = -(logp.exp() * logp).sum(-1)
    return lse, x.gather(-1, ids), top, entropy


@pytest.mark.parametrize("from_hidden,tile_rows", [(False, None), (True, 512), (True, 4)])
def test_summary_matches_autograd(from_hidden, tile_rows, monkeypatch):
    """tile_rows 4: the head's tokens in tiles of 4, 4 and 2, its vocabulary in blocks of 8 and 3
    (topk._tiles); 512: one tile of all 10 tokens, blocks of 3, 3, 3 and 2."""
    if tile_rows:
        monkeypatch.setattr(topk, "TILE_ROWS", tile_rows)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g, dtype=DT, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=DT, requires_grad=True)
    ids = torch.randint(0, V, (B, T, 4), generator=g)
    g_lse, g_gathered = torch.randn(B, T, generator=g, dtype=DT), torch.randn(B, T, 4, generator=g, dtype=DT)

    def run(fn):
        lse, gathered = fn()
        loss = (lse * g_lse).sum() + (gathered * g_gathered).sum()
        return [lse, gathered, *torch.autograd.grad(loss, (hidden, weight))]

    want = reference(hidden @ weight.T, ids, 0.7, K)
    if from_hidden:
        got = topk.summarize_hidden(hidden, weight, ids, topk=K, temperature=0.7, entropy=True, chunk_size=3)
    else:
        got = topk.summarize(hidden @ weight.T, ids, topk=K, temperature=0.7, entropy=True, chunk_size=3)
    assert torch.equal(got.topk_ids, want[2].indices)
    assert torch.allclose(got.topk_logp, want[2].values)
    assert torch.allclose(got.entropy, want[3])
    expected = run(lambda: reference(hidden @ weight.T, ids, 0.7, 0)[:2])
    actual = run(lambda: (got.lse, got.gathered))
    for a, b in zip(actual, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("scale,softcap", [(0.25, None), (1.0, 1.5), (3.0, 2.0)])
def test_scaled_softcapped_head_matches_autograd(scale, softcap):
    """logits = c * tanh(scale * hidden @ W.T / c), forward and the hand-written backward."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, H, generator=g, dtype=DT, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=DT, requires_grad=True)
    ids = torch.randint(0, V, (B, T, 4), generator=g)
    g_lse, g_gathered = torch.randn(B, T, generator=g, dtype=DT), torch.randn(B, T, 4, generator=g, dtype=DT)

    def head():
        z = scale * (hidden @ weight.T)
        return z if softcap is None else softcap * torch.tanh(z / softcap)

    def grads(lse, gathered):
        loss = (lse * g_lse).sum() + (gathered * g_gathered).sum()
        return [lse, gathered, *torch.autograd.grad(loss, (hidden, weight))]

    if softcap is not None:
        assert (scale * (hidden @ weight.T)).abs().max() > 2 * softcap  # the cap binds
    want = reference(head(), ids, 0.7, K)
    got = topk.summarize_hidden(
        hidden, weight, ids, topk=K, temperature=0.7, entropy=True, chunk_size=3, scale=scale, softcap=softcap
    )
    assert torch.equal(got.topk_ids, want[2].indices)
    assert torch.allclose(got.topk_logp, want[2].values)
    assert torch.allclose(got.entropy, want[3])
    for a, b in zip(grads(got.lse, got.gathered), grads(*want[:2]), strict=True):
        assert torch.allclose(a, b, atol=1e-12)


CASES = [
    ("topk", "reverse", K),
    ("topk", "forward", K),
    ("topk_paper", "reverse", K),
    ("truncated", "forward", K),
    ("exact", "reverse", V),
    ("exact", "forward", V),
    ("k3", "reverse", 0),
    ("k4", "reverse", 0),
    ("k5", "forward", 0),
]


def summary_path(hidden, weight, ref_logits, sampling_logits, tokens, estimator, direction, k):
    """What the trainer does: rollout pass, anchor pass, update pass, each a summary."""
    sampling = topk.summarize(sampling_logits, tokens.unsqueeze(-1), topk=k if direction == "reverse" else 0)
    if direction == "reverse":
        head_ids = sampling.topk_ids
        ref = topk.summarize(ref_logits, torch.cat([tokens.unsqueeze(-1), head_ids], -1)).logp()
        ref_logp, ref_head = ref[..., 0], ref[..., 1:]
    else:
        ref = topk.summarize(ref_logits, tokens.unsqueeze(-1), topk=k)
        head_ids, ref_logp, ref_head = ref.topk_ids, ref.logp()[..., 0], ref.topk_logp
    ids = torch.cat([tokens.unsqueeze(-1), head_ids], -1)
    policy = topk.summarize_hidden(hidden, weight, ids, chunk_size=3)
    in_head = (head_ids == tokens.unsqueeze(-1)).any(-1)
    return kl.from_summary(
        policy,
        in_head,
        ref_logp,
        ref_head,
        estimator=estimator,
        direction=direction,
        sampling_logp=sampling.logp()[..., 0],
        iw_clip=(0.2, 5.0),
    )


@pytest.mark.parametrize("estimator,direction,k", CASES)
def test_summary_kl_matches_token_kl(estimator, direction, k):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, H, generator=g, dtype=DT, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=DT, requires_grad=True)
    ref_logits = torch.randn(B, T, V, generator=g, dtype=DT)
    sampling_logits = torch.randn(B, T, V, generator=g, dtype=DT)
    tokens = torch.randint(0, V, (B, T), generator=g)
    want = kl.token_kl(
        hidden @ weight.T,
        ref_logits,
        tokens,
        estimator=estimator,
        direction=direction,
        k=k,
        sampling_logp=sampling_logits,
        iw_clip=(0.2, 5.0),
    )
    got = summary_path(hidden, weight, ref_logits, sampling_logits, tokens, estimator, direction, k)
    assert torch.allclose(got, want, atol=1e-12)
    gw = torch.autograd.grad(want.sum(), (hidden, weight))
    gg = torch.autograd.grad(got.sum(), (hidden, weight))
    for a, b in zip(gg, gw, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


class LargestTensors(TorchDispatchMode):
    """Records the largest tensor every op produces, by dtype."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


def test_no_full_fp32_vocab_tensor_is_ever_alive():
    n, vocab, chunk = 64, 1000, 16
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, H, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(vocab, H, generator=g).bfloat16().requires_grad_()
    logits = (hidden.detach() @ weight.detach().T).requires_grad_()
    ids = torch.randint(0, vocab, (n, 4), generator=g)

    with LargestTensors() as from_logits:
        s = topk.summarize(logits, ids, topk=8, entropy=True, chunk_size=chunk)
        (s.lse.sum() + s.gathered.sum()).backward()
    # The gradient of bf16 logits is bf16 [n, V]; nothing fp32 is wider than one chunk.
    assert from_logits.largest[torch.float32] <= chunk * vocab
    assert from_logits.largest[torch.bfloat16] == n * vocab

    with LargestTensors() as from_hidden:
        s = topk.summarize_hidden(hidden, weight, ids, topk=8, entropy=True, chunk_size=chunk)
        (s.lse.sum() + s.gathered.sum()).backward()
    # The weight's gradient is [V, H]; no [n, V] tensor of any dtype exists.
    assert max(from_hidden.largest.values()) <= max(chunk * vocab, vocab * H)
    assert chunk * vocab < n * vocab
