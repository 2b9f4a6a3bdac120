"""Per-token summaries of a distribution over the vocabulary, computed a slab of logits at a time.

A summary keeps, per token, the logsumexp over the vocabulary, the logits gathered at a few
requested ids (the sampled token and the top-k set q) and, when asked, this distribution's
own top-k ids and its entropy. It is all the KL estimators need (emapg.algo.kl.from_logprobs).

Memory: no more than `chunk_size` x V logits are ever widened to fp32 at once: from logits
(`summarize`) a chunk of `chunk_size` tokens, from hidden states and the LM head weight
(`summarize_hidden`, where not even the [T, V] logits exist) a tile of tokens against a block of
the vocabulary (`_tiles`). Gradients flow through the logsumexp and the gathered logits by
hand-written backward passes that recompute each chunk or slab, so autograd never holds a
[T, V] fp32 tensor either.
"""

from __future__ import annotations

from contextlib import contextmanager
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
    """The outputs of a summary, and the token-chunk loop of `_SummarizeLogits` (`logits_of(a, b)`
    makes a chunk)."""

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


def head_matmul(a: Tensor, b: Tensor, operand: torch.dtype) -> Tensor:
    """a [m, k] @ b [k, n] with the operands rounded to `operand` and the products accumulated and
    returned in float32 (float64 stays float64): the LM head's logits and their gradients. A
    bfloat16 matmul would round its output to bfloat16 (2^-9 relative: 0.03 nats at a logit of 16).
    With bfloat16 operands (bf16 compute) a GPU multiplies with CUDA's float32-output kernel
    (`out_dtype`), a CPU a float32 matmul that oneDNN runs on bfloat16 operands (its "bf16" fp32
    precision, the CPU's TF32: AMX speed where the CPU has it). oneDNN leaves the smallest products
    (under about 10^4 multiply-adds: never an LM head's) and CPUs without bfloat16 in exact float32."""
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    if operand != torch.bfloat16 or wide == torch.float64:
        return a.to(wide) @ b.to(wide)
    if a.device.type == "cuda":
        return torch.mm(a.to(operand), b.to(operand), out_dtype=torch.float32)
    with _bfloat16_products():
        return a.float() @ b.float()


@contextmanager
def _bfloat16_products():
    """float32 matmuls on a CPU through oneDNN with bfloat16 operands, float32 accumulation and
    output (a process-wide setting, restored on the way out)."""
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    setting.fp32_precision = "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before


def _head_logits(z: Tensor, scale: float, softcap: float | None, inv_temp: float) -> Tensor:
    """Tempered logits x of one chunk from z = hidden @ W.T (fp32): softcap(scale * z) / T,

    with softcap(y) = c * tanh(y / c) (none when c is None). In place: z is the slab's own
    (each in-place pass saves a [tile, block] allocation and a pass over memory).
    """
    if softcap is None:
        factor = scale * inv_temp
        return z if factor == 1.0 else z.mul_(factor)
    return z.mul_(scale / softcap).tanh_().mul_(softcap * inv_temp)


def _scale_by_slope(g: Tensor, x: Tensor, scale: float, softcap: float | None, inv_temp: float) -> Tensor:
    """d loss / d z from g = d loss / d x, in place: dx/dz = (1 - tanh^2) * scale / T. Consumes x."""
    if softcap is None:
        factor = scale * inv_temp
        return g if factor == 1.0 else g.mul_(factor)
    slope = x.mul_(1.0 / (softcap * inv_temp)).square_().neg_().add_(1.0).mul_(scale * inv_temp)
    return g.mul_(slope)


# Rows of one matmul of the head: from about this many on a GEMM runs near this machine's peak,
# where a token chunk at Qwen's vocabulary is 27 rows (benchmarks/roofline.py, docs/design.md "Speed").
TILE_ROWS = 512


def _tiles(n: int, vocab: int, chunk_size: int) -> tuple[int, int]:
    """Token tile and vocabulary block of the head's matmuls: tiles of up to max(chunk_size,
    TILE_ROWS) tokens, and blocks of the vocabulary small enough that a [tile, block] slab holds
    no more than the chunk_size x vocab elements of one token chunk."""
    rows = max(1, min(n, max(chunk_size, TILE_ROWS)))
    return rows, max(1, chunk_size * vocab // rows)


def _in_block(ids: Tensor, a: int, b: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The requested ids that fall in vocabulary block [a, b): their mask, and their (row,
    column) positions in a [rows, b - a] slab."""
    here = (ids >= a) & (ids < b)
    return here, (here.nonzero()[:, 0], ids[here] - a)


class _SummarizeHidden(torch.autograd.Function):
    """Tile by tile of tokens, block by block of the vocabulary (`_tiles`): the forward keeps a
    running max, sum of exponentials (and their x-weighted sum, for the entropy) and top-k across
    blocks; the backward writes each block's rows of the weight's gradient once per tile."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, inv_temp, scale, softcap, topk, with_entropy, chunk_size, operand):
        with torch.autocast(hidden.device.type, enabled=False):  # the operand dtype is ours to choose
            return _SummarizeHidden._forward(
                ctx, hidden, weight, ids, inv_temp, scale, softcap, topk, with_entropy, chunk_size, operand
            )

    @staticmethod
    def _forward(ctx, hidden, weight, ids, inv_temp, scale, softcap, topk, with_entropy, chunk_size, operand):
        head = (scale, softcap, inv_temp)
        n, vocab = hidden.shape[0], weight.shape[0]
        out = _Forward(n, ids.shape[1], topk, with_entropy, hidden)
        kw = {"dtype": out.lse.dtype, "device": hidden.device}
        rows, block = _tiles(n, vocab, chunk_size)
        for t in range(0, n, rows):
            h, tile_ids = hidden[t : t + rows], ids[t : t + rows]
            r = h.shape[0]
            peak = torch.full((r,), -torch.inf, **kw)
            total, moment = torch.zeros(r, **kw), torch.zeros(r, **kw)  # sums of e and e * x
            gathered = out.gathered[t : t + r]
            top_values, top_ids = (
                torch.empty(r, 0, **kw),
                torch.empty(r, 0, dtype=torch.long, device=h.device),
            )
            for a in range(0, vocab, block):
                x = _head_logits(head_matmul(h, weight[a : a + block].T, operand).to(out.lse.dtype), *head)
                new_peak = torch.maximum(peak, x.amax(-1))
                rescale = torch.exp(peak - new_peak)
                e = (x - new_peak.unsqueeze(-1)).exp_()
                total = total * rescale + e.sum(-1)
                if with_entropy:
                    moment = moment * rescale + (e * x).sum(-1)
                peak = new_peak
                here, where = _in_block(tile_ids, a, a + x.shape[1])
                gathered[here] = x[where]
                if topk:
                    mine = x.topk(min(topk, x.shape[1]), dim=-1)
                    values = torch.cat([top_values, mine.values], -1)
                    best = values.topk(min(topk, values.shape[1]), dim=-1)
                    top_values = best.values
                    top_ids = torch.cat([top_ids, mine.indices + a], -1).gather(-1, best.indices)
            lse = peak + total.log()
            out.lse[t : t + r] = lse
            if topk:
                out.topk_ids[t : t + r], out.topk_logp[t : t + r] = top_ids, top_values - lse.unsqueeze(-1)
            if with_entropy:
                out.entropy[t : t + r] = lse - moment / total
        result = (out.lse, out.gathered, out.topk_ids, out.topk_logp, out.entropy)
        ctx.save_for_backward(hidden, weight, ids, out.lse)
        ctx.head, ctx.chunk_size, ctx.operand = head, chunk_size, operand
        ctx.mark_non_differentiable(*[t for t in result[2:] if t is not None])
        return result

    @staticmethod
    def backward(ctx, g_lse, g_gathered, *_):
        with torch.autocast(g_lse.device.type, enabled=False):
            return _SummarizeHidden._backward(ctx, g_lse, g_gathered)

    @staticmethod
    def _backward(ctx, g_lse, g_gathered):
        hidden, weight, ids, lse = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, block = _tiles(n, vocab, ctx.chunk_size)
        grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)
        grad_weight = (
            torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for t in range(0, n, rows):
            h, tile_ids = hidden[t : t + rows], ids[t : t + rows]
            tile_lse, tile_g_lse = lse[t : t + rows].unsqueeze(-1), g_lse[t : t + rows].unsqueeze(-1)
            tile_g_gathered = g_gathered[t : t + rows]
            for a in range(0, vocab, block):
                w = weight[a : a + block]
                x = _head_logits(head_matmul(h, w.T, ctx.operand).to(lse.dtype), *ctx.head)
                # exp(x - lse) * g_lse: in x's own memory where the slope below does not need x
                g = (x.sub_(tile_lse) if ctx.head[1] is None else x - tile_lse).exp_().mul_(tile_g_lse)
                here, where = _in_block(tile_ids, a, a + x.shape[1])
                g.index_put_(where, tile_g_gathered[here], accumulate=True)
                g = _scale_by_slope(g, x, *ctx.head)
                grad_hidden[t : t + rows] += head_matmul(g, w, ctx.operand)
                if grad_weight is not None:
                    grad_weight[a : a + block] += head_matmul(g.T, h, ctx.operand)
        grad_hidden = grad_hidden.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


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
    operand: torch.dtype | None = None,
) -> Summary:
    """Like `summarize` for logits = hidden [..., H] @ weight[V, H].T, never materialised whole.

    With `scale` and `softcap` c the logits are c * tanh(scale * hidden @ weight.T / c) (no cap
    when c is None), as an LM head that scales or soft-caps them makes them (emapg.model.lm_head).
    `operand`: the dtype the matmuls' operands are rounded to (default: `hidden`'s), whose products
    are accumulated in float32 whatever it is (`head_matmul`): bfloat16 for bf16 compute.
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
        operand or hidden.dtype,
    )
    return _pack(lead, out, topk)
