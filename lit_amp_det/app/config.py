"""Where the Hydra configuration lives, and the checks that run before anything is built.

The YAML tree sits in the repository's ``conf/`` folder and is installed as the package
``lit_amp_det.conf``, so ``python -m lit_amp_det`` finds it from a source checkout and from a wheel alike.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_amp_det.app.launch import rank_suffix
from lit_amp_det.app.runs import unique_dir
from lit_amp_det.errors import ArgumentError
from lit_amp_det.settings import RENAMED_SETTINGS, register_schemas

__all__ = [
    "COMMANDS",
    "RENAMED_SETTINGS",
    "check_command",
    "check_config",
    "compose",
    "config_dir",
    "config_groups",
    "renamed_setting",
]

#: Subcommands of ``python -m lit_amp_det``.
COMMANDS = ("fit", "validate", "test", "predict", "export")


def _pin_memory(accelerator: str) -> bool:
    """``data.pin_memory``: only when batches go to a GPU (on a CPU pinning is wasted and Lightning warns)."""
    if str(accelerator) != "auto":
        return str(accelerator) in ("gpu", "cuda")
    import torch  # deferred: only when a config asks

    return torch.cuda.is_available()


# the metric checkpoints monitor: ``segm`` when the model predicts masks, else ``bbox``
OmegaConf.register_new_resolver("headline_kind", lambda mask: "segm" if mask else "bbox", replace=True)
OmegaConf.register_new_resolver("rank_suffix", rank_suffix, replace=True)  # per-rank log files under DDP
# run folders created exclusively, once per run (cached: Hydra copies the cache into each sweep job's config)
OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True, replace=True)
# hydra.launcher.cpus_per_task under SLURM: a rank's loader workers plus the rank itself
OmegaConf.register_new_resolver("cpus_per_rank", lambda loader_workers: int(loader_workers) + 1, replace=True)
OmegaConf.register_new_resolver("pin_memory", _pin_memory, replace=True)
register_schemas()  # the typed schemas the YAML defaults lists start from (lit_amp_det.settings)


def config_dir() -> Path:
    """Absolute path of the config tree (``conf/`` in a checkout, ``lit_amp_det/conf`` when installed)."""
    checkout = Path(__file__).resolve().parents[2] / "conf"
    if (checkout / "config.yaml").is_file():
        return checkout
    return Path(str(resources.files("lit_amp_det.conf")))


def config_groups() -> dict[str, list[str]]:
    """Config groups and their options, e.g. ``{"data": ["coco", "shapes"], ...}``."""
    root = config_dir()
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(root.iterdir())
        if group.is_dir() and not group.name.startswith(("_", "."))
    }


def check_command(command: object) -> None:
    """``command`` is one of :data:`COMMANDS`."""
    if command not in COMMANDS:
        raise ValueError(f"command={command!r}; choose one of {', '.join(COMMANDS)}")


def compose(overrides: Sequence[str]) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides``, as the CLI composes it (no Hydra run)."""
    from hydra import compose as hydra_compose  # deferred: checks run before anything heavy is imported
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def renamed_setting(key: str) -> str | None:
    """The message refusing ``key`` when it is the old name of a setting (``None`` when it is not).

    Args:
        key: a dotted setting, as a command line or a config file names it (``data.seed``).

    Returns:
        ``data.seed was renamed data.sampler_seed: ...``, or ``None``.
    """
    new = RENAMED_SETTINGS.get(key)
    if new is None:
        return None
    return f"{key} was renamed {new}: set {new} instead (same meaning)"


def _check_renamed(cfg: DictConfig) -> None:
    """A composed config that still sets an old name (in an experiment file of the user's) stops here."""
    for old in RENAMED_SETTINGS:
        if OmegaConf.select(cfg, old, default=None, throw_on_resolution_failure=False) is not None:
            raise ValueError(f"{renamed_setting(old)}; the config sets {old}")


def check_config(cfg: DictConfig) -> None:
    """Rejects values that would otherwise fail deep inside Lightning with a less helpful message.

    Args:
        cfg: the composed config of a command.

    Raises:
        ValueError: a setting with a bad value or an old name; the message names the setting and the fix.
    """
    from lit_amp_det.precision.build import check_precision  # deferred: torch, only once a command runs

    check_command(cfg.get("command"))
    _check_renamed(cfg)
    check_precision(str(cfg.trainer.get("precision", "32-true")))
    _check_sync_batchnorm(cfg)
    _check_data_settings(cfg)
    _check_numbers(cfg)
    for key in ("max_steps", "max_epochs"):
        if cfg.command == "fit" and cfg.trainer.get(key) == 0:
            raise ValueError(
                f"trainer.{key}=0 trains nothing; give a positive number, or -1 (max_steps) / null "
                "(max_epochs) for no limit"
            )
    if (seed := cfg.get("seed")) is not None and not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an integer or null")


#: Numeric settings checked before anything is built (key, integer, lowest value, lowest allowed): a bad one
#: would otherwise fail deep in interpolation, a sampler or the optimizer, with a message that does not name
#: it.
_NUMBERS = (
    ("model.transform.min_size", True, 1, True),
    ("model.transform.max_size", True, 1, True),
    ("optim.optimizer.lr", False, 0, False),
    ("optim.optimizer.weight_decay", False, 0, True),
    ("optim.optimizer.momentum", False, 0, True),
    ("data.batch_size", True, 1, True),
    ("data.eval_batch_size", True, 1, True),
    ("data.num_workers", True, 0, True),
    ("data.train_size", True, 1, True),
    ("data.val_size", True, 1, True),
    ("data.test_size", True, 1, True),
    ("export.image_size", True, 1, True),
    ("export.batch_size", True, 1, True),
)


def _check_numbers(cfg: DictConfig) -> None:
    for key, integer, low, inclusive in _NUMBERS:
        value = OmegaConf.select(cfg, key, default=None)
        for item in value if isinstance(value, ListConfig) else [value] if value is not None else []:
            number = isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item)
            if (
                not number
                or (integer and not isinstance(item, int))
                or item < low
                or (item == low and not inclusive)
            ):
                kind = "an integer" if integer else "a finite number"
                raise ArgumentError(key, value, f"must be {kind} {'>=' if inclusive else '>'} {low}")


def _check_data_settings(cfg: DictConfig) -> None:
    """Settings of ``data`` its data module does not take: what an experiment written for one ``data`` option
    leaves when combined with another (``experiment=smoke data=coco``: ``data.train_size`` is the generated
    shapes' setting), which ``instantiate`` would report as an unexpected keyword argument of ``__init__``.
    """
    from hydra.utils import get_class  # deferred: checks run before anything heavy is imported

    data = cfg.get("data")
    target = data.get("_target_") if data is not None else None
    if target is None:
        return
    try:
        parameters = inspect.signature(get_class(str(target))).parameters
    except Exception:  # noqa: BLE001 -- an unknown target is instantiate's to report, with its own message
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    if unknown := sorted(str(k) for k in data if not str(k).startswith("_") and k not in parameters):
        name = str(target).rsplit(".", 1)[-1]
        raise ValueError(
            f"data.{', data.'.join(unknown)}: not a setting of {name}, the chosen data option's module. "
            "An experiment written for other data sets such keys (experiment=smoke: the generated shapes "
            f"data): leave the experiment out or choose its data, or drop the override. {name} takes: "
            f"{', '.join(k for k in parameters if k != 'self')}"
        )


def _check_sync_batchnorm(cfg: DictConfig) -> None:
    """SyncBatchNorm only has GPU kernels: say so before Lightning converts the model and training fails."""
    if not cfg.trainer.get("sync_batchnorm", False):
        return
    import torch  # deferred: config checks run before anything heavy is imported

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        raise ValueError(
            "trainer.sync_batchnorm=true needs GPUs: torch's SyncBatchNorm has no CPU kernel. On CPUs "
            "leave it false (each process keeps its own batch statistics), or freeze the norms "
            "(callbacks=fast)."
        )
