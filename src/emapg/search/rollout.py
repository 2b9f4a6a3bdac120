"""Multi-turn search rollouts: generate, retrieve, insert `<information>`, continue.

Each turn runs `generate_from_ids` (HF generate with the KV cache) over the episodes still
active, from their token ids so far; a turn ends at `</search>`, `</answer>`, EOS or the
length limit. The result is one ordinary Rollout whose response region is the concatenation
of model turns and inserted information. Inserted tokens are attended to (attention_mask 1)
but have response_mask False, so the policy loss, KL, entropy and anchor summaries skip them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from emapg.rollout.base import Rollout
from emapg.rollout.hf import _eos_ids, generate_from_ids
from emapg.search.answers import INFORMATION, STOP, turn_action
from emapg.search.retriever import Retriever, format_information


class _Episode:
    """One episode's response so far, as parallel per-token lists."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.ids: list[int] = []
        self.model_token: list[bool] = []
        self.logp: list[float] = []
        self.topk: list[Tensor] = []
        self.entropy: list[float] = []
        self.searches = 0

    def add(self, ids, model_token: bool, logp, topk, entropy) -> None:
        self.ids += ids
        self.model_token += [model_token] * len(ids)
        self.logp += logp
        self.topk += list(topk)
        self.entropy += entropy


def information_block(docs: list[dict]) -> str:
    """The text the environment inserts after a search."""
    return f"\n{INFORMATION[0]}{format_information(docs)}{INFORMATION[1]}\n"


def _left_pad(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def search_rollout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    retriever: Retriever,
    *,
    docs_per_search: int,
    max_turns: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    topk: int = 0,
    stop: list[str] = (),
    batch_size: int = 256,
    add_special_tokens: bool = True,
    first_row: int = 0,
) -> Rollout:
    """Up to `max_turns` searches per episode, then one more turn to answer; `max_new_tokens`
    bounds the whole response region (model tokens and inserted information)."""
    eos = set(_eos_ids(model, tokenizer))
    enc = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]
    episodes = [_Episode(p) for p in enc]
    active = list(range(len(episodes)))
    stops = [*STOP, *stop]
    while active:
        budget = [max_new_tokens - len(episodes[i].ids) for i in active]
        ids, mask = _left_pad([episodes[i].prompt + episodes[i].ids for i in active], tokenizer.pad_token_id)
        out = generate_from_ids(
            model, tokenizer, ids, mask, max_new_tokens=max(budget), temperature=temperature,
            top_p=top_p, greedy=greedy, topk=topk, stop=stops, batch_size=batch_size, first_row=first_row,
        )  # fmt: skip
        searching, queries = [], []
        for row, (i, room) in enumerate(zip(active, budget, strict=True)):
            n = min(int(out.response_mask[row].sum()), room)  # a turn may not outrun its own budget
            new = out.responses[row, :n].tolist()
            ep = episodes[i]
            ep.add(
                new, True, out.sampling_logp[row, :n].tolist(), out.topk_ids[row, :n].cpu(),
                out.entropy[row, :n].tolist(),
            )  # fmt: skip
            action, query = turn_action(tokenizer.decode(new, skip_special_tokens=True))
            ended = n == room or (new and new[-1] in eos)
            if action == "search" and not ended and ep.searches < max_turns:
                searching.append(i)
                queries.append(query)
        k = out.topk_ids.shape[-1]
        for i, docs in zip(searching, retriever.retrieve(queries, docs_per_search), strict=True):
            ep = episodes[i]
            ep.searches += 1
            info = tokenizer(information_block(docs), add_special_tokens=False)["input_ids"][
                : max_new_tokens - len(ep.ids)
            ]
            ep.add(
                info, False, [0.0] * len(info), torch.zeros(len(info), k, dtype=torch.long), [0.0] * len(info)
            )
        active = [i for i in searching if len(episodes[i].ids) < max_new_tokens]
    return _to_rollout(tokenizer, episodes, out.topk_ids.shape[-1], next(model.parameters()).device)


def _to_rollout(tokenizer, episodes: list[_Episode], k: int, device) -> Rollout:
    prompt_ids, prompt_mask = _left_pad([e.prompt for e in episodes], tokenizer.pad_token_id)
    n, width = len(episodes), max(1, max(len(e.ids) for e in episodes))
    responses = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    real = torch.zeros(n, width, dtype=torch.bool)
    response_mask = torch.zeros(n, width, dtype=torch.bool)
    logp, entropy = torch.zeros(n, width), torch.zeros(n, width)
    topk_ids = torch.zeros(n, width, k, dtype=torch.long)
    for i, e in enumerate(episodes):
        m = len(e.ids)
        if not m:
            continue
        responses[i, :m] = torch.tensor(e.ids)
        real[i, :m] = True
        response_mask[i, :m] = torch.tensor(e.model_token)
        logp[i, :m], entropy[i, :m] = torch.tensor(e.logp), torch.tensor(e.entropy)
        topk_ids[i, :m] = torch.stack(e.topk)
    texts = [tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
    return Rollout(
        sequences=torch.cat([prompt_ids, responses], 1).to(device),
        attention_mask=torch.cat([prompt_mask, real.long()], 1).to(device),
        prompt_len=prompt_ids.shape[1],
        response_mask=response_mask.to(device),
        sampling_logp=logp.to(device),
        topk_ids=topk_ids.to(device),
        entropy=entropy.to(device),
        texts=texts,
    )
