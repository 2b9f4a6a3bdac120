"""Numerical guard: an optimiser step whose loss or gradient is not finite is skipped, not taken.

One NaN step would poison the weights, the AdamW moments and (through the EMA) the anchor for
good. Skipping it leaves all three untouched; a run that keeps producing them stops instead,
so its last checkpoint (written before the trouble) stays the last good one.
"""

from __future__ import annotations

import logging
import math

from emapg.errors import DivergedError

log = logging.getLogger("emapg")


def step_is_finite(state, loss: float, grad_norm: float, max_bad_steps: int) -> bool:
    """Whether to take the optimiser step; counts skipped steps in `state` (saved with checkpoints).

    state.skipped_steps: all skipped so far; state.bad_in_row: the current run of them.
    Raises DivergedError at `max_bad_steps` in a row.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        state.bad_in_row = 0
        return True
    state.skipped_steps += 1
    state.bad_in_row += 1
    if state.bad_in_row >= max_bad_steps:
        raise DivergedError(
            f"{state.bad_in_row} optimiser steps in a row had a non-finite loss or gradient "
            f"(train.max_bad_steps={max_bad_steps}); stopped, the last checkpoint is the last good state"
        )
    log.warning(
        "non-finite loss (%s) or gradient norm (%s): optimiser step skipped (%d in a row, %d in all)",
        loss,
        grad_norm,
        state.bad_in_row,
        state.skipped_steps,
    )
    return False
