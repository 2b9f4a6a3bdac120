"""Per-token summaries of a distribution over the vocabulary, computed in chunks of tokens.

A summary keeps, per token, the logsumexp over the vocabulary, the logits gathered at a few
requested ids (the sampled token and the top-k set q) and, when asked, this distribution's
own top-k ids and its entropy. It is all the KL estimators need (emapg.kl.from_logprobs).

Memory: only one chunk of `chunk_size` tokens is ever widened to fp32 [chunk, V]. Gradients
flow through the logsumexp and the gathered logits by hand-written backward passes that
recompute each chunk, so autograd never holds a [T, V] fp32 tensor either. From hidden
states plus the LM head weight (`summarize_hidden`) not even the [T, V] logits exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# 16 MiB of fp32 per [chunk, V] buffer (27 tokens at a Qwen vocabulary): the work space
# then stays under 1% of exact KL's memory (benchmarks/kl_bench.py) at little cost in time.
CHUNK_ELEMENTS = 1 << 22


def wide_dtype(x: Tensor) -> torch.dtype:
    """fp32 for the arithmetic of bf16/fp16/fp32 inputs; float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def default_chunk_size(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


@dataclass
class Summary:
    """Per-token statistics of softmax(logits / temperature); leading dims are the tokens'."""

    lse: Tensor  # [...] logsumexp over the vocabulary (fp32, differentiable)
    gathered: Tensor  # [..., m] logits at the requested ids (fp32, differentiable)
    topk_ids: Tensor  # [..., k] this distribution's top-k ids, k >= 0 (no gradient)
    topk_logp: Tensor  # [..., k] its log-probs there (no gradient)
    entropy: Tensor | None  # [...], when asked (no gradient)

    def logp(self) -> Tensor:
        """Log-probs at the requested ids [..., m]."""
        return self.gathered - self.lse.unsqueeze(-1)


def _chunk_forward(x: Tensor, ids: Tensor, topk: int, with_entropy: bool):
    """x: fp32 [c, V] tempered logits of one chunk."""
    lse = torch.logsumexp(x, dim=-1)
    gathered = x.gather(-1, ids)
    top = x.topk(topk, dim=-1) if topk else None
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(x, dim=-1) * x).sum(-1)
    return lse, gathered, top, entropy


def _chunk_grad_logits(x: Tensor, lse: Tensor, ids: Tensor, g_lse: Tensor, g_gathered: Tensor) -> Tensor:
    """d loss / d x for one chunk: softmax(x) * g_lse + scatter(g_gathered)."""
    grad = torch.exp(x - lse.unsqueeze(-1)) * g_lse.unsqueeze(-1)
    return grad.scatter_add_(-1, ids, g_gathered)


class _Forward:
    """Runs the chunk loop shared by both autograd functions; `logits_of(a, b)` makes a chunk."""

    def __init__(self, n: int, m: int, topk: int, with_entropy: bool, like: Tensor):
        kw = {"dtype": wide_dtype(like), "device": like.device}
        self.lse = torch.empty(n, **kw)
        self.gathered = torch.empty(n, m, **kw)
        self.topk_ids = torch.empty(n, topk, dtype=torch.long, device=like.device)
        self.topk_logp = torch.empty(n, topk, **kw)
        self.entropy = torch.empty(n, **kw) if with_entropy else None
        self.topk, self.with_entropy = topk, with_entropy

    def run(self, logits_of, ids: Tensor, chunk_size: int):
        n = ids.shape[0]
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            lse, gathered, top, entropy = _chunk_forward(
                logits_of(a, b), ids[a:b], self.topk, self.with_entropy
            )
            self.lse[a:b], self.gathered[a:b] = lse, gathered
            if top is not None:
                self.topk_ids[a:b] = top.indices
                self.topk_logp[a:b] = top.values - lse.unsqueeze(-1)
            if entropy is not None:
                self.entropy[a:b] = entropy
        return self.lse, self.gathered, self.topk_ids, self.topk_logp, self.entropy


class _SummarizeLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, inv_temp, topk, with_entropy, chunk_size):
        acc = _Forward(ids.shape[0], ids.shape[1], topk, with_entropy, logits)
        out = acc.run(lambda a, b: logits[a:b].to(acc.lse.dtype) * inv_temp, ids, chunk_size)
        ctx.save_for_backward(logits, ids, out[0])
        ctx.inv_temp, ctx.chunk_size = inv_temp, chunk_size
        ctx.mark_non_differentiable(*[t for t in out[2:] if t is not None])
        return out

    @staticmethod
    def backward(ctx, g_lse, g_gathered, *_):
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk_size):
            b = min(a + ctx.chunk_size, logits.shape[0])
            x = logits[a:b].to(lse.dtype) * ctx.inv_temp
            g = _chunk_grad_logits(x, lse[a:b], ids[a:b], g_lse[a:b], g_gathered[a:b])
            grad[a:b] = g * ctx.inv_temp
        return grad, None, None, None, None, None


def _head_logits(z: Tensor, scale: float, softcap: float | None, inv_temp: float) -> Tensor:
    """Tempered logits x of one chunk from z = hidden @ W.T (fp32): softcap(scale * z) / T,

    with softcap(y) = c * tanh(y / c) (none when c is None).
    """
    if softcap is None:
        return z * (scale * inv_temp)
    return torch.tanh(z * (scale / softcap)).mul_(softcap * inv_temp)


def _scale_by_slope(g: Tensor, x: Tensor, scale: float, softcap: float | None, inv_temp: float) -> Tensor:
    """d loss / d z from g = d loss / d x, in place: dx/dz = (1 - tanh^2) * scale / T. Consumes x."""
    if softcap is None:
        return g.mul_(scale * inv_temp)
    slope = x.mul_(1.0 / (softcap * inv_temp)).square_().neg_().add_(1.0).mul_(scale * inv_temp)
    return g.mul_(slope)


class _SummarizeHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, inv_temp, scale, softcap, topk, with_entropy, chunk_size):
        acc = _Forward(ids.shape[0], ids.shape[1], topk, with_entropy, hidden)

        def logits_of(a, b):
            return _head_logits((hidden[a:b] @ weight.T).to(acc.lse.dtype), scale, softcap, inv_temp)

        out = acc.run(logits_of, ids, chunk_size)
        ctx.save_for_backward(hidden, weight, ids, out[0])
        ctx.head = (scale, softcap, inv_temp)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(*[t for t in out[2:] if t is not None])
        return out

    @staticmethod
    def backward(ctx, g_lse, g_gathered, *_):
        """By blocks of the vocabulary rather than chunks of tokens, in the same work space: each
        block's logits of every token at once, so the matmuls are large (at Qwen's vocabulary a
        token chunk is 27 rows), and each row of the weight's gradient is written once, where every
        token chunk would read and write all of it (docs/design.md, "Speed")."""
        hidden, weight, ids, lse = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        block = max(1, ctx.chunk_size * vocab // max(n, 1))
        grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for a in range(0, vocab, block):
            b = min(a + block, vocab)
            w = weight[a:b]
            x = _head_logits((hidden @ w.T).to(lse.dtype), *ctx.head)
            g = torch.exp(x - lse.unsqueeze(-1)) * g_lse.unsqueeze(-1)
            here = (ids >= a) & (ids < b)  # requested ids in this block
            g.index_put_((here.nonzero()[:, 0], ids[here] - a), g_gathered[here], accumulate=True)
            g = _scale_by_slope(g, x, *ctx.head).to(hidden.dtype)
            grad_hidden += g @ w
            if grad_weight is not None:
                grad_weight[a:b] = g.T @ hidden
        grad_hidden = grad_hidden.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _pack(lead: torch.Size, out, topk: int) -> Summary:
    """Restore the caller's leading dimensions."""
    lse, gathered, topk_ids, topk_logp, entropy = out
    return Summary(
        lse=lse.view(lead),
        gathered=gathered.view(*lead, -1),
        topk_ids=topk_ids.view(*lead, topk),
        topk_logp=topk_logp.view(*lead, topk),
        entropy=entropy.view(lead) if entropy is not None else None,
    )


def summarize(
    logits: Tensor,
    ids: Tensor,
    *,
    topk: int = 0,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int | None = None,
) -> Summary:
    """Summary of softmax(logits / temperature) [..., V] at `ids` [..., m], chunk by chunk."""
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    chunk = chunk_size or default_chunk_size(vocab)
    out = _SummarizeLogits.apply(
        logits.reshape(-1, vocab),
        ids.reshape(-1, ids.shape[-1]).long(),
        1.0 / temperature,
        topk,
        entropy,
        chunk,
    )
    return _pack(lead, out, topk)


def summarize_hidden(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    topk: int = 0,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
) -> Summary:
    """Like `summarize` for logits = hidden [..., H] @ weight[V, H].T, never materialised whole.

    With `scale` and `softcap` c the logits are c * tanh(scale * hidden @ weight.T / c) (no cap
    when c is None), as an LM head that scales or soft-caps them makes them (emapg.lm_head).
    """
    lead = hidden.shape[:-1]
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    out = _SummarizeHidden.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        ids.reshape(-1, ids.shape[-1]).long(),
        1.0 / temperature,
        float(scale),
        None if softcap is None else float(softcap),
        topk,
        entropy,
        chunk,
    )
    return _pack(lead, out, topk)
