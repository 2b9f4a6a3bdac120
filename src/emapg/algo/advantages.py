"""Advantage estimators of outcome rewards, as pure tensor functions behind one registry.

An estimator takes the step's whole batch (every process's rows: its figures do not depend on
how the batch is split), `rewards` [N] with the `group_size` samples of a prompt contiguous and
`lengths` [N] (response tokens of each sample), and returns one advantage per sample; every
response token of a sample gets it. Built in (verl's names in brackets):

- grpo: (r - group mean) / (group std + eps), std with Bessel's correction [grpo].
- drgrpo: r - group mean (Dr. GRPO: no std) [grpo, norm_adv_by_std_in_grpo=False].
- batch_std: (r - group mean) / (std of the whole batch + eps).
- rloo: r - mean of the other samples of the group, = n / (n - 1) (r - group mean) [rloo].
- reinforce_pp: REINFORCE++ with outcome rewards (gamma 1, the KL in the loss, not the reward):
  the returns r, whitened over every response token of the batch (mean and Bessel std weighted
  by length) [reinforce_plus_plus].

A group whose rewards are all equal carries no signal: grpo, drgrpo, batch_std and rloo give it
exactly zero (not a float rounding of r - mean, which with partial-credit rewards is not 0 and
divided by a std of ~1e-8 becomes a push on every sample). `algo.advantage` also takes
`module:function` or `path/to/file.py:function`, a function of (rewards, group_size, lengths)
with the same contract.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from emapg.errors import EmapgError

Estimator = Callable[[Tensor, int, Tensor], Tensor]


def _centred(rewards: Tensor, group_size: int) -> Tensor:
    """[groups, group_size] rewards minus their group's mean, exactly 0 in a group of equal rewards."""
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    uniform = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return centred.masked_fill(uniform, 0.0)


def grpo(rewards: Tensor, group_size: int, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    groups = rewards.float().view(-1, group_size)
    return (_centred(rewards, group_size) / (groups.std(dim=1, keepdim=True) + eps)).reshape(-1)


def drgrpo(rewards: Tensor, group_size: int, lengths: Tensor) -> Tensor:
    return _centred(rewards, group_size).reshape(-1)


def batch_std(rewards: Tensor, group_size: int, lengths: Tensor, eps: float = 1e-6) -> Tensor:
    return (_centred(rewards, group_size) / (rewards.float().std() + eps)).reshape(-1)


def rloo(rewards: Tensor, group_size: int, lengths: Tensor) -> Tensor:
    return (_centred(rewards, group_size) * group_size / (group_size - 1)).reshape(-1)


def reinforce_pp(rewards: Tensor, group_size: int, lengths: Tensor, eps: float = 1e-8) -> Tensor:
    r, w = rewards.double(), lengths.double()
    tokens = w.sum()
    mean = (w * r).sum() / tokens
    var = (w * (r - mean) ** 2).sum() / (tokens - 1)
    return (r - mean) * torch.rsqrt(var + eps)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo, "drgrpo": drgrpo, "batch_std": batch_std, "rloo": rloo, "reinforce_pp": reinforce_pp,
}  # fmt: skip
NEEDS_GROUPS = ("grpo", "batch_std", "rloo")  # a group of one has no std or leave-one-out mean


def estimator(name: str) -> Estimator:
    """A built-in estimator, or the function `module:function` / `path/to/file.py:function` names."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    if ":" not in name:
        raise EmapgError(
            f"algo.advantage: unknown {name!r}; expected one of {', '.join(ESTIMATORS)} or module:function"
        )
    from emapg.user_code import load_function  # late: user code

    return load_function(name, "algo.advantage")


def advantages(name: str, rewards: Tensor, group_size: int, lengths: Tensor) -> Tensor:
    """Per-sample advantages [N] (float32) of the estimator `name`; see the module doc."""
    if group_size < 1 or rewards.numel() % group_size:
        raise EmapgError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if name in NEEDS_GROUPS and group_size < 2:
        raise EmapgError(f"algo.advantage={name} needs rollout.group_size >= 2; use drgrpo or reinforce_pp")
    out = estimator(name)(rewards, group_size, lengths)
    if not isinstance(out, Tensor) or out.shape != rewards.shape or not bool(torch.isfinite(out).all()):
        raise EmapgError(
            f"algo.advantage={name}: expected {rewards.numel()} finite advantages, got {out!r:.80}"
        )
    return out.float()


def overlong_shaping(lengths: Tensor, limit: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment per response [N]: 0 up to `limit - buffer` tokens, then
    falling linearly to -1 at the length limit (`algo.overlong_penalty` scales it; buffer 0: off)."""
    if not buffer:
        return torch.zeros(len(lengths))
    return -((lengths.double() - (limit - buffer)).clamp(min=0) / buffer).clamp(max=1).float()
