"""Decode every image a run will read before it starts, so a corrupt file stops the run at once, not hours in.

:func:`verify_images` decodes the files with the loader's own reader in a thread pool and checks each image's
size against its annotation record; files that decoded before are cached by path, size and modification time.
:func:`check_splits` runs it over the splits of a stage and raises one :class:`BadImagesError` listing every
unreadable file, or (``bad_images="skip"``) drops them from their split with one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from lit_amp_det.data.coco import CocoInstances
from lit_amp_det.data.image_folder import ImageFolder
from lit_amp_det.data.image_io import read_rgb_image
from lit_amp_det.errors import ArgumentError

__all__ = ["BadImagesError", "check_folder", "check_splits", "drop_images", "verify_images"]

log = logging.getLogger(__name__)

#: bump when what "verified" means changes, so old caches are ignored
_CACHE_VERSION = 1
_MAX_LISTED = 20
_SPLIT_REMEDY = "Re-extract or replace these files, remove them from the annotation file"
_FOLDER_REMEDY = "Replace these files or move them out of the folder"
#: What ``data.bad_images`` may say: stop with every bad file listed, or leave them out with a warning.
BAD_IMAGE_MODES = ("error", "skip")


class BadImagesError(OSError):
    """Images that cannot be decoded (or whose size is not the annotated one); ``problems`` maps path ->
    reason. ``remedy`` says what to do with the files before the generic ways out (skip them, or skip the
    check).
    """

    def __init__(self, problems: Mapping[str, str], total: int, remedy: str = _SPLIT_REMEDY) -> None:
        self.problems = dict(problems)
        self.total, self.remedy = total, remedy
        listed = [f"  {path}: {reason}" for path, reason in list(self.problems.items())[:_MAX_LISTED]]
        more = (
            [f"  ... and {len(self.problems) - _MAX_LISTED} more"] if len(self.problems) > _MAX_LISTED else []
        )
        super().__init__(
            f"{len(self.problems)} of {total} images cannot be used:\n" + "\n".join(listed + more) + "\n"
            f"{remedy}, or set data.bad_images=skip to leave them out with a warning "
            "(data.verify_images=false skips this check)."
        )

    def __reduce__(self) -> tuple[object, ...]:  # picklable across DDP / multiprocessing with its fields
        return (type(self), (self.problems, self.total, self.remedy))


def _signature(path: str) -> str | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _check_one(path: str, size: tuple[int, int] | None) -> str | None:
    """``None`` if ``path`` decodes (to ``size`` = (width, height) when given), else the reason it does
    not.
    """
    try:
        image = read_rgb_image(path)
    except Exception as err:  # noqa: BLE001 -- decoders raise many types; each becomes a listed reason
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    if size is not None and (image.shape[2], image.shape[1]) != tuple(size):
        return f"is {image.shape[2]}x{image.shape[1]} pixels but the annotations say {size[0]}x{size[1]}"
    return None


def _save_cache(path: Path, files: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "files": files}))
        os.replace(tmp, path)  # atomic: concurrent runs (or DDP ranks) never read half a file
    except OSError as err:  # a read-only cache costs time on the next run, nothing else
        log.warning("could not write the image verification cache %s: %s", path, err)


def verify_images(
    images: Iterable[tuple[str, tuple[int, int] | None]],
    cache_dir: Path | None = None,
    workers: int | None = None,
) -> dict[str, str]:
    """Decodes every ``(path, (width, height) or None)``; returns ``{path: reason}`` for those that fail. With
    ``cache_dir``, files whose path, size and modification time match an earlier successful check are not read
    again, and the successes of this call are added to the cache.
    """
    items = list(dict.fromkeys((str(p), tuple(s) if s is not None else None) for p, s in images))
    if not items:
        return {}
    cache_path, cache = None, {}
    if cache_dir is not None:  # one cache file per set of folders; an unreadable one is an empty one
        folders = sorted({os.path.dirname(os.path.abspath(p)) for p, _ in items})
        digest = hashlib.sha1("\n".join(folders).encode()).hexdigest()[:16]
        cache_path = Path(cache_dir) / "verified_images" / f"{digest}.json"
        with contextlib.suppress(OSError, ValueError):
            payload = json.loads(cache_path.read_text())
            cache = payload.get("files", {}) if payload.get("version") == _CACHE_VERSION else {}
    signatures = {path: _signature(path) for path, _ in items}
    todo = [
        (path, size)
        for path, size in items
        if signatures[path] is None or cache.get(f"{path}|{size}") != signatures[path]
    ]
    problems: dict[str, str] = {}
    if todo:
        workers = workers or min(16, os.cpu_count() or 1)
        log.info(
            "verifying %d images (%d already verified) with %d threads",
            len(todo),
            len(items) - len(todo),
            workers,
        )
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda item: _check_one(*item), todo))
        for (path, size), reason in zip(todo, results):
            if reason is not None:
                problems[path] = reason
            elif signatures[path] is not None:
                cache[f"{path}|{size}"] = signatures[path]
        if cache_path is not None:
            _save_cache(cache_path, cache)
    return problems


def drop_images(dataset: CocoInstances, paths: Iterable[str]) -> int:
    """Removes the items whose file is in ``paths`` from ``dataset``; returns how many were removed."""
    bad = set(paths)
    kept = [rec for rec in dataset._records if str(rec.path) not in bad]
    removed = len(dataset._records) - len(kept)
    if removed:
        dataset._records, dataset.image_ids = kept, [rec.image_id for rec in kept]
    return removed


def _check_mode(mode: str) -> None:
    if mode not in BAD_IMAGE_MODES:
        raise ArgumentError("mode", mode, f"is unknown; choose {' or '.join(BAD_IMAGE_MODES)}")


def check_splits(
    datasets: Mapping[str, CocoInstances],
    mode: Literal["error", "skip"] = "error",
    cache_dir: Path | None = None,
    workers: int | None = None,
) -> None:
    """Verifies every image of ``datasets`` (split name -> dataset) before training or evaluation starts.
    ``mode="error"`` raises one :class:`BadImagesError` listing every bad file of every split; ``"skip"``
    drops them from their splits and logs one warning per split.
    """
    _check_mode(mode)
    # the records are CocoInstances' own index (path and annotated size of every item)
    entries = {
        split: [(str(rec.path), (int(rec.width), int(rec.height))) for rec in dataset._records]
        for split, dataset in datasets.items()
    }
    problems = verify_images(
        [e for split_entries in entries.values() for e in split_entries], cache_dir, workers
    )
    if not problems:
        return
    if mode == "error":
        raise BadImagesError(problems, sum(len(e) for e in entries.values()))
    for split, dataset in datasets.items():
        removed = drop_images(dataset, problems)
        if removed:
            if len(dataset) == 0:
                raise BadImagesError(problems, removed)
            log.warning(
                "data.bad_images=skip: left out %d unreadable image(s) of the %s split: %s",
                removed,
                split,
                ", ".join(sorted(p for p, _ in entries[split] if p in problems)[:_MAX_LISTED]),
            )


def check_folder(
    folder: ImageFolder,
    mode: Literal["error", "skip"] = "error",
    cache_dir: Path | None = None,
    workers: int | None = None,
) -> None:
    """Verifies every picture of a ``predict`` folder (no annotated sizes to compare) before the model runs.
    ``mode="error"`` raises one :class:`BadImagesError` listing every unreadable picture; ``"skip"`` leaves
    them out of ``folder`` (the others keep their ids) with one warning.
    """
    _check_mode(mode)
    total = len(folder)
    problems = verify_images([(str(path), None) for path in folder.files], cache_dir, workers)
    if not problems:
        return
    if mode == "error" or len(problems) == total:
        raise BadImagesError(problems, total, _FOLDER_REMEDY)
    folder.drop(problems)
    log.warning(
        "data.bad_images=skip: left out %d unreadable picture(s) of %s: %s",
        len(problems),
        folder.folder,
        ", ".join(sorted(Path(p).name for p in problems)[:_MAX_LISTED]),
    )
