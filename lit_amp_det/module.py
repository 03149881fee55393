"""The LightningModule that trains and evaluates torchvision Mask R-CNN (or Faster R-CNN).

:class:`MaskRCNNModule` owns the model, the losses, COCO-style evaluation and the optimizer. Research code
subclasses it and overrides one of the documented hooks instead of copying the training loop:

* :meth:`MaskRCNNModule.build_model` -- construct the detector (new heads, other backbones);
* :meth:`MaskRCNNModule.model_transforms` -- the implementation transforms (``speedups``) applied to it;
* :meth:`MaskRCNNModule.compute_loss` -- turn torchvision's loss dict into the scalar to optimise;
* :meth:`MaskRCNNModule.postprocess` -- turn raw detections into the fp32 predictions that are scored;
* :meth:`MaskRCNNModule.configure_optimizers` -- optimizer and schedule (defaults come from ``conf/optim``);
* :meth:`MaskRCNNModule.fp32_regions` -- what runs in fp32 under mixed precision (methods decorated with
  :func:`lit_amp_det.precision.force_fp32` / ``auto_fp16`` take effect too).

Every constructor argument is plain data (numbers, strings, lists, mappings), so hyper-parameters are saved in
checkpoints that load with ``weights_only=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from hydra.utils import instantiate
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.detection import MeanAveragePrecision

from lit_amp_det.checkpoints import load_model_weights, local_weights
from lit_amp_det.data.coco import drop_crowd
from lit_amp_det.distributed import gather_list_states
from lit_amp_det.models.mask_paste import BinaryMaskTransform
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.models.speedups import DEFAULT_SPEEDUPS, ModelTransform, apply_transforms, build_transforms
from lit_amp_det.models.sync_free import is_fixed_shape
from lit_amp_det.module_settings import EVAL_BACKENDS, check_eval_backend, check_evaluation, check_optim
from lit_amp_det.optim import build_optimizer, global_batch_size, scale_lr
from lit_amp_det.settings import (
    BackboneSettings,
    DetectorSettings,
    RoIHeadsSettings,
    RPNSettings,
    TransformSettings,
    plain_settings,
)

__all__ = ["EVAL_BACKENDS", "CapturedStep", "MaskRCNNModule", "check_eval_backend"]

log = logging.getLogger(__name__)

Batch = tuple[Sequence[Tensor], Sequence[dict[str, Tensor]]]


class CapturedStep(Protocol):
    """A whole training step that :meth:`MaskRCNNModule.training_step` hands a batch to: forward, loss,
    backward and the optimizer step, e.g. replayed as one CUDA graph (``callbacks.cuda_graph``).

    Installed with :meth:`MaskRCNNModule.set_captured_step`.
    """

    def run(
        self,
        module: MaskRCNNModule,
        images: Sequence[Tensor],
        targets: Sequence[dict[str, Tensor]],
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Trains one step on a batch.

        Args:
            module: the module that trains.
            images: the batch's ``[3, H, W]`` images, as the loader delivers them.
            targets: the batch's targets, as the loader delivers them (padded: ``data.pad_instances``).

        Returns:
            ``(loss_dict, loss)``: the losses of the step, for logging.
        """
        ...


def _metric_name(key: str) -> str:
    """torchmetrics' ``bbox_map_50`` as logged (``bbox_mAP_50``); other keys as they are."""
    return key.replace("map", "mAP", 1) if key.startswith(("bbox_map", "segm_map")) else key


class MaskRCNNModule(LightningModule):
    """Mask R-CNN (``mask=True``) or Faster R-CNN on a ResNet-FPN backbone.

    The constructor takes what the model is, where its weights come from, how it is optimised and how it is
    evaluated; how it computes (kernels, memory format, compilation) is ``speedups``, applied to the built
    detector by :meth:`configure_model`.

    Args:
        num_classes: classes including background (the CLI fills it in from the data).
        class_names: names of classes 1..K, for logs and predictions.
        category_ids: dataset category id of each class 1..K, so predictions map back to the dataset.
        mask: predict instance masks (Mask R-CNN); ``False`` gives Faster R-CNN.
        backbone: the ResNet trunk and FPN, :class:`~lit_amp_det.settings.BackboneSettings` or a mapping of
            some of its keys (the others take its defaults, ``conf/model/maskrcnn_light``'s; so for the next
            three).
        transform: resizing and normalisation, :class:`~lit_amp_det.settings.TransformSettings` or a mapping.
        rpn: the region proposal network, :class:`~lit_amp_det.settings.RPNSettings` or a mapping.
        roi_heads: the box and mask heads, :class:`~lit_amp_det.settings.RoIHeadsSettings` or a mapping.
        weights: where the weights come from: a torchvision COCO checkpoint for this architecture by name
            (``"COCO_V1"``, ``"DEFAULT"``; see :func:`~lit_amp_det.models.maskrcnn.build_detector`), fetched
            through torch hub's cache, or a local file: a state dict of the detector or a Lightning
            checkpoint, loaded with ``weights_only=True``. With another class count than the file's, the
            class-dependent predictor layers keep their fresh initialisation (fine-tuning); any other
            difference is an error that names the settings the file was made with. A local file replaces
            ``backbone.weights``, which is then checked but not fetched. ``None``: no detection weights.
        optim: ``optimizer`` (a ``_target_`` mapping, e.g. ``{"_target_": "torch.optim.SGD", "lr": 0.02,
        "fused":
            "auto"}``), ``scheduler`` (a ``_target_`` mapping called with ``optimizer=`` and ``total_steps=``;
            ``None`` for none) and ``reference_batch`` (the global batch that ``optimizer.lr`` is given for;
            the lr is scaled linearly to the run's global batch, :func:`lit_amp_det.optim.scale_lr`; ``None``:
            used as is). The Hydra app passes ``conf/optim``.
        evaluation: ``mask_threshold`` (mask probability above which a pixel belongs to the instance, for
            predictions and scoring; 0.5) and ``backend``, the library that computes COCO mAP:
            ``"faster_coco_eval"`` (the default) or ``"pycocotools"`` (see :data:`EVAL_BACKENDS`).
        speedups: the implementation transforms :meth:`configure_model` applies, a mapping of names to
            ``_target_`` mappings of :class:`~lit_amp_det.models.speedups.ModelTransform` (``conf/speedups``);
            ``None``: :data:`~lit_amp_det.models.speedups.DEFAULT_SPEEDUPS`; ``{}``: none. See
            :meth:`model_transforms` for a subclass that builds its own model.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        class_names: Sequence[str] | None = None,
        category_ids: Sequence[int] | None = None,
        mask: bool = True,
        backbone: BackboneSettings | Mapping[str, Any] | None = None,
        transform: TransformSettings | Mapping[str, Any] | None = None,
        rpn: RPNSettings | Mapping[str, Any] | None = None,
        roi_heads: RoIHeadsSettings | Mapping[str, Any] | None = None,
        weights: str | None = None,
        optim: Mapping[str, Any] | None = None,
        evaluation: Mapping[str, Any] | None = None,
        speedups: Mapping[str, Mapping[str, Any] | None] | None = None,
    ) -> None:
        super().__init__()
        # every __init__ argument, a subclass's too; OmegaConf nodes become plain data so that
        # checkpoints load with weights_only=True
        self.save_hyperparameters()
        for key, value in list(self.hparams.items()):
            self.hparams[key] = plain_settings(value)
        self.detector_settings = DetectorSettings.of(
            backbone=backbone,
            transform=transform,
            rpn=rpn,
            roi_heads=roi_heads,
        )
        self.optim_settings = check_optim(optim)
        self.evaluation_settings = check_evaluation(evaluation)
        self.configured_speedups = build_transforms(DEFAULT_SPEEDUPS if speedups is None else speedups)
        self.applied_speedups: list[str] | None = None  # set by configure_model
        self.model = self.build_model()
        local = local_weights(weights)
        if local is not None:
            named = self.detector_settings.backbone.weights
            if named:
                log.info(
                    "weights=%r supplies the weights: backbone.weights=%r checked but not loaded",
                    str(local),
                    named,
                )
            load_model_weights(self.model, local, hparams=self.hparams)
        self.val_metric = self.build_metric()
        self.test_metric = self.build_metric()
        self.last_validated_step: int | None = None  # lets train() tell whether the final weights were scored
        self._captured_step: CapturedStep | None = None  # see set_captured_step
        self._lookup: Tensor | None = None  # category_ids on the device (predict_step)
        self._lookup_key: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------------------ implementation choices
    def model_transforms(self) -> list[ModelTransform]:
        """The implementation transforms :meth:`configure_model` applies to :meth:`build_model`'s detector.

        The configured ``speedups`` when this class builds the package's detector. A subclass that overrides
        :meth:`build_model` gets exactly the model it built: it opts in by overriding this method, e.g. to
        return ``self.configured_speedups`` (or transforms of its own).
        """
        if type(self).build_model is not MaskRCNNModule.build_model:
            return []
        return list(self.configured_speedups)

    def configure_model(self) -> None:
        """Applies :meth:`model_transforms` to ``self.model``, once (Lightning calls this before every fit,
        validate, test and predict; call it yourself to use the module without a Trainer). Each transform
        applies only on the device types it declares: the Trainer's device, or the module's outside a Trainer.
        """
        if self.applied_speedups is not None:
            return
        try:
            device = self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            device = self.device
        transforms = self.model_transforms()
        self.model, self.applied_speedups = apply_transforms(self.model, transforms, device)
        if transforms:
            log.info("speedups on %s: %s", device.type, ", ".join(self.applied_speedups) or "none")

    @property
    def captured_step(self) -> CapturedStep | None:
        """The step :meth:`training_step` hands each batch to (:meth:`set_captured_step`), or ``None``."""
        return self._captured_step

    def set_captured_step(self, step: CapturedStep | None) -> None:
        """Installs ``step`` as what :meth:`training_step` runs on each batch, or removes it (``None``).

        A captured step takes the optimizer step itself, so the module optimises manually while one is
        installed and automatically again once it is removed. ``callbacks.cuda_graph`` installs itself when
        fit starts and removes itself at teardown.

        Args:
            step: the step that trains each batch; ``None``: Lightning's automatic optimisation again.
        """
        self._captured_step = step
        self.automatic_optimization = step is None

    # ------------------------------------------------------------------------------ override points
    def build_model(self) -> nn.Module:
        """Constructs the detector from ``self.hparams``. Override to change the architecture."""
        hp = self.hparams
        weights = hp.get("weights")
        local = local_weights(weights) is not None
        # load_weights: a local file replaces the named weights (see ``weights``)
        return build_detector(
            hp.num_classes,
            mask=hp.mask,
            **self.detector_settings.build_kwargs(),
            weights=None if local else weights,
            load_weights=not local,
        )

    def compute_loss(self, loss_dict: Mapping[str, Tensor]) -> Tensor:
        """Reduces torchvision's loss dict to the training loss. Override to weight or add terms."""
        return torch.stack([value.float() for value in loss_dict.values()]).sum()

    def postprocess(self, detections: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """Turns raw detections into fp32 boxes/scores, int64 labels and boolean ``[N, H, W]`` masks.

        The raw masks are ``[N, 1, H, W]``: booleans already thresholded with the ``binary_mask_paste``
        speedup (a default), torchvision's probabilities without it.
        """
        results = []
        for det in detections:
            out = {
                "boxes": det["boxes"].float(),
                "scores": det["scores"].float(),
                "labels": det["labels"].long(),
            }
            if "masks" in det:
                masks = det["masks"][:, 0]
                threshold = self.evaluation_settings.mask_threshold
                out["masks"] = masks if masks.dtype == torch.bool else masks.float() > threshold
            results.append(out)
        return results

    def fp32_regions(self) -> dict[str, str]:
        """Methods that run in fp32 under mixed precision (paths relative to this module).

        ``fp32``: inputs cast to fp32 and autocast disabled inside; ``fp32_outputs``: computed as usual,
        outputs cast to fp32 (so the losses and post-processing that consume them run in fp32). Override to
        add regions of your own model; ``precision.fp32_regions`` in the config replaces the whole mapping.
        """
        regions = {
            "model.rpn.compute_loss": "fp32",  # objectness and RPN box-regression losses
            "model.rpn.filter_proposals": "fp32",  # sigmoid, per-level top-k, clipping, NMS
            "model.rpn.box_coder.encode": "fp32",  # box coding: regression targets
            "model.rpn.box_coder.decode": "fp32",
            "model.roi_heads.box_coder.encode": "fp32",
            "model.roi_heads.box_coder.decode": "fp32",
            "model.roi_heads.box_predictor.forward": "fp32_outputs",  # classification and box losses in fp32
            "model.roi_heads.postprocess_detections": "fp32",  # score thresholds and NMS
            "model.transform.postprocess": "fp32",  # box rescaling and mask pasting
        }
        if self.hparams.mask:
            regions["model.roi_heads.mask_predictor.forward"] = "fp32_outputs"  # mask loss and mask inference
        return regions

    def build_metric(self) -> MeanAveragePrecision:
        """COCO mAP for boxes, and masks when the model predicts them.

        Under DDP each rank scores its shard; :meth:`_log_metric` gathers the shards before computing
        (``sync_on_compute=False``: torchmetrics' own gather needs equally long shards).
        ``evaluation.backend`` picks the library that computes it (:data:`EVAL_BACKENDS`).
        """
        iou_types = ("bbox", "segm") if self.hparams.mask else ("bbox",)
        backend = self.evaluation_settings.backend
        return MeanAveragePrecision(iou_type=iou_types, backend=backend, sync_on_compute=False)

    def configure_optimizers(self) -> Any:
        """Optimizer from ``optim.optimizer`` and a per-step schedule from ``optim.scheduler``.

        With ``optim.reference_batch`` set, the lr is scaled by the global batch over it (the global batch is
        the data module's ``batch_size`` x devices x nodes x ``accumulate_grad_batches``).
        """
        params = [p for p in self.parameters() if p.requires_grad]
        settings = self.optim_settings
        given = settings.optimizer
        optimizer_cfg = given
        reference = settings.reference_batch
        if reference is not None:
            trainer = self.trainer
            batch = global_batch_size(
                getattr(trainer.datamodule, "batch_size", None),
                trainer.world_size,
                trainer.accumulate_grad_batches,
            )
            optimizer_cfg = scale_lr(given, batch, reference)
            if trainer.is_global_zero:
                log.info(
                    "lr %g for a global batch of %d images (%g given for reference_batch=%d)",
                    optimizer_cfg["lr"],
                    batch,
                    given["lr"],
                    reference,
                )
        optimizer = build_optimizer(optimizer_cfg, params)
        scheduler_cfg = settings.scheduler
        if not scheduler_cfg:
            return optimizer
        scheduler = instantiate(
            dict(scheduler_cfg),
            optimizer=optimizer,
            total_steps=max(int(self.trainer.estimated_stepping_batches), 1),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------ export
    def to_onnx(
        self, file_path: str | Path | None = None, input_sample: Tensor | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's ``to_onnx`` for a detector: :mod:`lit_amp_det.deploy`'s fixed-shape graph (standard
        ONNX ops; padded detections and each image's count) traced on ``input_sample``, a ``[B, 3, H, W]``
        batch (uint8, or float in [0, 1]; default ``example_input_array``, else one image at the inference
        size). Saved to ``file_path`` with a JSON description beside it; returns the ``ONNXProgram``.
        ``kwargs`` go to ``torch.onnx.export``.
        """
        from lit_amp_det.deploy import export_detector

        sample = input_sample if input_sample is not None else self.example_input_array
        return export_detector(self, file_path, "onnx", sample=sample, **kwargs)

    def to_torchscript(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the detector calls the package's ops and hooks that TorchScript (deprecated) cannot
        compile.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot become TorchScript: its detector calls lit_amp_det's ops, which "
            "TorchScript (deprecated by PyTorch) cannot compile. Use module.to_onnx(path) for ONNX, or "
            "torch.export through `python -m lit_amp_det export format=pt2` / "
            "lit_amp_det.deploy.export_detector(module, path, 'pt2')"
        )

    # ------------------------------------------------------------------------------------ forward
    @staticmethod
    def prepare_images(images: Sequence[Tensor]) -> list[Tensor]:
        """``uint8`` images (as the loaders deliver them) become float in [0, 1] on their device."""
        return [img.float().div_(255) if img.dtype == torch.uint8 else img for img in images]

    @property
    def instances_per_image(self) -> int | None:
        """The instance count the fixed-shape detector's training targets are padded to
        (``speedups.sync_free.instances_per_image``; the data module pads to it), or None.
        """
        return self.model.instances_per_image if is_fixed_shape(self.model) else None

    @staticmethod
    def training_targets(targets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """Crowd regions are not objects to learn: they only matter for evaluation. ``valid`` marks padded
        instances (``data.pad_instances``).
        """
        kept = ("boxes", "labels", "masks", "valid")
        return [{k: v for k, v in drop_crowd(t).items() if k in kept} for t in targets]

    def forward(self, images: Sequence[Tensor]) -> list[dict[str, Tensor]]:
        """Detections (post-processed, fp32) for a list of ``[3, H, W]`` images."""
        transform = getattr(self.model, "transform", None)
        if isinstance(
            transform, BinaryMaskTransform
        ):  # the threshold is read per call, as postprocess reads it
            transform.mask_threshold = self.evaluation_settings.mask_threshold
        return self.postprocess(self.model(self.prepare_images(images)))

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        images, targets = batch
        captured = self._captured_step
        if captured is not None:  # forward, backward and optimizer step as one CUDA graph replay
            loss_dict, loss = captured.run(self, images, targets)
        else:
            targets = self.training_targets(targets)
            if targets and "valid" in targets[0] and not is_fixed_shape(self.model):
                raise ValueError(
                    "the training targets are padded (data.pad_instances), which only the sync_free "
                    "detector reads: apply it on this device (speedups.sync_free.devices) or set "
                    "data.pad_instances=null"
                )
            loss_dict = self.model(self.prepare_images(images), targets)
            loss = self.compute_loss(loss_dict)
        batch_size = len(images)
        self.log_dict({f"train/{k}": v.detach().float() for k, v in loss_dict.items()}, batch_size=batch_size)
        # the progress bar reads what it shows at every refresh: a captured step would wait for the device
        # each step
        shown = captured is None
        self.log("train/loss", loss.detach(), prog_bar=shown, batch_size=batch_size)
        lr = self.optimizers().param_groups[0]["lr"]
        if not isinstance(
            lr, Tensor
        ):  # a host number stays on the host (self.log would copy it to the device)
            lr = torch.tensor(float(lr), dtype=torch.float32)
        self.log("train/lr", lr, prog_bar=True, batch_size=batch_size)
        return loss

    def _evaluate(self, batch: Batch, metric: MeanAveragePrecision) -> None:
        images, targets = batch
        predictions = self(images)
        metric.update(predictions, [self._metric_target(t) for t in targets])

    def _metric_target(self, target: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {"boxes": target["boxes"].float(), "labels": target["labels"].long()}
        if "iscrowd" in target:
            out["iscrowd"] = target["iscrowd"].long()
        if "area" in target:
            out["area"] = target["area"].float()
        if self.hparams.mask:
            out["masks"] = target["masks"].bool()
        return out

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metric)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metric)

    def on_validation_epoch_end(self) -> None:
        self._log_metric("val", self.val_metric)
        if not self.trainer.sanity_checking:
            self.last_validated_step = self.trainer.global_step

    def on_test_epoch_end(self) -> None:
        self._log_metric("test", self.test_metric)

    def _log_metric(self, stage: str, metric: MeanAveragePrecision) -> None:
        gather_list_states(metric)  # every rank then computes mAP over the whole split
        results = metric.compute()
        metric.reset()
        wanted = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large", "mar_100")
        values = {
            f"{stage}/{_metric_name(key)}": value
            for key, value in results.items()
            if key.split("_", 1)[-1] in wanted and value.numel() == 1
        }
        # torchmetrics already gathered every rank's images before compute(), so the values are global and
        # equal on all ranks; sync_dist averages equal numbers (a few scalars once per epoch) and keeps every
        # rank's checkpoint callback seeing the same value
        self.log_dict({k: v.float() for k, v in values.items()}, prog_bar=False, sync_dist=True)

    def _category_lookup(self) -> Tensor | None:
        """``category_ids`` as a tensor on the module's device (class k -> entry k - 1), made again only when
        the ids or the device change, so that a predict batch copies nothing from the host; None without ids.
        """
        category_ids = self.hparams.category_ids
        if not category_ids:
            return None
        key = (self.device, tuple(int(i) for i in category_ids))
        if self._lookup_key != key:
            with torch.inference_mode(False):  # usable outside predict's inference mode too
                self._lookup = torch.tensor(key[1], device=self.device)
            self._lookup_key = key
        return self._lookup

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> list[dict[str, Any]]:
        """Detections with the dataset's image ids and category ids, ready for a COCO results file."""
        images, targets = batch
        predictions = self(images)
        image_ids = (
            torch.stack([t["image_id"] for t in targets]).tolist() if targets else []
        )  # one read a batch
        lookup = self._category_lookup()
        for pred, target, image_id in zip(predictions, targets, image_ids):
            pred["image_id"] = int(image_id)
            if "file_name" in target:  # a folder of pictures (data.predict_images): the writer records it
                pred["file_name"] = target["file_name"]
            if lookup is not None:
                pred["category_ids"] = lookup[pred["labels"] - 1]
        return predictions
