"""What the precision plugins put in a checkpoint besides the GradScaler's state: the step guard's counts and
the ``trainer.precision`` that ran, which :func:`lit_amp_det.precision.build.trained_precision` reads back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_amp_det.precision.guard import NonFiniteStepGuard

__all__ = ["GUARD_KEY", "PRECISION_KEY", "load_recorded_state", "recorded_state"]

#: the key under which each plugin's checkpoint state records the precision that trained it
PRECISION_KEY = "precision"
#: the key of the non-finite step guard's counts
GUARD_KEY = "guard"


def recorded_state(precision: str, guard: NonFiniteStepGuard) -> dict[str, Any]:
    """The guard's counts and the precision, to merge into a plugin's ``state_dict()`` (a host read of the
    counts).
    """
    return {GUARD_KEY: guard.state_dict(), PRECISION_KEY: precision}


def load_recorded_state(state_dict: Mapping[str, Any], guard: NonFiniteStepGuard) -> dict[str, Any]:
    """Loads the guard's counts from a plugin's checkpoint state; returns the rest (the GradScaler's state, if
    any).

    States saved before the plugins recorded the precision or the guard load too (nothing to restore).
    """
    state = dict(state_dict)
    guard.load_state_dict(state.pop(GUARD_KEY, {}))
    state.pop(PRECISION_KEY, None)
    return state
