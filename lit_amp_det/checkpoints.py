"""Loading local weights safely and checking checkpoints before a run uses them.

Weights are loaded with ``torch.load(weights_only=True)``: a checkpoint is data, never code. ``model.weights``
takes a bare ``state_dict`` of the torchvision model or a Lightning checkpoint; ``ckpt_path`` takes Lightning
checkpoints, checked by :func:`check_checkpoint` before Lightning restores them. Every problem is one
:class:`CheckpointError` naming the file, what is wrong (empty, truncated, not a checkpoint, made for another
model, with the differing hyper-parameters) and what to pass instead, rather than torch's unpickler text or
the full list of mismatched keys.
"""

from __future__ import annotations

import logging
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "CLASS_HPARAMS",
    "IMPLEMENTATION_HPARAMS",
    "CheckpointError",
    "architecture_differences",
    "check_checkpoint",
    "load_model_weights",
    "local_weights",
    "names_a_checkpoint_file",
    "read_checkpoint",
    "saved_classes",
]

log = logging.getLogger(__name__)

#: Top-level hyper-parameters that change how the model computes or is scored, not what it is or how it is
#: trained: the implementation transforms and the evaluation settings. A run resumes under other values
#: (``app.runs``).
IMPLEMENTATION_HPARAMS = frozenset({"speedups", "evaluation"})
#: Top-level hyper-parameters that change no tensor's name or shape (never blamed for a mismatch).
_RUNTIME_HPARAMS = IMPLEMENTATION_HPARAMS | {"optim", "weights", "class_names", "category_ids", "transform"}
#: File name endings that make ``model.weights`` a local file rather than a torchvision name.
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".tar")
#: The nested ones that do (the rest of ``rpn``/``roi_heads`` are thresholds and sample counts).
_STRUCTURAL_NESTED = {
    "rpn.anchor_sizes",
    "rpn.aspect_ratios",
    "roi_heads.box_head_width",
    "roi_heads.mask_head_layers",
}
_EXAMPLES = 3  # key names quoted per kind of mismatch
#: The hyper-parameters that say which classes a model detects: background-inclusive count, names, COCO ids.
CLASS_HPARAMS = ("num_classes", "class_names", "category_ids")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the file, the reason and the fix in its message; its ``repr`` is
    the message itself, as Hydra reports errors raised inside ``instantiate`` by their ``repr``.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}: {self}"


def _unreadable(source: str, path: Path, err: Exception) -> CheckpointError:
    """What to say when ``torch.load`` fails: truncated, code inside, or not a checkpoint at all."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
    if (head.startswith(b"PK\x03\x04") and not zipfile.is_zipfile(path)) or isinstance(err, EOFError):
        return CheckpointError(
            f"{source}={str(path)!r} is truncated or corrupted ({size} bytes, the end of the "
            "archive is missing): was it copied while still being written? Use a complete copy, "
            "e.g. checkpoints/last.ckpt of a finished run, or the best-*.ckpt next to it"
        )
    if unsafe := re.search(r"GLOBAL ([\w.]+)", str(err)):
        return CheckpointError(
            f"{source}={str(path)!r} could not be loaded with weights_only=True: it holds Python "
            f"objects ({unsafe.group(1)}), not only tensors and plain data; save model.state_dict() "
            "(or a Lightning checkpoint whose hyper-parameters are plain data) and pass that file"
        )
    return CheckpointError(
        f"{source}={str(path)!r} is not a PyTorch checkpoint (it starts with {head!r}; torch.load "
        f"with weights_only=True raised {type(err).__name__}); pass a .ckpt written by Lightning or "
        "a file written by torch.save(model.state_dict(), path)"
    )


def names_a_checkpoint_file(ckpt_path: str | Path | None) -> bool:
    """Whether a (resolved) ``ckpt_path`` is a file this package reads: not ``None`` (no checkpoint) and not
    Lightning's ``"best"`` (the fit's own best checkpoint, which Lightning finds and reads itself).
    """
    return ckpt_path is not None and str(ckpt_path) != "best"


def local_weights(weights: str | Path | None) -> Path | None:
    """The local file ``model.weights`` names, or None when it names torchvision weights (``COCO_V1``) or
    none. A value is a file when it has a directory part or one of :data:`CHECKPOINT_SUFFIXES`; torchvision's
    names have neither.
    """
    if weights is None or isinstance(weights, bool):
        return None
    text = str(weights)
    if isinstance(weights, Path) or "/" in text or "\\" in text or text.lower().endswith(CHECKPOINT_SUFFIXES):
        return Path(text).expanduser()
    return None


def read_checkpoint(path: str | Path, source: str = "model.weights") -> Any:
    """Loads ``path`` once with ``weights_only=True``; ``source`` is the config key that named it, for
    messages.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("**/last.ckpt")) or sorted(path.glob("**/*.ckpt"))
        hint = f"e.g. {str(found[0])!r}" if found else "e.g. runs/fit/<timestamp>/checkpoints/last.ckpt"
        raise CheckpointError(
            f"{source}={str(path)!r} is a directory; pass the checkpoint file inside it, {hint}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{source}={str(path)!r} does not exist or is not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"{source}={str(path)!r} is empty (0 bytes), not a checkpoint: the run that wrote it "
            "probably died while saving; pass another checkpoint, e.g. the best-*.ckpt next to it"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (
        Exception
    ) as err:  # torch raises EOFError, RuntimeError, UnpicklingError, KeyError ... for bad files
        raise _unreadable(source, path, err) from err


def saved_classes(payload: Any) -> dict[str, Any]:
    """The class hyper-parameters (:data:`CLASS_HPARAMS`) a loaded Lightning checkpoint's module was built
    with: only the keys it holds a value for; empty when it names no class count.
    """
    hparams = payload.get("hyper_parameters") if isinstance(payload, dict) else None
    if not isinstance(hparams, Mapping) or not isinstance(hparams.get("num_classes"), int):
        return {}
    return {
        key: list(value) if isinstance(value, (list, tuple)) else value
        for key in CLASS_HPARAMS
        if (value := hparams.get(key)) is not None
    }


def _state_dict_of(payload: Any, source: str, path: Path) -> dict[str, torch.Tensor]:
    state = payload.get("state_dict", payload) if isinstance(payload, dict) else None
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(v, torch.Tensor) for v in state.values())
    ):
        raise CheckpointError(
            f"{source}={str(path)!r} holds a {type(payload).__name__} but no state dict of tensors; "
            "pass a Lightning .ckpt or a file written by torch.save(model.state_dict(), path)"
        )
    return state


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_structural(key: str) -> bool:
    top = key.split(".", 1)[0]
    if top in _RUNTIME_HPARAMS or key in ("backbone.trainable_layers", "backbone.weights"):
        return False
    return "." not in key or top not in ("rpn", "roi_heads") or key in _STRUCTURAL_NESTED


def _override_value(value: Any) -> str:
    """``value`` as it is written on the command line (``true``, ``null``, ``[16,32]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(value)


def architecture_differences(
    saved: Mapping[str, Any], configured: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """``(model.key, saved, configured)`` for every model hyper-parameter that differs and changes a tensor's
    name or shape (layers, widths, class count); runtime settings and keys only one side has are skipped.
    """
    old, new = _flatten(saved), _flatten(configured)
    keys = [k for k in old if k in new and _is_structural(k) and old[k] != new[k]]
    return [(f"model.{k}", old[k], new[k]) for k in keys]


def _tensor_mismatch(
    saved: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]
) -> dict[str, list[str]]:
    return {
        # BatchNorm fills a missing step counter itself (a FrozenBN checkpoint has none): not a mismatch
        "missing from the file": [
            k for k in own if k not in saved and not k.endswith(".num_batches_tracked")
        ],
        "unexpected": [k for k in saved if k not in own],
        "of other shapes": [k for k in saved if k in own and saved[k].shape != own[k].shape],
    }


def _summary(
    mismatch: Mapping[str, list[str]],
    saved: Mapping[str, torch.Tensor],
    own: Mapping[str, torch.Tensor],
    *,
    examples: bool = True,
) -> str:
    """A few of the names: ``6 tensors of other shapes (roi_heads...weight [7, 64] in the file, ...)``."""
    parts = []
    for kind, keys in mismatch.items():
        if not keys:
            continue
        shown = (
            keys[:_EXAMPLES]
            if kind != "of other shapes"
            else [
                f"{k} {list(saved[k].shape)} in the file, {list(own[k].shape)} here" for k in keys[:_EXAMPLES]
            ]
        )
        more = ", ..." if len(keys) > _EXAMPLES else ""
        parts.append(f"{len(keys)} tensors {kind}" + (f" ({', '.join(shown)}{more})" if examples else ""))
    return "; ".join(parts)


def _mismatch(
    source: str,
    path: Path,
    mismatch: Mapping[str, list[str]],
    saved: Mapping[str, torch.Tensor],
    own: Mapping[str, torch.Tensor],
    saved_hparams: Mapping[str, Any],
    configured: Mapping[str, Any],
) -> tuple[str, list[tuple[str, Any, Any]]]:
    """The first half of the error: which file, and what differs (hyper-parameters if known, else a few
    tensors).
    """
    differences = architecture_differences(saved_hparams, configured)
    name = f"{source}={str(path)!r}"
    if not differences:
        return f"{name} does not fit the configured model: {_summary(mismatch, saved, own)}", differences
    counts = _summary(mismatch, saved, own, examples=False)
    if [k for k, _, _ in differences] == ["model.num_classes"]:
        ((_, made, now),) = differences
        return f"{name} was made with model.num_classes={made}, {now} configured ({counts})", differences
    made = ", ".join(
        f"{k}={_override_value(a)} in the checkpoint, {_override_value(b)} configured"
        for k, a, b in differences
    )
    return f"{name} was made for another model: {made} ({counts})", differences


#: The predictor layers whose shapes follow the class count: re-initialised when fine-tuning on other classes.
_CLASS_LAYERS = ("roi_heads.box_predictor.", "roi_heads.mask_predictor.mask_fcn_logits.")


def load_model_weights(model: nn.Module, path: Path, *, hparams: Mapping[str, Any] | None = None) -> None:
    """Loads ``path`` (``model.weights``) into the detector ``model``. Every tensor must fit, except the
    class-dependent predictor layers when only the class count differs: those keep their fresh initialisation
    (fine-tuning on other classes) and one log line says so. Any other mismatch is one
    :class:`CheckpointError` naming the differing hyper-parameters (given ``hparams``, the module's) and the
    fix.
    """
    payload = read_checkpoint(path, "model.weights")
    state = _state_dict_of(payload, "model.weights", path)
    if all(key.startswith("model.") for key in state):  # a Lightning checkpoint: the detector's tensors
        state = {key[len("model.") :]: value for key, value in state.items()}
    saved = payload.get("hyper_parameters") if isinstance(payload, dict) else None
    saved_hparams = dict(saved) if isinstance(saved, Mapping) else {}
    own = model.state_dict()
    mismatch = _tensor_mismatch(state, own)
    reinitialised = mismatch["of other shapes"]
    only_class_layers = all(key.startswith(_CLASS_LAYERS) for key in reinitialised)
    if mismatch["missing from the file"] or mismatch["unexpected"] or not only_class_layers:
        what, differences = _mismatch(
            "model.weights", path, mismatch, state, own, saved_hparams, hparams or {}
        )
        fixes = " ".join(f"{k}={_override_value(a)}" for k, a, _ in differences if k != "model.num_classes")
        build = (
            f"{fixes} to build the model it was made for" if fixes else "the model settings it was made with"
        )
        raise CheckpointError(f"{what}; pass {build}")
    model.load_state_dict({k: v for k, v in state.items() if k not in reinitialised}, strict=False)
    if reinitialised:
        log.warning(
            "model.weights=%r: the file was made for another class count; %d class-dependent predictor "
            "tensors keep their fresh initialisation (%s)",
            str(path),
            len(reinitialised),
            ", ".join(reinitialised[:_EXAMPLES]) + (", ..." if len(reinitialised) > _EXAMPLES else ""),
        )


def check_checkpoint(
    ckpt_path: str | Path | None, module: nn.Module, checkpoint: Any = None
) -> dict[str, Any] | None:
    """Checks ``ckpt_path`` before Lightning restores it into ``module`` (the configured LightningModule).

    Compares the file's ``state_dict`` with the built module's (the class count comes from the data); a
    mismatch is one :class:`CheckpointError` naming the differing hyper-parameters and the overrides that fix
    it. Returns the checkpoint read (or ``checkpoint``, if the caller read it); ``None`` for ``None`` and
    ``"best"``, left to Lightning.
    """
    if not names_a_checkpoint_file(ckpt_path):
        return None
    path = Path(ckpt_path)
    payload = checkpoint if checkpoint is not None else read_checkpoint(path, "ckpt_path")
    if not isinstance(payload, dict) or "state_dict" not in payload:
        _state_dict_of(payload, "ckpt_path", path)  # raises unless it is a bare state dict
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is a bare state dict, not a Lightning checkpoint (ckpt_path "
            f"restores the whole training state); pass it as model.weights={str(path)!r} instead"
        )
    state = _state_dict_of(payload, "ckpt_path", path)
    own = module.state_dict()
    mismatch = _tensor_mismatch(state, own)
    if not any(mismatch.values()) or not getattr(module, "strict_loading", True):
        return payload
    what, differences = _mismatch(
        "ckpt_path",
        path,
        mismatch,
        state,
        own,
        payload.get("hyper_parameters") or {},
        getattr(module, "hparams", {}),
    )
    fixes = " ".join(f"{k}={_override_value(a)}" for k, a, _ in differences)
    if [k for k, _, _ in differences] == ["model.num_classes"]:
        advice = (
            f"a checkpoint resumes or scores only the model it was made for: to fine-tune its weights on "
            f"these classes start a new run with model.weights={str(path)!r} instead of ckpt_path, or pass "
            f"{fixes} with the data it was trained on"
        )
    elif fixes:
        advice = f"pass {fixes} to use it"
    else:
        advice = "pass the model settings it was made with"
    raise CheckpointError(f"{what}; {advice}")
