"""Multi-turn episodes: the model writes a turn, an environment answers, the model goes on.

Any rollout engine drives the model and any `Environment` answers: each turn samples the
episodes still active from their token ids so far (no decode/re-encode round trip can change a
token the policy sampled); a turn ends at one of the environment's stop strings, EOS or its
token limit. The environment then returns text to insert (e.g. retrieved passages) or None to
end the episode. The result is one ordinary Rollout whose response region is the model's turns
and the inserted text: inserted tokens are attended to (attention_mask 1) but have
response_mask False, so the policy loss, KL, entropy and anchor summaries skip them.

Limits (Search-R1's): `params.max_new_tokens` new tokens per model turn; each inserted text cut
to `max_observation_tokens` tokens; prompt plus response capped at `max_context` tokens (a turn
gets at most the room left, and an episode whose context is full ends); optionally the whole
response capped at `max_response_tokens`. An environment may carry `max_observation_tokens` and
`max_context` attributes; `sample_examples` passes them on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedTokenizerBase

from emapg import distributed
from emapg.batch import ResponseRow, Rollout, rollout_from_rows
from emapg.prompts import encode_prompts
from emapg.rollout.base import RolloutEngine, SamplingParams
from emapg.tasks.base import Environment


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
    max_context: int | None = None,
    max_observation_tokens: int | None = None,
    max_response_tokens: int | None = None,
) -> Rollout:
    """Run one episode per prompt until the environment ends it, the model writes EOS, or the
    episode has no room left.

    Each model turn samples at most `params.max_new_tokens` tokens, and never more than the room
    left under `max_context` (prompt + response tokens) and `max_response_tokens` (response
    tokens: model turns and inserted text together); None: no such cap. A turn that fills the
    room ends the episode without asking the environment (nothing more would fit); any other
    turn that does not end in EOS goes to the environment, the per-turn limit included. Inserted
    text is cut to `max_observation_tokens` tokens, then to the room left; an episode whose room
    is then used up ends.

    `rows[i]` is episode i's global row index (default 0..N-1); every turn samples each episode
    under its own row, so episodes draw the same tokens whichever batch or rank runs them.
    """
    rows = list(range(len(prompts))) if rows is None else list(rows)
    env.reset(prompts)
    episodes = _Episodes(prompt_ids, max_context, max_response_tokens, max_observation_tokens, params.topk)
    turn_params = replace(params, stop=(*env.stop, *params.stop))
    eos = set(eos)
    active = [i for i in range(len(prompts)) if episodes.room(i) > 0]
    # Under torchrun every rank runs a turn while any rank has an episode left (FSDP's forward
    # passes are collective): a rank with none left runs a padding turn of one token.
    while distributed.max_one(len(active)) > 0:
        if not active:
            engine.sample([list(prompt_ids[0])], replace(turn_params, max_new_tokens=1), rows=[rows[0]])
            continue
        answering, turns = _model_turn(engine, tokenizer, episodes, active, rows, turn_params, eos)
        replies = env.step(answering, turns) if answering else []
        active = [
            i
            for i, text in zip(answering, replies, strict=True)
            if text is not None and episodes.insert(i, tokenizer(text, add_special_tokens=False)["input_ids"])
        ]
    return rollout_from_rows(episodes.rows, prompt_ids, tokenizer, params.topk)


def _model_turn(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    episodes: _Episodes,
    active: list[int],
    rows: list[int],
    params: SamplingParams,
    eos: set[int],
) -> tuple[list[int], list[str]]:
    """One model turn of the `active` episodes, each capped at `params.max_new_tokens` and its
    room left; returns the episodes that now wait for the environment, and their turns' text."""
    budget = [int(min(params.max_new_tokens, episodes.room(i))) for i in active]
    out = engine.sample(
        [list(episodes.prompt_ids[i]) + episodes.rows[i].ids for i in active],
        replace(params, max_new_tokens=max(budget)),
        rows=[rows[i] for i in active],
    )
    answering, turns = [], []
    for row, (i, limit) in enumerate(zip(active, budget, strict=True)):
        new = episodes.add_turn(i, out, row, limit)
        ended = bool(new) and new[-1] in eos
        if episodes.room(i) <= 0:
            episodes.rows[i].truncated = not ended  # no room left: the episode is cut
        elif not ended:
            answering.append(i)
            turns.append(tokenizer.decode(new, skip_special_tokens=True))
    return answering, turns


class _Episodes:
    """The episodes of one `run_episodes` call: each one's tokens so far, and the caps on them."""

    def __init__(self, prompt_ids, max_context, max_response_tokens, max_observation_tokens, k: int):
        self.prompt_ids, self.k = prompt_ids, k
        self.max_context, self.max_response_tokens = max_context, max_response_tokens
        self.max_observation_tokens = max_observation_tokens
        self.rows = [ResponseRow() for _ in prompt_ids]

    def room(self, i: int) -> float:
        """Tokens episode i may still add under the context and response caps."""
        used = len(self.rows[i].ids)
        context = math.inf if self.max_context is None else self.max_context - len(self.prompt_ids[i]) - used
        response = math.inf if self.max_response_tokens is None else self.max_response_tokens - used
        return min(context, response)

    def add_turn(self, i: int, out: Rollout, row: int, limit: int) -> list[int]:
        """Row `row` of the engine's output, up to its own `limit`, as episode i's next model turn."""
        n = min(int(out.response_mask[row].sum()), limit)
        new = out.responses[row, :n].tolist()
        self.rows[i].add(
            new,
            True,
            out.sampling_logp[row, :n].tolist(),
            out.topk_ids[row, :n].tolist(),
            out.entropy[row, :n].tolist(),
        )
        return new

    def insert(self, i: int, ids: list[int]) -> bool:
        """The environment's reply, cut to the observation cap and the room left, into episode i
        (not sampled: masked out of the loss); False when the episode has no room left after it."""
        if self.max_observation_tokens is not None:
            ids = ids[: self.max_observation_tokens]
        left = self.room(i)
        ids = ids if left == math.inf else ids[: int(left)]
        self.rows[i].add(ids, False, [0.0] * len(ids), [[0] * self.k] * len(ids), [0.0] * len(ids))
        if self.room(i) > 0:
            return True
        self.rows[i].truncated = True
        return False


def sample_examples(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task,
    examples: Sequence,
    params: SamplingParams,
    *,
    chat_template: bool,
    eos: Sequence[int],
    rows: Sequence[int] | None = None,
) -> Rollout:
    """One response per example (repeat an example for a group): a single turn, or multi-turn
    episodes when the task has an environment (with the episode limits it carries:
    `max_context`, `max_observation_tokens`). `rows` as in `RolloutEngine.sample`."""
    prompts = [e.prompt for e in examples]
    prompt_ids = encode_prompts(tokenizer, prompts, chat_template)
    env = task.environment()
    if env is None:
        return engine.sample(prompt_ids, params, rows=rows)
    return run_episodes(
        engine,
        env,
        tokenizer,
        prompts,
        prompt_ids,
        params,
        eos=eos,
        rows=rows,
        max_context=env.max_context,
        max_observation_tokens=env.max_observation_tokens,
    )
