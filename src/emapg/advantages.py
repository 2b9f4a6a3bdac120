"""Group-relative advantages (GRPO and its variants) as pure tensor functions.

Rewards arrive as a flat [num_prompts * group_size] tensor, the samples of one prompt
contiguous. Every response token of a sample gets its sample's advantage.
"""

from __future__ import annotations

from torch import Tensor

from emapg.errors import EmapgError

MODES = ("grpo", "drgrpo", "batch_std")


def group_advantages(rewards: Tensor, group_size: int, mode: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-sample advantages.

    grpo: (r - group mean) / (group std + eps), std with Bessel's correction as in GRPO.
    drgrpo: r - group mean (Dr. GRPO: no std, which biases towards easy/hard prompts).
    batch_std: (r - group mean) / (std of the whole batch + eps).
    A group whose rewards are all equal gets zero advantages, never NaN.
    """
    if mode not in MODES:
        raise EmapgError(f"advantage mode must be one of {', '.join(MODES)}; got {mode!r}")
    if group_size < 1 or rewards.numel() % group_size:
        raise EmapgError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if mode != "drgrpo" and group_size < 2:
        raise EmapgError(f"advantage mode {mode!r} needs group_size >= 2 for a std; use 'drgrpo'")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if mode == "grpo":
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    elif mode == "batch_std":
        centred = centred / (rewards.float().std() + eps)
    return centred.reshape(-1)
