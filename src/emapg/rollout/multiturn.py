"""Multi-turn episodes: the model writes a turn, an environment answers, the model goes on.

Any rollout engine drives the model and any `Environment` answers: each turn samples the
episodes still active from their token ids so far (no decode/re-encode round trip can change a
token the policy sampled); a turn ends at one of the environment's stop strings, EOS or the
episode's token budget. The environment then returns text to insert (e.g. retrieved passages)
or None to end the episode. The result is one ordinary Rollout whose response region is the
model's turns and the inserted text: inserted tokens are attended to (attention_mask 1) but have
response_mask False, so the policy loss, KL, entropy and anchor summaries skip them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from emapg.rollout.base import Rollout, RolloutEngine, SamplingParams, left_pad


@runtime_checkable
class Environment(Protocol):
    """What answers the model in multi-turn episodes; one instance serves one batch of episodes."""

    stop: tuple[str, ...]  # strings that end a model turn (e.g. "</search>"), besides EOS

    def reset(self, prompts: Sequence[str]) -> None:
        """Begin one episode per prompt (the task's prompt text, before any chat template)."""
        ...

    def step(self, episodes: Sequence[int], turns: Sequence[str]) -> list[str | None]:
        """The model's latest turn of each listed episode -> text to insert, or None: done."""
        ...


@dataclass
class _Episode:
    """One episode's response so far, as parallel per-token lists."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # True: written by the model
    logp: list[float] = field(default_factory=list)
    topk: list[Tensor] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)

    def add(self, ids: list[int], sampled: bool, logp: list[float], topk, entropy: list[float]) -> None:
        self.ids += ids
        self.sampled += [sampled] * len(ids)
        self.logp += logp
        self.topk += list(topk)
        self.entropy += entropy


@torch.no_grad()
def run_episodes(
    engine: RolloutEngine,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eos: Sequence[int],
    rows: Sequence[int] | None = None,
) -> Rollout:
    """Run one episode per prompt until the environment ends it, the model writes EOS, or the
    episode has used `params.max_new_tokens` tokens (model turns and inserted text together).

    `rows[i]` is episode i's global row index (default 0..N-1); every turn samples each episode
    under its own row, so episodes draw the same tokens whichever batch or rank runs them.
    """
    rows = list(range(len(prompts))) if rows is None else list(rows)
    env.reset(prompts)
    episodes = [_Episode() for _ in prompts]
    active = list(range(len(prompts)))
    turn_params = replace(params, stop=(*env.stop, *params.stop))
    eos = set(eos)
    k = params.topk
    while active:
        budget = [params.max_new_tokens - len(episodes[i].ids) for i in active]
        out = engine.sample(
            [list(prompt_ids[i]) + episodes[i].ids for i in active],
            replace(turn_params, max_new_tokens=max(budget)),
            rows=[rows[i] for i in active],
        )
        answering, turns = [], []
        for row, (i, room) in enumerate(zip(active, budget, strict=True)):
            n = min(int(out.response_mask[row].sum()), room)  # a turn may not outrun its own budget
            new = out.responses[row, :n].tolist()
            episodes[i].add(
                new, True, out.sampling_logp[row, :n].tolist(), out.topk_ids[row, :n].cpu(),
                out.entropy[row, :n].tolist(),
            )  # fmt: skip
            if n < room and not (new and new[-1] in eos):
                answering.append(i)
                turns.append(tokenizer.decode(new, skip_special_tokens=True))
        active = []
        for i, text in zip(answering, env.step(answering, turns) if answering else [], strict=True):
            if text is None:
                continue
            ep = episodes[i]
            inserted = tokenizer(text, add_special_tokens=False)["input_ids"][
                : params.max_new_tokens - len(ep.ids)
            ]
            ep.add(inserted, False, [0.0] * len(inserted), torch.zeros(len(inserted), k, dtype=torch.long),
                   [0.0] * len(inserted))  # fmt: skip
            if len(ep.ids) < params.max_new_tokens:
                active.append(i)
    return _to_rollout(tokenizer, prompt_ids, episodes, k)


def _to_rollout(tokenizer, prompt_ids: Sequence[Sequence[int]], episodes: list[_Episode], k: int) -> Rollout:
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
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
        response_mask[i, :m] = torch.tensor(e.sampled)
        logp[i, :m], entropy[i, :m] = torch.tensor(e.logp), torch.tensor(e.entropy)
        topk_ids[i, :m] = torch.stack(e.topk)
    return Rollout(
        sequences=torch.cat([prompts, responses], 1),
        attention_mask=torch.cat([prompt_mask, real.long()], 1),
        prompt_len=prompts.shape[1],
        response_mask=response_mask,
        sampling_logp=logp,
        topk_ids=topk_ids,
        entropy=entropy,
        texts=[tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes],
    )
