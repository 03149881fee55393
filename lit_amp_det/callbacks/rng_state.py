"""Saves and restores the random-number generators in checkpoints, for exact resume.

Lightning restores weights, optimizer, schedulers and loop progress, but not the global RNGs. Mask R-CNN
draws from them every step (the RPN and RoI-head samplers pick positives and negatives with
``torch.randperm``), so a resumed run would diverge from an uninterrupted one without this callback.
States are stored as tensors and plain data so checkpoints still load with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback

__all__ = ["RNGStateCheckpoint"]


class RNGStateCheckpoint(Callback):
    """Puts the torch (CPU and CUDA), NumPy and Python RNG states into every checkpoint and restores them."""

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        version, python_state, gauss = random.getstate()
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
            "python": {"version": version, "state": list(python_state), "gauss": gauss},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        if state_dict["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
        np_state = state_dict["numpy"]
        np.random.set_state(
            (
                "MT19937",
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached"],
            )
        )
        py_state = state_dict["python"]
        random.setstate((py_state["version"], tuple(py_state["state"]), py_state["gauss"]))
