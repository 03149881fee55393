"""Command-line overrides, checked before Hydra runs them.

* Every argument of Lightning's ``Trainer`` is a setting under ``trainer.``: one the trainer config does not
  list (``trainer.limit_val_batches=2``) is added as Hydra's ``+trainer.limit_val_batches=2`` would add it.
* A key that is not a setting stops the command with one message that names the closest settings
  (``trainer.max_epoch=2``: did you mean ``trainer.max_epochs``?), instead of Hydra's "not in struct".
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from lit_amp_det.app.config import compose

__all__ = ["UnknownSetting", "prepare_overrides"]


class UnknownSetting(SystemExit):
    """A command-line key that is not a setting; its message says which ones come close."""


def _trainer_arguments() -> list[str]:
    from lightning.pytorch import Trainer

    return [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]


def _keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a composed config (mappings inside lists are not descended into)."""
    if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
        return []
    return [
        k for key in node.keys() for k in (f"{prefix}{key}", *_keys(node._get_node(key), f"{prefix}{key}."))
    ]


def prepare_overrides(overrides: Sequence[str], multirun: bool = False) -> list[str]:
    """``overrides`` with ``+`` added to Lightning ``Trainer`` arguments the trainer config lacks; for a
    single run, a key that is not a setting raises :class:`UnknownSetting` (a multirun's sweep values are
    Hydra's to check).
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException

    values = [o for o in overrides if "=" in o and not o.startswith(("+", "~", "hydra."))]
    choices = [o for o in values if "." not in o.split("=", 1)[0] and "," not in o]
    try:
        base = compose(choices)
    except (ConfigCompositionException, MissingConfigException):
        return list(overrides)  # a group option that does not exist: Hydra's message lists the options
    arguments = _trainer_arguments()
    listed = set(base.get("trainer") or ())
    prepared = []
    for override in overrides:
        key = override.split("=", 1)[0]
        name = key.removeprefix("trainer.")
        if override in values and key.startswith("trainer.") and name in arguments and name not in listed:
            override = "+" + override
        prepared.append(override)
    if multirun:
        return prepared
    try:
        compose(prepared)
    except ConfigCompositionException as err:
        key = getattr(err.__cause__, "full_key", None)
        if not key or "not in struct" not in str(err.__cause__):
            return prepared  # Hydra reports it, with its own message
        known = list(dict.fromkeys([*_keys(base), *(f"trainer.{name}" for name in arguments)]))
        close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise UnknownSetting(
            f"lit_amp_det: {key} is not a setting.{hint}\nEvery setting: python -m lit_amp_det fit "
            f"--cfg job (a key of your own: +{key}=...)"
        ) from None
    return prepared
