"""Loading local weights safely and finding the checkpoint a run should resume from.

Weights are loaded with ``torch.load(weights_only=True)``: a checkpoint is data, never code. Both a bare
``state_dict`` of the torchvision model and a Lightning checkpoint (whose ``state_dict`` keys carry the
module's ``model.`` prefix) are accepted.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_model_weights", "resolve_ckpt_path"]

log = logging.getLogger(__name__)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"model.checkpoint={str(path)!r} does not exist or is not a file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt or unsafe files
        raise ValueError(
            f"model.checkpoint={str(path)!r} could not be loaded with weights_only=True ({err}); "
            "pass a state dict or a Lightning checkpoint that holds only tensors and plain data"
        ) from err
    state = payload.get("state_dict", payload) if isinstance(payload, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"model.checkpoint={str(path)!r} holds no state dict of tensors")
    if all(key.startswith("model.") for key in state):
        state = {key[len("model.") :]: value for key, value in state.items()}
    return state


def load_model_weights(model: nn.Module, path: Path, *, strict: bool = True) -> None:
    """Loads ``path`` into ``model``.

    With ``strict=False``, tensors missing from the file or of another shape (a head for another class
    count, say) keep their initialisation and are listed in the log; with ``strict=True`` they are an error.
    """
    state = _read_state_dict(path)
    own = model.state_dict()
    mismatched = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    if mismatched and strict:
        raise ValueError(
            f"model.checkpoint={str(path)!r} has tensors of other shapes for {mismatched[:5]} "
            f"({len(mismatched)} in all); set model.checkpoint_strict=false to skip them (e.g. a new class count)"
        )
    state = {k: v for k, v in state.items() if k not in mismatched}
    result = model.load_state_dict(state, strict=strict)
    skipped = mismatched + list(result.missing_keys)
    if skipped:
        log.warning("model.checkpoint: %d tensors kept their initialisation: %s", len(skipped), skipped[:10])
    if result.unexpected_keys:
        log.warning("model.checkpoint: ignored %d unknown keys: %s", len(result.unexpected_keys), result.unexpected_keys[:10])


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path, runs_root: Path) -> str | None:
    """Turns ``ckpt_path=last`` into a file: this run's ``last.ckpt``, else the newest one under ``runs_root``.

    Any other value is returned unchanged (a path, ``best``, or ``None``), after checking a path exists.
    """
    if ckpt_path is None or ckpt_path in ("best",):
        return ckpt_path
    if ckpt_path == "last":
        own = run_dir / "checkpoints" / "last.ckpt"
        if own.is_file():
            return str(own)
        candidates = sorted(runs_root.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(
                f"ckpt_path=last: no checkpoints/last.ckpt under {run_dir} or {runs_root}; "
                "train first, or pass ckpt_path=/path/to/file.ckpt"
            )
        log.info("ckpt_path=last resolved to %s", candidates[-1])
        return str(candidates[-1])
    if not Path(ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path!r} does not exist; pass a .ckpt file or 'last'")
    return ckpt_path
