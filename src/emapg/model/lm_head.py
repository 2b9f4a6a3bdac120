"""How a causal LM makes its logits from its last hidden state, and the summaries built on it.

The trainer and the TRL integration never materialise [tokens, vocab] logits: they catch the
final hidden states and run the chunked fused head of `topk.summarize_hidden`. That is only
right when the fused head computes exactly the model's own logits, so one function decides
it for every model (`head_of`), and the first fused pass of each model checks the decision
against the logits the model itself returns for its last position (`final_hidden`).

Handled exactly, as the installed transformers computes them after `lm_head` (no bias):

- plain heads (Llama, Qwen, Mistral, ...): logits = h @ W.T;
- Cohere / Cohere2 (`logit_scale`): logits = (h @ W.T) * logit_scale;
- Granite and its MoE variants (`logits_scaling`): logits = (h @ W.T) / logits_scaling;
- Gemma 2 / 3 (`final_logit_softcapping` c): logits = c * tanh((h @ W.T) / c).

Anything else (a head with a bias or that is no `nn.Linear`, a forward without
`logits_to_keep`, a config field known to change the logits in another way, or a scale and a
soft-cap together, whose order is not known) gets no `Head`: callers then use the model's
own full logits.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from emapg.algo import topk
from emapg.batch import Rollout
from emapg.model import prompt_cache
from emapg.model.lora import unwrap

# Config fields that change the logits in a way the fused head does not reproduce (muP-style
# output multipliers, RecurrentGemma's cap, a head padded past the vocabulary).
_UNHANDLED = ("output_multiplier", "lm_head_multiplier", "logits_soft_cap", "unpadded_vocab_size")


@dataclass(frozen=True, eq=False)
class Head:
    """logits = softcap(scale * hidden @ weight.T), softcap(y) = c * tanh(y / c) (none: c None).

    The products are accumulated and returned in float32 whatever the model computes in
    (`topk.head_matmul`); their operands are rounded to the dtype the model computes in: autocast's
    under autocast (bf16-mixed), else the weight's."""

    weight: Tensor  # [V, H] the output embedding
    scale: float = 1.0
    softcap: float | None = None

    def operand(self, hidden: Tensor) -> torch.dtype:
        device = hidden.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype

    def logits(self, hidden: Tensor) -> Tensor:
        """The full fp32 logits [..., V]; for checks, never on whole sequences."""
        operand = self.operand(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            flat = hidden.reshape(-1, hidden.shape[-1])
            z = topk.head_matmul(flat, self.weight.T, operand).view(*hidden.shape[:-1], -1) * self.scale
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def summarize(self, hidden: Tensor, ids: Tensor, **kwargs) -> topk.Summary:
        """`topk.summarize_hidden` through this head; kwargs: temperature, topk, entropy, chunk_size."""
        return topk.summarize_hidden(
            hidden, self.weight, ids, scale=self.scale, softcap=self.softcap, operand=self.operand(hidden),
            **kwargs,
        )  # fmt: skip


# Per model: (scale, softcap) of its head or None, decided once; and whether the first fused
# pass confirmed it against the model's own logits.
_FORMS: weakref.WeakKeyDictionary[nn.Module, tuple[float, float | None] | None] = weakref.WeakKeyDictionary()
_CONFIRMED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def backbone(model: nn.Module) -> nn.Module | None:
    """The module whose output's last_hidden_state feeds the LM head, or None if there is none."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def _is_neutral(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1)


def _form(model: nn.Module) -> tuple[float, float | None] | None:
    """(scale, softcap) when logits == softcap(scale * hidden @ W.T) exactly, else None."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(out, nn.Linear) or out.bias is not None or backbone(model) is None:
        return None
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not all(_is_neutral(getattr(config, name, None)) for name in _UNHANDLED):
        return None
    scale = 1.0
    logit_scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    if logit_scale is not None:
        scale *= float(logit_scale)
    logits_scaling = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if logits_scaling is not None:
        scale /= float(logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3: c * tanh(logits / c)
    if softcap is not None:
        softcap = float(softcap)
        if scale != 1.0 or not (math.isfinite(softcap) and softcap > 0):
            return None
    if not (math.isfinite(scale) and scale != 0.0):
        return None
    return scale, softcap


def head_of(model: nn.Module) -> Head | None:
    """The model's LM head when the fused chunked head reproduces its logits exactly, else None.

    Decided once per model (the signature and config inspection is cached); the weight is
    looked up on every call, so it is the model's current output embedding.
    """
    if model not in _FORMS:
        _FORMS[model] = _form(model)
    form = _FORMS[model]
    if form is None:
        return None
    return Head(model.get_output_embeddings().weight, *form)


def _last_hidden(output) -> Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _agrees(head: Head, hidden: Tensor, logits: Tensor) -> bool:
    """Whether the fused head's logits match the model's own, up to its dtype's rounding."""
    if logits.shape[-1] != head.weight.shape[0]:
        return False
    theirs = logits.detach().float()
    ours = head.logits(hidden.detach())
    # The coarser of the two computations' rounding: under autocast the model's logits are bfloat16's
    # (even when handed back widened), and the head's operands are rounded to it.
    eps = max(torch.finfo(logits.dtype).eps, torch.finfo(head.operand(hidden)).eps)
    tol = max(4 * eps, 1e-3) * (1.0 + theirs.abs().amax(-1, keepdim=True))
    return bool(((ours - theirs).abs() <= tol).all())


def final_hidden(model: nn.Module, **inputs) -> tuple[Tensor, Head] | None:
    """The final hidden states [N, S, H] of `model(**inputs)` and its head, without [N, S, V] logits.

    Runs the root forward (where FSDP gathers the head and embeddings) keeping the logits of
    the last position only, and catches the hidden states as they leave the backbone. None
    when the model has no exact head (`head_of`), or when, at the model's first fused pass,
    the head does not reproduce the logits it returned: callers then use full logits.
    """
    model = unwrap(model)
    if head_of(model) is None:
        return None
    caught = []
    hook = backbone(model).register_forward_hook(lambda _m, _a, out: caught.append(_last_hidden(out)))
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    head = head_of(model)
    if model not in _CONFIRMED:
        with torch.no_grad():
            ok = len(caught) == 1 and _agrees(head, caught[0][:, -1], out.logits[:, -1])
        if not ok:
            _FORMS[model] = None
            warnings.warn(
                f"emapg: the fused LM head does not reproduce {type(model).__name__}'s logits; "
                "using its full logits instead (more memory)",
                stacklevel=2,
            )
            return None
        _CONFIRMED.add(model)
    return caught[0], head


def positions_of(mask: Tensor) -> Tensor:
    """Position ids of left-padded rows: each real token's index among its row's real tokens."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _shared_prompt_pass(model: nn.Module, batch: Rollout, groups: Tensor, fused: bool) -> Tensor | None:
    """The model's outputs at columns P - 1 .. S - 2 (the final hidden states with `fused`, else
    the logits), each group's prompt computed once: one pass over the distinct prompts fills a KV
    cache, the cache is repeated to the group's rows, and a second pass runs the responses on it.
    The same function of the weights as one pass over whole rows, gradients included (they flow
    through the repeated cache into the prompt pass). None where the model cannot
    (`prompt_cache.empty_cache`): whole rows then. Dropout, where a model has any,
    draws one mask per group for its prompt. Both passes run through `final_hidden` with a fused
    head, so the prompt pass confirms the head and a run takes the same path from its first pass
    (a resumed run too)."""
    cache = prompt_cache.empty_cache(model)
    if cache is None:
        return None
    keyword = prompt_cache.cache_keyword(model)
    p, mask = batch.prompt_len, batch.attention_mask
    positions, first = positions_of(mask), prompt_cache.group_starts(groups)

    def forward(ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: int) -> Tensor | None:
        """One pass on the cache: its final hidden states (fused: `final_hidden`, which also
        confirms the head at the model's first pass; None if it does not) or its logits (of the
        last `keep` positions; 0: all)."""
        inputs = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": True, keyword: cache}  # fmt: skip
        if not fused:
            return model(**inputs, logits_to_keep=keep).logits
        out = final_hidden(model, **inputs)
        return None if out is None else out[0]

    last = forward(batch.sequences[first, :p], mask[first, :p], positions[first, :p], keep=1)
    if last is None:
        return None  # the head is not the model's: whole rows, full logits
    prompt_cache.repeat_to_groups(cache, groups)
    responses = forward(batch.sequences[:, p:], mask, positions[:, p:], keep=0)
    return torch.cat([last[:, -1:].repeat_interleave(groups, 0), responses[:, :-1]], 1)


def response_summary(
    model: nn.Module,
    batch: Rollout,
    ids: Tensor,
    *,
    temperature: float,
    topk_self: int = 0,
    entropy: bool = False,
    share_prompts: bool = False,
) -> topk.Summary:
    """Summary of the model's tempered distribution at every response position, at `ids` [N, L, m]
    (and its entropy, with `entropy`).

    The hidden state at column P + t - 1 predicts response token t. A peft model runs as its
    transformers model (its LoRA layers are in it), so its fused head is found the same way.
    With `share_prompts`, rows that share a prompt (a group) compute it once
    (`_shared_prompt_pass`).
    """
    model = unwrap(model)
    groups = prompt_cache.prompt_groups(*batch.prompts) if share_prompts else None
    if groups is not None:
        fused = head_of(model) is not None
        out = _shared_prompt_pass(model, batch, groups, fused)
        if out is not None:
            summarize = head_of(model).summarize if fused else topk.summarize
            return summarize(out, ids, topk=topk_self, temperature=temperature, entropy=entropy)
    mask = batch.attention_mask
    inputs = {
        "input_ids": batch.sequences,
        "attention_mask": mask,
        "position_ids": positions_of(mask),
    }
    p = batch.prompt_len
    fused = final_hidden(model, **inputs)
    if fused is not None:
        hidden, head = fused
        return head.summarize(
            hidden[:, p - 1 : -1], ids, topk=topk_self, temperature=temperature, entropy=entropy
        )
    logits = model(**inputs).logits
    return topk.summarize(
        logits[:, p - 1 : -1], ids, topk=topk_self, temperature=temperature, entropy=entropy
    )
