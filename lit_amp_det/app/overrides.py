"""Command-line overrides, checked before Hydra runs them.

* Every argument of Lightning's ``Trainer`` is a setting under ``trainer.``: one the trainer config does not
  list (``trainer.limit_val_batches=2``) is added as Hydra's ``+trainer.limit_val_batches=2`` would add it.
* A key that is not a setting stops the command with one message that names the closest settings
  (``trainer.max_epoch=2``: did you mean ``trainer.max_epochs``?), instead of Hydra's "not in struct".
* A setting's old name (:data:`~lit_amp_det.app.config.RENAMED_SETTINGS`: ``data.seed``) stops the command,
  naming the new one, in a multirun too.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from lit_amp_det.app.config import compose, renamed_setting

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
    return [k for key in node for k in (f"{prefix}{key}", *_keys(node._get_node(key), f"{prefix}{key}."))]


def _is_unknown_key(error: BaseException | None) -> bool:
    """Whether OmegaConf refused a key as missing from the config: a plain node in struct mode ("not in
    struct") or a typed schema (``lit_amp_det.settings``: "not in 'RPNSettings'").
    """
    return isinstance(error, (ConfigAttributeError, ConfigKeyError)) and " not in " in str(error)


def _refuse_renamed(overrides: Sequence[str]) -> None:
    """Raises :class:`UnknownSetting` for an override of a setting's old name, naming the new one."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if (message := renamed_setting(key)) is not None:
            raise UnknownSetting(f"lit_amp_det: {message}")


def prepare_overrides(overrides: Sequence[str], multirun: bool = False) -> list[str]:
    """``overrides`` with ``+`` added to Lightning ``Trainer`` arguments the trainer config lacks.

    Args:
        overrides: the command line's ``key=value`` overrides.
        multirun: a sweep (``-m``): its values are Hydra's to check.

    Returns:
        The overrides as Hydra should read them.

    Raises:
        UnknownSetting: an old setting name (always), or for a single run a key that is not a setting; the
            message names the setting meant.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException

    _refuse_renamed(overrides)
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
        if not key or not _is_unknown_key(err.__cause__):
            return prepared  # Hydra reports it, with its own message
        known = list(dict.fromkeys([*_keys(base), *(f"trainer.{name}" for name in arguments)]))
        close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise UnknownSetting(
            f"lit_amp_det: {key} is not a setting.{hint}\nEvery setting: python -m lit_amp_det fit "
            f"--cfg job (a key of your own: +{key}=...)"
        ) from None
    return prepared
