"""Run folders: created exclusively, recorded in ``run.json``, and found again by ``ckpt_path=last``.

Every command writes into its own new folder (``runs/<command>/<timestamp>``, suffixed ``_1``, ``_2`` ... on a
clash), where rank 0 keeps a small ``run.json``: the command, its state, the process id and host, and the
checkpoint it resumed from. ``ckpt_path=last`` and ``ckpt_path=RUN_DIR`` are resolved from these records, so
that ``fit ckpt_path=last`` only continues the newest unfinished fit made with the same model and data, and
says why not.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_amp_det.app.launch import launch_rank
from lit_amp_det.settings import RENAMED_SETTINGS, model_defaults

__all__ = [
    "RUN_RECORD",
    "RunInfo",
    "ResumeError",
    "config_differences",
    "holds_a_run",
    "is_earlier_attempt",
    "list_runs",
    "read_run",
    "remove_stale_temporaries",
    "resolve_ckpt_path",
    "resume_point",
    "slurm_resume_point",
    "unique_dir",
    "update_run_record",
    "write_run_record",
]

log = logging.getLogger(__name__)

#: The record every run folder gets (rank 0 writes it; atomically replaced on every update).
RUN_RECORD = "run.json"
#: Data-module keys that change how data is loaded, not which data: they may differ between a run and its
#: resume.
_LOADER_KEYS = frozenset(
    {
        "num_workers",
        "pin_memory",
        "persistent_workers",
        "eval_batch_size",
        "cache_dir",
        "predict_split",
        "verify_images",
        "bad_images",
        "verify_workers",
        "verify_cache_dir",
    }
)
#: Model keys that only matter when training starts from scratch (a resume restores every tensor).
_INIT_KEYS = frozenset({"weights"})
#: Optimizer settings that pick its kernels, not its update (with the model's,
#: :func:`_implementation_settings`).
_OPTIMIZER_KERNEL_KEYS = ("fused", "foreach")


class ResumeError(FileNotFoundError):
    """``ckpt_path`` names nothing that can be resumed or scored; the message says why and what to pass
    instead.
    """


# ------------------------------------------------------------------------------------------ run folders
def unique_dir(path: str) -> str:
    """Creates ``path`` -- or ``path_1``, ``path_2``, ... when it exists -- exclusively, and returns it: the
    (cached) ``unique_dir`` resolver of ``hydra.run.dir``. ``mkdir`` fails when another process made the
    folder first, so two runs never share one.
    """
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(10_000):
        candidate = base if attempt == 0 else base.with_name(f"{base.name}_{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return str(candidate)
    raise FileExistsError(f"could not create a new run folder next to {base}: 10000 names taken")


def holds_a_run(path: Path) -> bool:
    """Whether ``path`` already holds the outputs of a run (its record, metrics, config or checkpoints)."""
    path = Path(path)
    markers = (RUN_RECORD, "metrics.json", "config_resolved.yaml", "checkpoints")
    return path.is_dir() and any((path / name).exists() for name in markers)


#: ``run.json`` is padded with spaces (still JSON) to this many bytes, so that an update fits into the blocks
#: it holds.
RESERVED_RECORD_BYTES = 4096


def _write_json(path: Path, record: Mapping[str, Any], reserve: int = 0) -> None:
    """``record`` written beside ``path`` and renamed over it (a kill never leaves half a record), padded to
    ``reserve`` bytes. On a full disk, a text that fits into the existing file is written into it in place
    instead.
    """
    text = (json.dumps(record, indent=2) + "\n").encode()
    text += b" " * max(0, reserve - len(text))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno != errno.ENOSPC or not path.is_file() or path.stat().st_size < len(text):
            raise
        with open(path, "r+b") as file:  # no new block needed: the disk being full does not stop it
            file.write(text)
            file.truncate()


def write_run_record(
    run_dir: Path, command: str, resumed_from: str | None = None, **fields: Any
) -> dict[str, Any]:
    """Writes the ``running`` record of a run that starts now, with any extra ``fields`` (a SLURM job's id and
    restart count); returns it.
    """
    record = {
        "command": command,
        "status": "running",
        "started": time.time(),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "resumed_from": resumed_from,
        **fields,
    }
    _write_json(Path(run_dir) / RUN_RECORD, record, RESERVED_RECORD_BYTES)
    return record


def update_run_record(run_dir: Path, **fields: Any) -> None:
    """Updates fields of ``run.json`` (e.g. ``status="finished"``); a folder without one is left alone."""
    path = Path(run_dir) / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    record.update(fields, ended=time.time())
    _write_json(path, record, RESERVED_RECORD_BYTES)


@dataclass(frozen=True)
class RunInfo:
    """One earlier run folder as ``ckpt_path`` resolution sees it."""

    path: Path
    command: str
    status: str  # running | finished | interrupted | requeued | failed | killed (running, its process gone)
    started: float
    resumed_from: str | None
    slurm_job_id: str | None = None  # the SLURM job it ran in, and that job's restart count then
    slurm_restart_count: int | None = None

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def is_attempt(self, job_id: str, restart_count: int) -> bool:
        """The record of attempt ``restart_count`` of SLURM job ``job_id`` itself."""
        return self.slurm_job_id == job_id and self.slurm_restart_count == restart_count

    def is_earlier_attempt_of(self, job_id: str, restart_count: int) -> bool:
        """An unfinished attempt of SLURM job ``job_id`` with a lower restart count than ``restart_count``."""
        return (
            self.slurm_job_id == job_id
            and self.slurm_restart_count is not None
            and self.slurm_restart_count < restart_count
            and not self.finished
        )


def read_run(path: Path) -> RunInfo | None:
    """The run in folder ``path``; ``None`` when it holds none. A folder without ``run.json`` counts as
    finished when it holds ``metrics.json``, else as killed.
    """
    path = Path(path)
    try:
        record = json.loads((path / RUN_RECORD).read_text())
    except FileNotFoundError:
        if not (path / "config_resolved.yaml").is_file():
            return None
        command = str(OmegaConf.load(path / "config_resolved.yaml").get("command", "fit"))
        status = "finished" if (path / "metrics.json").is_file() else "killed"
        return RunInfo(path, command, status, (path / "config_resolved.yaml").stat().st_mtime, None)
    except (OSError, ValueError):
        return None
    status = str(record.get("status", "running"))
    if (
        status == "running"
        and record.get("host") == socket.gethostname()
        and record.get("pid") != os.getpid()
    ):
        try:
            os.kill(int(record.get("pid", -1)), 0)  # signal 0: only checks that the process exists
        except ProcessLookupError:
            status = "killed"
        except PermissionError:  # it exists, owned by another user
            pass
    restarts = record.get("slurm_restart_count")
    return RunInfo(
        path,
        str(record.get("command")),
        status,
        float(record.get("started", 0.0)),
        record.get("resumed_from"),
        record.get("slurm_job_id"),
        restarts if isinstance(restarts, int) else None,
    )


def list_runs(runs_root: Path, command: str, exclude: Path | None = None) -> list[RunInfo]:
    """Runs of ``command`` under ``runs_root`` (single runs and multirun jobs), newest first."""
    runs_root = Path(runs_root)
    folders = {*runs_root.glob(f"{command}/*"), *runs_root.glob("multirun/*/*")}
    excluded = Path(exclude).resolve() if exclude is not None else None
    runs = [
        info
        for folder in folders
        if folder.is_dir()
        and folder.resolve() != excluded
        and (info := read_run(folder)) is not None
        and info.command == command
    ]
    return sorted(runs, key=lambda info: (info.started, info.path.name), reverse=True)


def resume_point(run_dir: Path, seen: Iterable[Path] = ()) -> Path | None:
    """The checkpoint that continues ``run_dir``: its ``checkpoints/last.ckpt``, or, when it saved none yet,
    the checkpoint it had itself resumed from (a resumed run killed before its first save).
    """
    own = Path(run_dir) / "checkpoints" / "last.ckpt"
    if own.is_file():
        return own
    info = read_run(run_dir)
    if info is None or not info.resumed_from:
        return None
    origin = Path(info.resumed_from)
    if origin.is_file():
        return origin
    if origin.is_dir() and origin not in set(seen):
        return resume_point(origin, [*seen, Path(run_dir)])
    return None


def is_earlier_attempt(folder: Path, job_id: str, restart_count: int) -> bool:
    """Whether ``folder`` holds an unfinished earlier attempt of SLURM job ``job_id`` (a lower restart count):
    the one kind of earlier run whose folder a run may continue in (a requeued sweep job is rerun with its
    folder).
    """
    info = read_run(folder)
    return info is not None and info.is_earlier_attempt_of(job_id, restart_count)


def slurm_resume_point(runs_root: Path, job_id: str, restart_count: int) -> Path | None:
    """The resume point of the newest unfinished fit under ``runs_root`` whose ``run.json`` records SLURM job
    ``job_id`` with a lower restart count; ``None`` on a first attempt, or when the earlier attempts finished
    or saved nothing. The attempt running now never counts, so every rank finds the same file.
    """
    if restart_count <= 0:
        return None
    earlier = (
        info.path
        for info in list_runs(Path(runs_root), "fit")  # each run.json read once
        if info.is_earlier_attempt_of(job_id, restart_count)
    )
    return next((point for path in earlier if (point := resume_point(path)) is not None), None)


# -------------------------------------------------------------------------------------- config matching
def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, Mapping):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}.{key}"))
        return flat
    return {prefix: node}


def _comparable(cfg: Mapping[str, Any], sections: Iterable[str]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section in sections:
        node = cfg.get(section) or {}
        ignored = _LOADER_KEYS if section == "data" else _INIT_KEYS
        flat.update(_flatten({k: v for k, v in node.items() if k not in ignored}, section))
    return flat


def _under_current_names(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run's flattened settings as today's config names them: renamed keys
    (:data:`~lit_amp_det.settings.RENAMED_SETTINGS`) under their new name, and the model's typed keys it did
    not list at the defaults it ran with (:func:`~lit_amp_det.settings.model_defaults`), so that a run saved
    before either change is still the same run.
    """
    current = {RENAMED_SETTINGS.get(key, key): value for key, value in saved.items()}
    if any(key.startswith("model.") for key in current):
        for key, value in model_defaults().items():
            current.setdefault(key, value)
    return current


def _saved_sections(run_dir: Path, sections: Iterable[str]) -> dict[str, Any] | None:
    """``sections`` of the run's saved ``config_resolved.yaml`` as plain containers; None when the file is
    missing.
    """
    saved_file = Path(run_dir) / "config_resolved.yaml"
    if not saved_file.is_file():
        return None
    saved = OmegaConf.to_container(OmegaConf.load(saved_file), resolve=False)
    return {s: saved.get(s) for s in sections if isinstance(saved, Mapping) and saved.get(s) is not None}


def _setting_differences(run_dir: Path, cfg: DictConfig, sections: tuple[str, ...]) -> list[str] | None:
    """``key: earlier -> now`` for every differing setting of ``sections`` (loader settings and
    ``model.weights`` left out); None when the run's saved config is missing.
    """
    if (saved_sections := _saved_sections(run_dir, sections)) is None:
        return None
    saved = _under_current_names(_comparable(saved_sections, sections))
    now = _comparable(
        {s: OmegaConf.to_container(cfg[s], resolve=True) for s in sections if cfg.get(s) is not None},
        sections,
    )
    return [
        f"{key}: {saved.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(saved.keys() | now.keys())
        if saved.get(key) != now.get(key)
    ]


@functools.cache
def _implementation_settings() -> frozenset[str]:
    """Settings that change how a step is computed, not the model, data or recipe: the model's
    :data:`lit_amp_det.checkpoints.IMPLEMENTATION_HPARAMS` and the optimizer's kernel choice. A run may resume
    under other values (on another machine, say); the ones that differ are logged.
    """
    from lit_amp_det.checkpoints import IMPLEMENTATION_HPARAMS  # deferred: imports torch

    return frozenset(
        {f"model.{key}" for key in IMPLEMENTATION_HPARAMS}
        | {f"model.optim.optimizer.{key}" for key in _OPTIMIZER_KERNEL_KEYS}
    )


def _is_implementation(difference: str) -> bool:
    key = difference.split(":", 1)[0]
    return any(key == setting or key.startswith(f"{setting}.") for setting in _implementation_settings())


def config_differences(
    run_dir: Path, cfg: DictConfig, sections: Iterable[str] = ("model", "data")
) -> list[str]:
    """``key: earlier -> now`` for every setting of ``sections`` in which ``cfg`` differs from the run's saved
    ``config_resolved.yaml`` (loader and :func:`_implementation_settings` left out): what makes it another
    run.
    """
    if (differences := _setting_differences(run_dir, cfg, tuple(sections))) is None:
        return [f"{Path(run_dir) / 'config_resolved.yaml'} is missing"]
    return [d for d in differences if not _is_implementation(d)]


def _architecture_differences(run_dir: Path, cfg: DictConfig) -> list[str]:
    """``key: earlier -> now`` for every model setting that changes the weights' names or shapes
    (:func:`lit_amp_det.checkpoints.architecture_differences`): what stops the run's weights loading into
    ``cfg``'s.
    """
    from lit_amp_det.checkpoints import architecture_differences as differing  # deferred: imports torch

    if (saved := _saved_sections(run_dir, ("model",))) is None:
        return [f"{Path(run_dir) / 'config_resolved.yaml'} is missing"]
    now = OmegaConf.to_container(cfg.model, resolve=True) if cfg.get("model") is not None else {}
    return [f"{key}: {old!r} -> {new!r}" for key, old, new in differing(saved.get("model") or {}, now)]


# ----------------------------------------------------------------------------------- ckpt_path resolution
def _describe(checkpoint: Path) -> str:
    """``step N, epoch E`` of a checkpoint (read without the tensors where possible)."""
    import torch  # deferred: resolving runs happens before anything heavy is imported

    try:
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 -- any unreadable file is reported, not fatal here
        return f"unreadable: {err}"
    return f"step {payload.get('global_step', '?')}, epoch {payload.get('epoch', '?')}"


def _continued(runs: list[RunInfo]) -> set[Path]:
    """Folders of runs whose resume point a later run already resumed from: that later run carries on their
    work.
    """
    resumed_at: dict[Path, float] = {}
    for info in runs:
        if info.resumed_from:
            key = Path(info.resumed_from).resolve()
            resumed_at[key] = max(resumed_at.get(key, 0.0), info.started)
    return {
        info.path.resolve()
        for info in runs
        if (point := resume_point(info.path)) is not None
        and resumed_at.get(point.resolve(), -1.0) > info.started
    }


def _resume_last(cfg: DictConfig, run_dir: Path, runs_root: Path) -> Path:
    """``fit ckpt_path=last``: the newest unfinished fit that saved a checkpoint and was made with this model
    and data (fits that saved none are skipped, and named in a log line); when none fits, an error about the
    newest fit.
    """
    runs = list_runs(runs_root, "fit", exclude=run_dir)
    continued = _continued(runs)
    runs = [
        info for info in runs if info.path.resolve() not in continued
    ]  # resumed already: its successor counts
    if not runs:
        raise ResumeError(
            f"ckpt_path=last: no earlier fit under {runs_root} to resume; start a new run "
            "(leave ckpt_path out) or pass ckpt_path=/path/to/run_dir or /path/to/file.ckpt"
        )
    stopped = [r for r in runs if r.status not in ("finished", "running")]
    if unsaved := [r for r in stopped if resume_point(r.path) is None]:
        log.info(
            "ckpt_path=last: skipping %d fit(s) that saved no checkpoint: %s",
            len(unsaved),
            ", ".join(str(r.path) for r in unsaved[:5]),
        )
    saved = [r for r in stopped if r not in unsaved]
    if (matching := next((r for r in saved if not config_differences(r.path, cfg)), None)) is not None:
        if changed := [
            d for d in _setting_differences(matching.path, cfg, ("model",)) or [] if _is_implementation(d)
        ]:
            log.info(
                "ckpt_path=last: resuming %s with other implementation settings than it had: %s",
                matching.path,
                "; ".join(changed),
            )
        return resume_point(matching.path)  # type: ignore[return-value]  # saved: it has one
    newest = runs[0]
    if saved:
        other = saved[0]
        differences = "; ".join(config_differences(other.path, cfg)[:8])
        raise ResumeError(
            f"ckpt_path=last: no unfinished fit was made with this model and data; the newest, "
            f"{other.path} ({other.status}), differs: {differences}. Run with its settings to resume it, "
            f"or pass ckpt_path={other.path}"
        )
    if newest.status == "running":
        raise ResumeError(
            f"ckpt_path=last: the newest fit, {newest.path}, is still running and no other unfinished "
            "fit saved a checkpoint; stop it first"
        )
    if newest.finished:
        raise ResumeError(
            f"ckpt_path=last: the newest fit, {newest.path}, finished: there is nothing to resume. Start "
            f"a new run (leave ckpt_path out); train it further with its optimizer and schedule by "
            f"ckpt_path={newest.path} and a larger trainer.max_epochs or trainer.max_steps; or fine-tune "
            f"from its weights with model.weights={newest.path / 'checkpoints' / 'last.ckpt'}"
        )
    raise ResumeError(
        f"ckpt_path=last: the newest fit, {newest.path}, stopped ({newest.status}) before it saved a "
        "checkpoint, as did every unfinished fit: there is nothing to resume. Start a new run, or lower "
        "callbacks.last_checkpoint.every_n_train_steps / every_n_minutes"
    )


def _newest_weights(cfg: DictConfig, run_dir: Path, runs_root: Path) -> Path:
    """``validate|test|predict ckpt_path=last``: the final weights of the newest fit whose model matches."""
    saved = [
        (info, point)
        for info in list_runs(runs_root, "fit", exclude=run_dir)
        if (point := resume_point(info.path)) is not None
    ]
    if not saved:
        raise ResumeError(
            f"ckpt_path=last: no fit under {runs_root} has saved a checkpoint; train first, or pass "
            "ckpt_path=/path/to/file.ckpt"
        )
    matching = next(
        ((info, point) for info, point in saved if not _architecture_differences(info.path, cfg)), None
    )
    if matching is None:
        newest = saved[0][0]
        raise ResumeError(
            f"ckpt_path=last: no fit with a checkpoint has this model; the newest, {newest.path}, "
            f"differs: {'; '.join(_architecture_differences(newest.path, cfg)[:8])}; pass its model "
            "settings or ckpt_path=/path/to/file.ckpt"
        )
    info, checkpoint = matching
    if info is not saved[0][0]:
        log.info(
            "ckpt_path=last: the newest fit with this model is %s (newer fits have another model)", info.path
        )
    if others := _setting_differences(info.path, cfg, ("model",)):
        log.info(
            "ckpt_path=last: the weights of %s, under settings other than its own that leave them usable: %s",
            info.path,
            "; ".join(others[:8]),
        )
    return checkpoint


def remove_stale_temporaries(runs_root: Path) -> None:
    """Deletes the partial checkpoints (``checkpoints/.*.tmp``) that fits killed during a save left: their
    process is gone (``killed``: its pid no longer exists on this host), so nothing will finish or rename
    them.
    """
    for info in list_runs(Path(runs_root), "fit"):
        if info.status == "killed":
            for stale in (info.path / "checkpoints").glob(".*.tmp"):
                stale.unlink(missing_ok=True)


_CLAIMS: dict[Path, int] = {}  # checkpoint folders this process resumes from: their locked file descriptors


def _claim(folder: Path) -> None:
    """Locks ``folder`` (a checkpoints folder being resumed from) for this process's lifetime, so that a
    second fit resuming it stops with the first one's pid; removes the temporary files its killed run left
    there.
    """
    folder = folder.resolve()
    if folder in _CLAIMS or not os.access(folder, os.W_OK):
        return
    fd = os.open(folder / ".resume.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ResumeError(f"{folder} is being resumed by {holder}; wait for it to end or stop it") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
    _CLAIMS[folder] = fd  # released when this process ends, however it ends
    for stale in folder.glob(".*.tmp"):  # a killed save's partial file: no process writes it any more
        stale.unlink(missing_ok=True)


def resolve_ckpt_path(cfg: DictConfig, run_dir: Path, runs_root: Path) -> str | None:
    """Turns ``cfg.ckpt_path`` into a checkpoint file (or Lightning's ``best``/``None``) and says what it
    picked.

    * ``last``: for ``fit``, the newest unfinished fit under ``runs_root`` whose saved config has the same
      model and data; a :class:`ResumeError` with the reason and the folder when the newest fit finished, is
      still running, used other settings or saved nothing. For the other commands, the newest fit's last
      weights.
    * a run folder: that run's ``checkpoints/last.ckpt`` (or the checkpoint it had resumed from).
    * a file: itself, once checked that it exists.
    """
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None or ckpt_path == "best":
        return ckpt_path
    runs_root = Path(runs_root).expanduser().resolve()
    command = str(cfg.get("command", "fit"))
    if ckpt_path == "last":
        checkpoint = (_resume_last if command == "fit" else _newest_weights)(cfg, run_dir, runs_root)
    else:
        path = Path(str(ckpt_path)).expanduser()
        if path.is_dir():
            checkpoint = resume_point(path)
            if checkpoint is None:
                raise ResumeError(
                    f"ckpt_path={str(path)!r} is a folder without checkpoints/last.ckpt; pass a run "
                    "folder that saved a checkpoint, or a .ckpt file"
                )
            sections = ("model", "data") if command == "fit" else ("model",)
            differences = config_differences(checkpoint.parent.parent, cfg, sections)
            if differences and (checkpoint.parent.parent / "config_resolved.yaml").is_file():
                log.warning(
                    "ckpt_path=%s: settings differ from that run's: %s", path, "; ".join(differences[:8])
                )
        elif path.is_file():
            checkpoint = path
        else:
            raise ResumeError(
                f"ckpt_path={str(ckpt_path)!r} does not exist; pass a .ckpt file, a run folder or 'last'"
            )
    if command == "fit" and launch_rank() == 0:
        _claim(checkpoint.parent)
    verb = "resuming" if command == "fit" else "loading"
    log.info("ckpt_path=%s: %s %s (%s)", ckpt_path, verb, checkpoint, _describe(checkpoint))
    return str(checkpoint.resolve())
