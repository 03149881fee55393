"""Checkpoints written straight into their folder, durably, and a full disk that loses nothing.

Lightning's default IO serialises a checkpoint into memory and writes it through an fsspec transaction, whose
temporary file lives in the system temp folder: a save needs room for a second copy elsewhere, and a full disk
leaves partial files behind. :class:`DurableCheckpointIO` writes ``.<name>.tmp`` beside the checkpoint, fsyncs
it, renames it over the old file and fsyncs the folder (so a power loss keeps one of the two), and on a failed
write removes the partial file, keeps the old checkpoint and raises :class:`DiskFull` when the disk is full.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["DiskFull", "DurableCheckpointIO", "fsync_folder"]


class DiskFull(OSError):
    """A write found no room: what was being written and what was kept are in the message."""


def fsync_folder(folder: Path) -> None:
    """Makes a rename in ``folder`` durable (a no-op where folders cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _out_of_space(err: BaseException | None) -> bool:
    """Whether ``err`` (or what it arose from) is a full disk; torch's zip writer reports one as a
    RuntimeError.
    """
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, RuntimeError) and "write failed" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


class DurableCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``.<name>.tmp`` beside the checkpoint, fsync, rename, fsync the folder (see the
    module).
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
            fsync_folder(path.parent)
        except (OSError, RuntimeError) as err:
            tmp.unlink(missing_ok=True)
            if not _out_of_space(err):
                raise
            free = shutil.disk_usage(path.parent).free / 2**20
            kept = (
                f"the previous {path.name} is kept" if path.is_file() else f"no earlier {path.name} existed"
            )
            raise DiskFull(
                errno.ENOSPC,
                f"no space left on the disk of {path.parent} to save {path.name} ({free:.0f} "
                f"MB free; the partial file is removed, {kept}). Free space, then resume with "
                "ckpt_path=last",
            ) from err
