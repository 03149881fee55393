"""The optimisation and evaluation settings of :class:`~lit_amp_det.MaskRCNNModule`, checked where they are
read.

The module takes them as two plain mappings (``optim``, ``evaluation``), so that its hyper-parameters stay
plain data in every checkpoint; these dataclasses are what the module reads, made once in its constructor,
which fails before any work on a wrong value and names the setting. :class:`OptimSettings` and its defaults
(``conf/optim/adamw.yaml``'s) live in :mod:`lit_amp_det.settings` with the model's other typed settings.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lit_amp_det.errors import ArgumentError
from lit_amp_det.optim import check_reference_batch
from lit_amp_det.settings import OptimSettings

__all__ = [
    "EVAL_BACKENDS",
    "EvaluationSettings",
    "OptimSettings",
    "check_eval_backend",
    "check_evaluation",
    "check_optim",
]

#: ``evaluation.backend`` (the library behind torchmetrics' ``MeanAveragePrecision``) -> the pip package
#: providing it. Both give the same numbers; faster-coco-eval computes faster, its mask encoding is slower on
#: large images.
EVAL_BACKENDS = {"faster_coco_eval": "faster-coco-eval", "pycocotools": "pycocotools"}


@dataclass(frozen=True)
class EvaluationSettings:
    """``mask_threshold`` (probability above which a mask pixel is the instance's) and the COCO
    ``backend``.
    """

    mask_threshold: float = 0.5
    backend: str = "faster_coco_eval"


def _unknown_keys(node: str, given: Mapping[str, Any], known: tuple[str, ...]) -> None:
    extra = sorted(set(given) - set(known))
    if extra:
        raise ArgumentError(node, dict(given), f"has unknown keys {extra}; known: {list(known)}")


def check_optim(optim: Mapping[str, Any] | None) -> OptimSettings:
    """``optim`` checked.

    Args:
        optim: ``optimizer``, ``scheduler`` and ``reference_batch``; missing keys take the defaults of
            :class:`~lit_amp_det.settings.OptimSettings` (``conf/optim/adamw.yaml``'s). ``None``: all of them.

    Returns:
        The settings the module reads.

    Raises:
        ArgumentError: an unknown key, an optimizer or scheduler without a ``_target_``, or a bad
            ``reference_batch``; the message names the key.
    """
    given = dict(optim or {})
    _unknown_keys("optim", given, ("optimizer", "scheduler", "reference_batch"))
    defaults = OptimSettings()
    optimizer = given.get("optimizer", defaults.optimizer)
    if not isinstance(optimizer, Mapping) or not optimizer.get("_target_"):
        raise ArgumentError("optim.optimizer", optimizer, "needs a _target_ (e.g. torch.optim.AdamW)")
    scheduler = given.get("scheduler", defaults.scheduler)
    if scheduler and (not isinstance(scheduler, Mapping) or not scheduler.get("_target_")):
        raise ArgumentError(
            "optim.scheduler",
            scheduler,
            "needs a _target_ (e.g. lit_amp_det.optim.warmup_schedule), or null for a constant lr",
        )
    reference = given.get("reference_batch")
    try:
        check_reference_batch(reference)
    except ArgumentError as err:
        raise err.at("optim") from None
    return OptimSettings(dict(optimizer), dict(scheduler) if scheduler else None, reference)


def check_eval_backend(backend: object) -> None:
    """Raises unless ``backend`` is a name in :data:`EVAL_BACKENDS` whose package imports, so that a misspelt
    name or a missing package stops a run before any work rather than at the first validation:
    :class:`ArgumentError` (a ``ValueError``) for an unknown name, ``ModuleNotFoundError`` naming ``pip
    install`` and the other backend for a missing package.
    """
    if backend not in EVAL_BACKENDS:
        raise ArgumentError(
            "evaluation.backend", backend, f"is unknown; choose one of {', '.join(EVAL_BACKENDS)}"
        )
    try:
        importlib.import_module(str(backend))
    except ImportError as err:
        package = EVAL_BACKENDS[str(backend)]
        other = next(name for name in EVAL_BACKENDS if name != backend)
        raise ModuleNotFoundError(
            f"model.evaluation.backend={backend!r} needs the {package!r} package, which does not import "
            f"({err}). Install it with `pip install {package}` (`make install` does), or set "
            f"model.evaluation.backend={other}."
        ) from err


def check_evaluation(evaluation: Mapping[str, Any] | None) -> EvaluationSettings:
    """``evaluation`` (``mask_threshold``, ``backend``; missing keys take the defaults) checked."""
    given = dict(evaluation or {})
    _unknown_keys("evaluation", given, ("mask_threshold", "backend"))
    defaults = EvaluationSettings()
    threshold = given.get("mask_threshold", defaults.mask_threshold)
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not (math.isfinite(threshold) and 0 <= threshold < 1)
    ):
        raise ArgumentError("evaluation.mask_threshold", threshold, "must be a probability in [0, 1)")
    backend = given.get("backend", defaults.backend)
    check_eval_backend(backend)
    return EvaluationSettings(float(threshold), str(backend))
