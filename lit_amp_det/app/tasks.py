"""The four jobs behind the CLI -- ``train``, ``validate``, ``test``, ``predict`` -- as importable functions.

Each builds data module, model, callbacks, loggers and trainer from a composed Hydra config's ``_target_``
nodes, runs, and writes ``metrics.json``, ``config_resolved.yaml`` and ``run.json`` into the run directory.
They are separate from the Hydra entry point so notebooks, tests and sweepers can call them.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from lit_amp_det.app.config import check_command, check_config
from lit_amp_det.app.console import quiet_console, report_user_error
from lit_amp_det.app.launch import adopt_launch_rank, ddp_child_command
from lit_amp_det.app.model_classes import folder_prediction_classes, reads_no_split
from lit_amp_det.app.runs import (
    _write_json,
    holds_a_run,
    is_earlier_attempt,
    read_run,
    remove_stale_temporaries,
    resolve_ckpt_path,
    resume_point,
    slurm_resume_point,
    update_run_record,
    write_run_record,
)
from lit_amp_det.callbacks.console_log import ConsoleLog, ReadableProgressBar, emit, stdout_is_terminal
from lit_amp_det.callbacks.last_checkpoint import RunInterrupted
from lit_amp_det.callbacks.run_stats import RunStats
from lit_amp_det.checkpoint_io import DurableCheckpointIO
from lit_amp_det.checkpoints import CLASS_HPARAMS, check_checkpoint, names_a_checkpoint_file, read_checkpoint
from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.weights import NO_WEIGHTS
from lit_amp_det.precision import build_precision_plugin, warn_if_precision_changes
from lit_amp_det.slurm import SlurmJob, cluster_plugins, current_job

__all__ = [
    "train",
    "validate",
    "test",
    "predict",
    "run",
    "instantiate_all",
    "config_node",
    "resume_command",
    "summary_line",
]

log = logging.getLogger(__name__)


def _output_dir(cfg: DictConfig) -> Path:
    path = Path(cfg.paths.output_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def config_node(path: str) -> Iterator[None]:
    """A library :class:`ArgumentError` raised inside the block comes out naming its config path
    (``path.argument``), unwrapped from Hydra's ``InstantiationException`` so the user reads the one line
    naming the key to change.
    """
    try:
        yield
    except InstantiationException as err:
        if isinstance(err.__cause__, ArgumentError):
            raise err.__cause__.at(path) from None
        raise
    except ArgumentError as err:
        raise err.at(path) from None


def build_datamodule(cfg: DictConfig) -> pl.LightningDataModule:
    """Instantiates ``cfg.data`` and prepares it, except for a command that reads no split
    (:func:`reads_no_split`).
    """
    with config_node("data"):
        datamodule = instantiate(cfg.data)
    if not reads_no_split(cfg):
        datamodule.prepare_data()
    return datamodule


def build_model(
    cfg: DictConfig,
    datamodule: pl.LightningDataModule,
    *,
    weights_from_checkpoint: bool = False,
    classes: dict[str, Any] | None = None,
) -> pl.LightningModule:
    """Instantiates ``cfg.model``; class count, names and category ids come from ``classes`` if given, else
    from the data unless set. ``weights_from_checkpoint``: a ``ckpt_path`` will replace every tensor, so named
    pretrained weights are not read (nor downloaded).
    """
    from_data: dict[str, Any] = dict(classes) if classes is not None else {}
    with config_node("data"):  # the data module reads its annotations here; its errors name data.<argument>
        for key in CLASS_HPARAMS if classes is None else ():
            if cfg.model.get(key) is None and hasattr(datamodule, key):
                value = getattr(datamodule, key)
                from_data[key] = list(value) if isinstance(value, (list, tuple)) else value
    model_cfg = cfg.model
    if weights_from_checkpoint and _named_weights(cfg):
        log.info("ckpt_path replaces every tensor: %s not read", ", ".join(_named_weights(cfg)))
        model_cfg = cfg.model.copy()
        with open_dict(model_cfg):
            model_cfg.weights = None
            if model_cfg.get("backbone") is not None:
                model_cfg.backbone.weights = None
    try:
        with config_node("model"):
            return instantiate(
                model_cfg, _convert_="all", **from_data
            )  # plain dicts: weights_only-safe checkpoints
    except ArgumentError as err:
        raise _named_by_group(err, model_cfg) from None


#: Model arguments the root config fills from a top-level group of the same name (``model.optim: ${optim}``).
_GROUP_ARGUMENTS = ("optim", "speedups")


def _named_by_group(err: ArgumentError, model_cfg: DictConfig) -> ArgumentError:
    """``err`` naming ``optim.*`` / ``speedups.*`` instead of ``model.optim.*`` / ``model.speedups.*`` where
    the model node reads that group (Hydra refuses overrides below an interpolation).
    """
    argument = err.argument.removeprefix("model.")
    group = argument.split(".", 1)[0]
    if (
        group not in _GROUP_ARGUMENTS
        or argument == err.argument
        or OmegaConf.to_container(model_cfg, resolve=False).get(group) != f"${{{group}}}"
    ):
        return err
    return type(err)(argument, err.value, err.problem)


def _named_weights(cfg: DictConfig) -> list[str]:
    """The pretrained weights the model config asks for, as ``key=value`` strings."""
    named = {
        "model.weights": cfg.model.get("weights"),
        "model.backbone.weights": (cfg.model.get("backbone") or {}).get("weights"),
    }
    return [f"{key}={value}" for key, value in named.items() if value not in NO_WEIGHTS]


def instantiate_all(nodes: DictConfig | None, group: str = "") -> list[Any]:
    """Instantiates every ``_target_`` node of a group such as ``callbacks``; ``null`` entries are skipped.
    ``group`` (the group's config path) prefixes the argument named by a library :class:`ArgumentError`.
    """
    built = []
    for name, node in (nodes or {}).items():
        if node is not None and "_target_" in node:
            with config_node(f"{group}.{name}" if group else str(name)):
                built.append(instantiate(node))
    return built


def build_trainer(cfg: DictConfig) -> pl.Trainer:
    """The Lightning ``Trainer`` of ``cfg.trainer`` with the configured callbacks, loggers and precision
    plugin. ``trainer.precision`` becomes a plugin configured by the ``precision`` node (Lightning refuses a
    precision string and a plugin together). :class:`RunStats` is always added, so ``metrics.json`` records
    speed and peak memory; commands other than ``fit`` get no checkpoint callbacks.
    """
    loggers = instantiate_all(cfg.get("logger"), "logger")
    precision_options = OmegaConf.to_container(cfg.get("precision") or {}, resolve=True)
    plugin = build_precision_plugin(
        str(cfg.trainer.get("precision", "32-true")),
        str(cfg.trainer.get("accelerator", "auto")),
        **precision_options,
    )
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_cfg.pop("precision", None)
    callbacks = [*instantiate_all(cfg.get("callbacks"), "callbacks"), RunStats()]
    if (
        str(cfg.get("command", "fit")) != "fit"
    ):  # nothing to save; restoring a fit's checkpoint callbacks would
        # only warn that their folder is not this run's (Lightning restores callback states for every stage)
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.Checkpoint)]
        trainer_cfg["enable_checkpointing"] = False
    if trainer_cfg.get("enable_progress_bar", True):
        if not stdout_is_terminal() and any(isinstance(c, ConsoleLog) for c in callbacks):
            trainer_cfg["enable_progress_bar"] = (
                False  # a bar in a file keeps only its last state: lines instead
            )
        elif not any(isinstance(c, pl.callbacks.ProgressBar) for c in callbacks):
            callbacks.append(ReadableProgressBar())
    return instantiate(
        trainer_cfg,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[plugin, DurableCheckpointIO(), *cluster_plugins()],
    )


def _scalar_metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in sorted(trainer.callback_metrics.items())
        if isinstance(value, torch.Tensor) and value.numel() == 1
    }


@rank_zero_only
def _write_outputs(cfg: DictConfig, trainer: pl.Trainer, record: dict[str, Any]) -> None:
    out = _output_dir(cfg)
    record = {
        **record,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "precision": getattr(trainer.precision_plugin, "precision", None),
    }  # what ran (auto resolved)
    checkpoints = trainer.checkpoint_callbacks
    record["best_model_path"] = next((c.best_model_path for c in checkpoints if c.best_model_path), None)
    record["last_model_path"] = next((c.last_model_path for c in checkpoints if c.last_model_path), None)
    record.setdefault("status", "finished")
    _write_json(out / "metrics.json", record)
    update_run_record(out, status=record["status"], global_step=trainer.global_step)
    if record["command"] == "predict":
        emit(f"predictions: {out / 'predictions.json'}")
    elif record["command"] == "export":
        emit(f"exported: {record['exported']} (described in model.json)")
    elif record["status"] != "interrupted" or any("mAP" in key for key in record["metrics"]):
        emit(summary_line(record["metrics"]))
    emit(f"run directory: {out}")


def summary_line(metrics: dict[str, float]) -> str:
    """One line with the headline COCO numbers of whichever stage ran last."""
    for stage in ("test", "val"):
        parts = [
            f"{stage} {kind} mAP {metrics[key]:.3f} (mAP@0.5 {metrics.get(key + '_50', float('nan')):.3f})"
            for kind in ("bbox", "segm")
            if (key := f"{stage}/{kind}_mAP") in metrics
        ]
        if parts:
            return " | ".join(parts)
    return "no mAP computed (no validation ran)"


def _start(
    cfg: DictConfig, load_weights: bool = False
) -> tuple[pl.LightningDataModule, pl.LightningModule, pl.Trainer, str | None]:
    """Checks the config, records the run, builds data, model and trainer and checks ``ckpt_path`` against the
    model. ``load_weights``: the checkpoint's weights go into the model here (a command no Trainer restores),
    from the one read of the file.
    """
    check_config(cfg)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    out = _output_dir(cfg)
    job = current_job()
    if rank_zero_only.rank == 0 and holds_a_run(out) and not _earlier_attempt_of(job, out):
        raise FileExistsError(
            f"{out} already holds a run (run.json, metrics.json or checkpoints); runs never "
            f"write into an earlier run's folder: choose another hydra.run.dir, or resume it "
            f"into a new folder with ckpt_path={out}"
        )
    ckpt_path = start_checkpoint(cfg, out, job)
    if rank_zero_only.rank == 0:
        if str(cfg.command) == "fit":
            remove_stale_temporaries(Path(cfg.paths.runs_root))
        write_run_record(
            out,
            str(cfg.command),
            resumed_from=ckpt_path if names_a_checkpoint_file(ckpt_path) else None,
            **(job.record() if job is not None else {}),
        )
        OmegaConf.save(cfg, out / "config_resolved.yaml", resolve=True)
        if (
            ckpt_path is not None
        ):  # DDP's other ranks re-run this command line: give them this file, not `last` again
            sys.argv = [f"ckpt_path={ckpt_path}" if arg.startswith("ckpt_path=") else arg for arg in sys.argv]
    datamodule = build_datamodule(cfg)
    checkpoint, classes = None, None
    if reads_no_split(cfg):  # no annotations to name the classes: the weights do
        if names_a_checkpoint_file(ckpt_path):
            checkpoint = read_checkpoint(ckpt_path, "ckpt_path")
        classes = folder_prediction_classes(cfg, ckpt_path, checkpoint)
    model = build_model(cfg, datamodule, weights_from_checkpoint=ckpt_path is not None, classes=classes)
    trainer = build_trainer(cfg)
    checkpoint = check_checkpoint(
        ckpt_path, model, checkpoint
    )  # a bad or mismatched file fails here, with the fix
    if checkpoint is not None and str(cfg.command) == "fit":
        warn_if_precision_changes(
            checkpoint, f"ckpt_path={ckpt_path}", str(trainer.precision_plugin.precision)
        )
    if load_weights and checkpoint is not None:
        model.load_state_dict(checkpoint["state_dict"])
    del checkpoint  # otherwise Lightning reads the file again itself
    return datamodule, model, trainer, ckpt_path


def start_checkpoint(cfg: DictConfig, out: Path, job: SlurmJob | None) -> str | None:
    """The checkpoint this process starts from, resolved on every rank: the ranks Lightning starts get rank
    0's file pinned on their command line, the tasks ``srun`` starts (each its own command) resolve ``last``,
    a run folder or a requeued job's attempt as rank 0 does.
    """
    return resolve_ckpt_path(cfg, out, Path(cfg.paths.runs_root)) or _requeued_job_checkpoint(cfg, out, job)


def _earlier_attempt_of(job: SlurmJob | None, folder: Path) -> bool:
    return job is not None and is_earlier_attempt(folder, job.job_id, job.restart_count)


def _requeued_job_checkpoint(cfg: DictConfig, out: Path, job: SlurmJob | None) -> str | None:
    """A requeued SLURM job's ``fit`` without ``ckpt_path``: the checkpoint of its preempted attempt, found in
    its own folder (a sweep job's) or among the runs under ``paths.runs_root``; ``None`` on a first attempt.
    """
    if job is None or str(cfg.command) != "fit" or cfg.get("ckpt_path") is not None:
        return None
    record = read_run(out)
    if rank_zero_only.rank != 0 and record is not None and record.is_attempt(job.job_id, job.restart_count):
        # rank 0 of this attempt recorded its choice over the earlier attempt's run.json first: follow it, or
        # this task would start from step 0 beside a rank 0 that resumed (and the two would wait on each other
        # forever)
        checkpoint = Path(record.resumed_from) if record.resumed_from else None
    else:
        checkpoint = (
            resume_point(out)
            if record is not None and record.is_earlier_attempt_of(job.job_id, job.restart_count)
            else None
        )
    if checkpoint is None:
        checkpoint = slurm_resume_point(
            Path(cfg.paths.runs_root).expanduser().resolve(), job.job_id, job.restart_count
        )
    if checkpoint is None:
        if job.restart_count:
            log.warning(
                "SLURM job %s, restart %d: no earlier attempt of this job saved a checkpoint under %s; "
                "training starts from step 0",
                job.job_id,
                job.restart_count,
                cfg.paths.runs_root,
            )
        return None
    log.info(
        "SLURM job %s, restart %d: resuming its preempted attempt from %s",
        job.job_id,
        job.restart_count,
        checkpoint,
    )
    return str(checkpoint)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fits the model, resuming from ``cfg.ckpt_path`` if set.

    Args:
        cfg: the composed config (:func:`lit_amp_det.app.config.compose`, or the one ``@hydra.main`` gives).

    Returns:
        The final metrics (``metrics.json``'s), by name.

    Raises:
        ValueError: a setting with a bad value or an old name, before anything is built (its message names
            the setting).
    """
    started = time.perf_counter()
    datamodule, model, trainer, ckpt_path = _start(cfg)
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except RunInterrupted as stop:  # Ctrl-C / SIGTERM: the checkpoint is saved; keep the metrics so far too
        perf = next((c.summary() for c in trainer.callbacks if isinstance(c, RunStats)), None)
        command = resume_command(cfg)
        record = {
            "command": "fit",
            "status": "requeued" if stop.requeued_job else "interrupted",
            "interrupted_by": stop.signal_name,
            "metrics": _scalar_metrics(trainer),
            "time_s": time.perf_counter() - started,
            "perf": perf,
            "resume_command": command,
        }
        _write_outputs(cfg, trainer, record)
        _announce_interrupt(stop, command)
        raise
    metrics = _scalar_metrics(trainer)
    perf = next((c.summary() for c in trainer.callbacks if isinstance(c, RunStats)), None)
    if getattr(model, "last_validated_step", None) != trainer.global_step and trainer.limit_val_batches:
        # the last epoch did not validate (check_val_every_n_epoch): score the final weights
        trainer.validate(model, datamodule=datamodule, verbose=False)
        metrics.update(_scalar_metrics(trainer))
    record = {"command": "fit", "metrics": metrics, "time_s": time.perf_counter() - started, "perf": perf}
    _write_outputs(cfg, trainer, record)
    return metrics


def resume_command(cfg: DictConfig) -> str:
    """The command line that continues this fit: its overrides, with ``ckpt_path`` set to its run folder."""
    overrides: list[str] = []
    try:
        if HydraConfig.initialized():
            overrides = [
                o
                for o in HydraConfig.get().overrides.task
                if not o.startswith(("ckpt_path=", "command=", "hydra.", "~hydra.", "+hydra."))
            ]
    except ValueError:
        overrides = []
    args = [*overrides, f"ckpt_path={Path(cfg.paths.output_dir).resolve()}"]
    return "python -m lit_amp_det fit " + " ".join(shlex.quote(a) for a in args)


@rank_zero_only
def _announce_interrupt(stop: RunInterrupted, command: str) -> None:
    where = (
        f"checkpoint saved at step {stop.global_step}: {stop.checkpoint}"
        if stop.checkpoint
        else "no checkpoint"
    )
    emit(f"stopped by {stop.signal_name}; {where}")
    if stop.requeued_job:
        emit(
            f"SLURM job {stop.requeued_job} requeued: its next attempt resumes from this checkpoint by itself"
        )
    emit(f"resume with: {command}")


def _evaluate(cfg: DictConfig, stage: str) -> dict[str, float]:
    started = time.perf_counter()
    datamodule, model, trainer, ckpt_path = _start(cfg)
    if ckpt_path is None and not _named_weights(cfg):
        log.warning("%s without ckpt_path or model.weights scores a randomly initialised model", stage)
    getattr(trainer, stage)(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    metrics = _scalar_metrics(trainer)
    _write_outputs(
        cfg, trainer, {"command": stage, "metrics": metrics, "time_s": time.perf_counter() - started}
    )
    return metrics


def validate(cfg: DictConfig) -> dict[str, float]:
    """Scores the model on the validation split.

    Args:
        cfg: the composed config (:func:`lit_amp_det.app.config.compose`, or the one ``@hydra.main`` gives).

    Returns:
        The metrics, by name.

    Raises:
        ValueError: a setting with a bad value or an old name, before anything is built (its message names
            the setting).
    """
    return _evaluate(cfg, "validate")


def test(cfg: DictConfig) -> dict[str, float]:
    """Scores the model on the test split.

    Args:
        cfg: the composed config (:func:`lit_amp_det.app.config.compose`, or the one ``@hydra.main`` gives).

    Returns:
        The metrics, by name.

    Raises:
        ValueError: a setting with a bad value or an old name, before anything is built (its message names
            the setting).
    """
    return _evaluate(cfg, "test")


def predict(cfg: DictConfig) -> Path:
    """Writes COCO-format detections of ``data.predict_split`` (or of the pictures in ``data.predict_images``)
    to ``predictions.json``.

    Args:
        cfg: the composed config (:func:`lit_amp_det.app.config.compose`, or the one ``@hydra.main`` gives).

    Returns:
        The path of ``predictions.json``.

    Raises:
        ValueError: a setting with a bad value or an old name, before anything is built (its message names
            the setting).
    """
    started = time.perf_counter()
    datamodule, model, trainer, ckpt_path = _start(cfg)
    if ckpt_path is None and not _named_weights(cfg):
        log.warning("predict without ckpt_path or model.weights uses a randomly initialised model")
    trainer.predict(
        model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=False, weights_only=True
    )
    _write_outputs(
        cfg, trainer, {"command": "predict", "metrics": {}, "time_s": time.perf_counter() - started}
    )
    return _output_dir(cfg) / "predictions.json"


def export(cfg: DictConfig) -> Path:
    """Writes the model (``ckpt_path`` or ``model.weights``) as ``format`` (onnx | pt2) into the run folder,
    with a JSON description beside it (:func:`lit_amp_det.deploy.export_detector`); returns the file's path.
    """
    from lit_amp_det.deploy import export_detector, supported_format

    started = time.perf_counter()
    fmt = supported_format(str(cfg.get("format")))  # before the model is built
    datamodule, model, trainer, ckpt_path = _start(cfg, load_weights=True)
    if ckpt_path is None and not _named_weights(cfg):
        log.warning("export without ckpt_path or model.weights writes a randomly initialised model")
    settings = cfg.get("export") or {}
    path = _output_dir(cfg) / f"model.{fmt}"
    export_detector(model, path, fmt, settings.get("image_size"), settings.get("batch_size", 1))
    _write_outputs(
        cfg,
        trainer,
        {"command": "export", "metrics": {}, "exported": str(path), "time_s": time.perf_counter() - started},
    )
    return path


_TASKS = {"fit": train, "validate": validate, "test": test, "predict": predict, "export": export}


def _route_lightning_logs() -> None:
    """Lets Lightning's messages reach the run's log file: under Hydra's logging, Lightning's own console
    handler is dropped and its records propagate.
    """
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


def run(cfg: DictConfig) -> Any:
    """Dispatches on ``cfg.command``; the return value is what a Hydra sweeper optimises. A fit stopped by
    SIGINT/SIGTERM exits with 128 + the signal's number (130 for Ctrl-C) once its checkpoint and metrics are
    written; a run that raised is marked ``failed`` in its ``run.json``.
    """
    check_command(cfg.get("command"))  # the rest of the config is checked once, when the job starts
    devices = cfg.get("trainer", {}).get("devices")
    adopt_launch_rank(devices if isinstance(devices, int) else 1)  # node k > 0 must not claim the run folder
    _route_lightning_logs()
    quiet_console(bool(cfg.get("verbose", False)))
    with ddp_child_command(cfg):  # so that DDP's other ranks start as this job (also inside a sweep)
        try:
            result = _TASKS[cfg.command](cfg)
        except RunInterrupted as stop:
            sys.exit(stop.exit_code)
        except BaseException as err:
            out = Path(cfg.paths.output_dir)
            if rank_zero_only.rank == 0 and not isinstance(err, FileExistsError):
                status = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "failed"
                fields = {"status": status, "error": f"{type(err).__name__}: {err}"}
                if (out / "run.json").is_file():
                    update_run_record(out, **fields)
                else:  # stopped before the run was recorded (start-up)
                    write_run_record(out, str(cfg.command), **fields)
            if isinstance(err, KeyboardInterrupt):  # before LastCheckpoint took over the signal: start-up
                print(
                    f"lit_amp_det: interrupted (Ctrl-C) while starting; {out} is marked interrupted",
                    file=sys.stderr,
                )
                sys.exit(130)
            if report_user_error(err, bool(cfg.get("verbose", False))):
                sys.exit(1)  # the message is printed; the traceback is in the log file
            raise
    return (
        result.get(cfg.optimized_metric) if isinstance(result, dict) and cfg.get("optimized_metric") else None
    )
