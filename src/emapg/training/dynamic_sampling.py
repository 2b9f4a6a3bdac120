"""DAPO's dynamic sampling: a step trains on groups whose rewards differ.

A group whose samples all get the same reward has zero advantage under every group baseline: it
adds nothing to the policy gradient but noise from its KL and its share of the loss's
normalisation. With `algo.dynamic_sampling` a step samples rounds of `rollout.prompts_per_step`
prompts and keeps, in order, the groups whose (task) rewards are not all equal, until it has
`prompts_per_step` of them. After `algo.max_sampling_rounds` rounds it stops: the last round's
groups without signal, in order, fill what is still missing, so a step always has the same shape
(they get zero advantage; their tokens still carry the KL).

Every process samples its slice of each round, but the choice is made on the whole round's
rewards, the same on every process, and the kept groups are exchanged so that each process then
trains on its slice of the global list: the run is the run of one process on the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from emapg import distributed
from emapg.batch import Rollout


def uniform_groups(rewards: Tensor, group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive rewards: whether they are all equal (no signal)."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1).tolist()


def round_picks(uniform: list[bool], kept: int, quota: int, last: bool) -> list[int]:
    """The groups of one round a step keeps, in order: those with signal until `quota` groups are
    kept (`kept` already are); on the `last` round, groups without signal fill what is missing."""
    picks = [g for g, same in enumerate(uniform) if not same][: quota - kept]
    if last and kept + len(picks) < quota:
        fill = [g for g, same in enumerate(uniform) if same][: quota - kept - len(picks)]
        picks = sorted(picks + fill)
    return picks


@dataclass
class Round:
    """One process's slice of a round: its examples (each repeated for its group), its sampled
    rows, and per row the reward and its named parts."""

    examples: list
    batch: Rollout
    rewards: list[float]
    parts: list[dict | None]

    def select(self, rows: list[int]) -> Round:
        return Round(
            [self.examples[r] for r in rows],
            self.batch.select(torch.tensor(rows, dtype=torch.long)).to("cpu"),
            [self.rewards[r] for r in rows],
            [self.parts[r] for r in rows],
        )


def collect(sample_round: Callable[[], Round], quota: int, group_size: int, max_rounds: int, pad_id: int):
    """Rounds from `sample_round` (this process's slice of `quota` prompts' groups) until `quota`
    groups with signal are kept or `max_rounds` ran. Returns this process's slice of the kept
    groups (a Round, global order) and the metrics sampling/rounds and sampling/filtered_frac
    (groups without signal left out, of all groups sampled)."""
    local_groups = quota // distributed.world()
    first = distributed.rank() * local_groups
    kept: list[Round] = []
    n_kept = filtered = sampled = 0
    for number in range(1, max_rounds + 1):
        mine = sample_round()
        rewards = torch.tensor([r for rank in distributed.all_gather(mine.rewards) for r in rank])
        uniform = uniform_groups(rewards, group_size)
        picks = round_picks(uniform, n_kept, quota, number == max_rounds)
        sampled += len(uniform)
        filtered += sum(uniform) - sum(uniform[g] for g in picks)
        rows = [
            (g - first) * group_size + i
            for g in picks
            if first <= g < first + local_groups
            for i in range(group_size)
        ]
        kept += [part for part in distributed.all_gather(mine.select(rows)) if part.examples]
        n_kept += len(picks)
        if n_kept == quota:
            break
    whole = Round(
        [e for part in kept for e in part.examples],
        Rollout.cat([part.batch for part in kept], pad_id),
        [r for part in kept for r in part.rewards],
        [p for part in kept for p in part.parts],
    )
    mine = list(range(first * group_size, (first + local_groups) * group_size))
    return whole.select(mine), {"sampling/rounds": number, "sampling/filtered_frac": filtered / sampled}
