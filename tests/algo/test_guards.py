"""Non-finite losses (emapg.algo.guards): each skips its optimiser step, too many in a row stop the
run. A run's non-finite steps, weights untouched: tests/training/test_update.py."""

import math

import pytest

from emapg.algo.guards import step_is_finite
from emapg.errors import EmapgError
from emapg.training.run import TrainerState


def test_counts_skips_and_stops_at_the_limit():
    state = TrainerState()
    assert step_is_finite(state, 1.0, 2.0, 3)
    assert not step_is_finite(state, math.nan, 2.0, 3)
    assert not step_is_finite(state, 1.0, math.inf, 3)
    assert step_is_finite(state, 1.0, 2.0, 3)  # a good step ends the run of bad ones
    assert (state.skipped_steps, state.bad_in_row) == (2, 0)
    assert not step_is_finite(state, math.nan, math.nan, 3)
    assert not step_is_finite(state, math.nan, math.nan, 3)
    with pytest.raises(EmapgError, match="3 optimiser steps in a row had a non-finite loss"):
        step_is_finite(state, math.nan, math.nan, 3)
