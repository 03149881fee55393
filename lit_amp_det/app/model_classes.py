"""Which classes a model detects when ``predict`` runs on a folder of pictures that has no annotations.

Every other command reads the class count, names and COCO category ids from the data's annotations, because
its metrics or ``predictions.json`` must use the data's ids. Pictures in ``data.predict_images`` have none, so
there the classes are the model's own, taken where the weights come from (as MMDetection's ``init_detector``
takes ``dataset_meta`` from the checkpoint, and torchvision a COCO model's labels from
``meta["categories"]``):

1. ``ckpt_path`` (a Lightning checkpoint saves the module's ``num_classes`` / ``class_names`` /
   ``category_ids``);
2. ``model.weights`` when it names a Lightning checkpoint file (a bare state dict names none);
3. ``model.weights`` (torchvision's COCO weights: 91 labels, label ``i`` is COCO category id ``i``);
4. otherwise the data, as for the other commands (``data.root`` with the training annotations, or the shapes
   data).

A value set in the model config (``model.num_classes=...``) wins over all of them. So the training data need
not be on the machine that predicts: ``predict ckpt_path=<fit> data=coco data.predict_images=DIR`` needs no
``data.root``.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from lit_amp_det.checkpoints import local_weights, names_a_checkpoint_file, read_checkpoint, saved_classes
from lit_amp_det.models.weights import NO_WEIGHTS, detection_checkpoint, resolve_weights

__all__ = ["folder_prediction_classes", "predicts_on_a_folder", "reads_no_split", "weights_classes"]

log = logging.getLogger(__name__)


def predicts_on_a_folder(cfg: DictConfig) -> bool:
    """``predict`` with ``data.predict_images`` set: pictures without annotations."""
    return str(cfg.get("command")) == "predict" and (cfg.get("data") or {}).get("predict_images") is not None


def reads_no_split(cfg: DictConfig) -> bool:
    """A command that reads no data split, so the model's classes come from its weights: ``predict`` on a
    folder of pictures, or ``export``.
    """
    return str(cfg.get("command")) == "export" or predicts_on_a_folder(cfg)


def weights_classes(name: str, mask: bool) -> dict[str, Any]:
    """The classes of torchvision's detection weights ``name`` (``COCO_V1``, ``DEFAULT``) from their metadata,
    reading no file. torchvision's COCO detectors predict label ``i`` for COCO category id ``i`` (1..90, the
    unused ids named ``N/A``), so the category ids are the labels themselves.
    """
    weights = resolve_weights(detection_checkpoint(mask).enum, name, "model.weights")
    categories = list(weights.meta["categories"])  # index 0 is the background
    return {
        "num_classes": len(categories),
        "class_names": categories[1:],
        "category_ids": list(range(1, len(categories))),
    }


def folder_prediction_classes(
    cfg: DictConfig, ckpt_path: str | None, checkpoint: Any = None
) -> dict[str, Any] | None:
    """The class hyper-parameters ``predict`` on ``data.predict_images`` builds the model with (see the
    module): ``None`` when no weights name them (the data does, rule 4), else the keys the weights name less
    those ``cfg.model`` sets itself (the data is then not read for classes). ``checkpoint``: ``ckpt_path``'s
    content, if already read.
    """
    if names_a_checkpoint_file(ckpt_path):
        payload = checkpoint if checkpoint is not None else read_checkpoint(ckpt_path, "ckpt_path")
        found, source = saved_classes(payload), f"ckpt_path={ckpt_path}"
    elif (local := local_weights(cfg.model.get("weights"))) is not None:
        found = saved_classes(
            read_checkpoint(local, "model.weights")
        )  # the file the module loads: ~ expanded
        source = f"model.weights={cfg.model.weights}"
    elif cfg.model.get("weights") not in NO_WEIGHTS:
        found = weights_classes(str(cfg.model.weights), bool(cfg.model.get("mask", True)))
        source = f"model.weights={cfg.model.weights}"
    else:
        return None
    if not found:  # a bare state dict, or a module saved without its classes
        return None
    log.info(
        "%s: %d classes from %s",
        "predict on data.predict_images" if cfg.command == "predict" else cfg.command,
        found["num_classes"] - 1,
        source,
    )
    return {key: value for key, value in found.items() if cfg.model.get(key) is None}
