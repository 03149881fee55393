"""The LightningModule that trains and evaluates torchvision Mask R-CNN (or Faster R-CNN).

:class:`MaskRCNNModule` owns the model, the losses, COCO-style evaluation and the optimizer. Research code
subclasses it and overrides one of the documented hooks instead of copying the training loop:

* :meth:`MaskRCNNModule.build_model` -- construct the detector (new heads, other backbones);
* :meth:`MaskRCNNModule.compute_loss` -- turn torchvision's loss dict into the scalar to optimise;
* :meth:`MaskRCNNModule.postprocess` -- turn raw detections into the fp32 predictions that are scored;
* :meth:`MaskRCNNModule.configure_optimizers` -- optimizer and schedule (defaults come from ``conf/optim``);
* :meth:`MaskRCNNModule.fp32_regions` -- what runs in fp32 under mixed precision (methods decorated with
  :func:`lit_amp_det.precision.force_fp32` / ``auto_fp16`` take effect too).

Every constructor argument is plain data (numbers, strings, lists, mappings), so hyper-parameters are saved in
checkpoints that load with ``weights_only=True``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch import LightningModule
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import Tensor, nn
from torchmetrics.detection import MeanAveragePrecision

from lit_amp_det.checkpoints import load_model_weights
from lit_amp_det.data.coco import drop_crowd
from lit_amp_det.distributed import gather_list_states
from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.ext_ops import ExtRoIHeads
from lit_amp_det.models.labelled_mask_logits import logit_conv
from lit_amp_det.models.mask_paste import BinaryMaskTransform, use_binary_mask_paste
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.models.patch_deconv import use_patch_deconv
from lit_amp_det.models.pointwise_conv import use_pointwise_matmul
from lit_amp_det.models.speed import COMPILE_TARGETS, compile_detector, use_channels_last
from lit_amp_det.models.winograd_conv import check_output_tile, use_winograd_convs
from lit_amp_det.optim import build_optimizer, check_reference_batch, global_batch_size, scale_lr

__all__ = ["EVAL_BACKENDS", "MaskRCNNModule", "check_eval_backend"]

log = logging.getLogger(__name__)

Batch = tuple[Sequence[Tensor], Sequence[dict[str, Tensor]]]

_DEFAULT_OPTIMIZER = {"_target_": "torch.optim.SGD", "lr": 0.02, "momentum": 0.9, "weight_decay": 1e-4}
_DEFAULT_SCHEDULER = {"_target_": "lit_amp_det.optim.warmup_schedule", "warmup_steps": 100}

#: ``eval_backend`` (the library behind torchmetrics' ``MeanAveragePrecision``) -> the pip package providing it.
#: Both give the same numbers. faster-coco-eval's ``compute()`` takes half the time, but its RLE encoder, which
#: torchmetrics runs on every mask in ``update()``, twice as long: on 160-px images the sum is 1.1-1.35x faster,
#: on 480-px images 0.8x (``python -m lit_amp_det.bench.coco_eval``; BENCHMARKS.md, "COCO evaluation").
EVAL_BACKENDS = {"faster_coco_eval": "faster-coco-eval", "pycocotools": "pycocotools"}


def check_eval_backend(backend: object) -> None:
    """Raises unless ``backend`` is a name in :data:`EVAL_BACKENDS` whose package imports.

    Called by the constructor, so that a misspelt name or a missing package stops a run before any work rather
    than at the first validation. Raises :class:`ArgumentError` (a ``ValueError``) for an unknown name and
    ``ModuleNotFoundError``, with the ``pip install`` command and the other backend, for a missing package.
    """
    if backend not in EVAL_BACKENDS:
        raise ArgumentError("eval_backend", backend, f"is unknown; choose one of {', '.join(EVAL_BACKENDS)}")
    try:
        importlib.import_module(str(backend))
    except ImportError as err:
        package = EVAL_BACKENDS[str(backend)]
        other = next(name for name in EVAL_BACKENDS if name != backend)
        raise ModuleNotFoundError(
            f"eval_backend={backend!r} needs the {package!r} package, which does not import ({err}). Install it "
            f"with `pip install {package}` (`make install` does), or set model.eval_backend={other} "
            f"(eval_backend={other!r} when constructing MaskRCNNModule in Python)."
        ) from err


def _plain(value: Any) -> Any:
    """OmegaConf containers -> builtin dicts/lists, so hyper-parameters pickle without OmegaConf."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


class MaskRCNNModule(LightningModule):
    """Mask R-CNN (``mask=True``) or Faster R-CNN on a ResNet-FPN backbone.

    Args:
        num_classes: classes including background (the CLI fills it in from the data).
        class_names: names of classes 1..K, for logs and predictions.
        category_ids: dataset category id of each class 1..K, so predictions map back to the dataset.
        mask: predict instance masks (Mask R-CNN); ``False`` gives Faster R-CNN.
        ops: ``"ext"`` (lit_amp_det's NMS, RoIAlign and IoU kernels) or ``"torchvision"`` (its own ops, for A/B).
        channels_last: run the detector in the channels_last (NHWC) memory format
            (:func:`lit_amp_det.models.speed.use_channels_last`).
        compile: ``"backbone"`` compiles the ResNet+FPN with ``torch.compile``; ``None`` stays eager.
        deconv_as_matmul: compute the mask head's stride-2 transposed convolution as one matrix product when it
            runs in fp16/bf16 (:mod:`lit_amp_det.models.patch_deconv`; 2x faster forward + backward on a CPU).
        labelled_mask_logits: compute only the mask logits that are read: in training each positive RoI's
            ground-truth class's (the mask loss), at inference each detection's predicted class's
            (:mod:`lit_amp_det.models.labelled_mask_logits`; with ``ops="ext"``).
        pointwise_conv_as_matmul: compute the backbone's and FPN's 1x1 convolutions as matrix products when they run
            in fp16/bf16 on channels_last maps (:mod:`lit_amp_det.models.pointwise_conv`; up to 3x faster forward +
            backward on the CPU's small, deep maps).
        winograd_convs: parts of the detector (``mask_head``, ``rpn_head``, ``fpn``, ``backbone``) whose 3x3,
            stride-1 convolutions run Winograd F(2x2, 3x3) (:mod:`lit_amp_det.models.winograd_conv`; 2.25x fewer
            multiplications) when a layer computes in fp16/bf16/fp32 on the CPU and is large enough; ``[]``: none.
        winograd_output_tile: 2 (F(2x2, 3x3)) or 4: those layers compute in float32 by F(4x4, 3x3) tiles, 4x fewer
            multiplications than the direct convolution (fp16/bf16 layers keep F(2x2, 3x3)).
        winograd_weight_tile_cache: those layers keep their weight's Winograd tiles between calls that build no
            autograd graph (inference, validation) while the weight is unchanged
            (:class:`~lit_amp_det.models.winograd_conv.WeightTileCache`): faster calls, for the tiles' memory
            (2-4x the layers' weights).
        backbone, transform, rpn, roi_heads: see :func:`lit_amp_det.models.maskrcnn.build_detector`.
        optimizer: a ``_target_`` mapping, e.g. ``{"_target_": "torch.optim.SGD", "lr": 0.02, "fused": "auto"}``.
        scheduler: a ``_target_`` mapping called with ``optimizer=`` and ``total_steps=``; ``None`` for none.
        reference_batch: the global batch (images per optimizer step) that ``optimizer.lr`` is given for; the lr
            is scaled linearly to the run's global batch (:func:`lit_amp_det.optim.scale_lr`). ``None``: used as is.
        mask_threshold: mask probability above which a pixel belongs to the instance when scoring.
        binary_mask_paste: at inference, paste each detection's mask into the image as booleans at
            ``mask_threshold`` (:mod:`lit_amp_det.models.mask_paste`): torchvision's masks thresholded, bit for bit,
            without its float canvas per detection. :meth:`postprocess` then receives boolean masks; ``False`` gives
            it torchvision's probabilities.
        eval_backend: library that computes COCO mAP: ``"faster_coco_eval"`` (same numbers, faster on small
            images) or ``"pycocotools"`` (the reference); see :data:`EVAL_BACKENDS`.
        checkpoint: local state dict or Lightning checkpoint to initialise from (``weights_only`` loading).
        checkpoint_strict: if ``False``, tensors whose shapes differ (e.g. a new class count) are skipped.
        weights: a torchvision COCO checkpoint for this architecture by name (``"COCO_V1"``; see
            :func:`lit_amp_det.models.maskrcnn.build_detector`), fetched through torch hub's cache. When
            ``checkpoint`` is set too, the checkpoint wins: ``weights`` and ``backbone.weights`` are checked but not
            fetched, since the checkpoint's tensors would replace them.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        class_names: Sequence[str] | None = None,
        category_ids: Sequence[int] | None = None,
        mask: bool = True,
        ops: str = "ext",
        channels_last: bool = False,
        compile: str | None = None,
        deconv_as_matmul: bool = False,
        labelled_mask_logits: bool = False,
        pointwise_conv_as_matmul: bool = False,
        winograd_convs: Sequence[str] = (),
        winograd_output_tile: int = 2,
        winograd_weight_tile_cache: bool = False,
        backbone: Mapping[str, Any] | None = None,
        transform: Mapping[str, Any] | None = None,
        rpn: Mapping[str, Any] | None = None,
        roi_heads: Mapping[str, Any] | None = None,
        optimizer: Mapping[str, Any] | None = None,
        scheduler: Mapping[str, Any] | None = None,
        mask_threshold: float = 0.5,
        binary_mask_paste: bool = True,
        eval_backend: str = "faster_coco_eval",
        checkpoint: str | None = None,
        checkpoint_strict: bool = True,
        weights: str | None = None,
        reference_batch: int | None = None,
    ) -> None:
        super().__init__()
        # every __init__ argument, a subclass's too; OmegaConf nodes become plain data so that
        # checkpoints load with weights_only=True
        self.save_hyperparameters()
        for key, value in list(self.hparams.items()):
            self.hparams[key] = _plain(value)
        if compile not in COMPILE_TARGETS:
            raise ArgumentError("compile", compile, f"is unknown; choose one of {list(COMPILE_TARGETS)} (null: eager)")
        check_reference_batch(reference_batch)
        check_eval_backend(eval_backend)
        check_output_tile(winograd_output_tile)
        self.model = self.build_model()
        if checkpoint:
            named = {k: v for k, v in (("weights", weights), ("backbone.weights", (backbone or {}).get("weights"))) if v}
            if named:
                log.info("checkpoint=%r supplies the weights: %s checked but not loaded", str(checkpoint),
                         ", ".join(f"{k}={v!r}" for k, v in named.items()))
            load_model_weights(self.model, Path(checkpoint), strict=checkpoint_strict, hparams=self.hparams)
        if binary_mask_paste and mask and not use_binary_mask_paste(self.model, mask_threshold):
            log.warning("model.binary_mask_paste=true: the detector's transform is %s, not torchvision's "
                        "GeneralizedRCNNTransform, so its masks are pasted as it pastes them",
                        type(getattr(self.model, "transform", None)).__name__)
        if channels_last:
            use_channels_last(self.model)
        if deconv_as_matmul and use_patch_deconv(self.model) == 0:
            log.warning("model.deconv_as_matmul=true: the model has no transposed convolution whose kernel equals "
                        "its stride (a Faster R-CNN has none), so nothing was switched")
        if labelled_mask_logits:
            self._use_labelled_mask_logits()
        if pointwise_conv_as_matmul:
            use_pointwise_matmul(self.model)
        if winograd_convs and use_winograd_convs(self.model, list(winograd_convs), winograd_output_tile,
                                                 cache_weight_tiles=winograd_weight_tile_cache) == 0:
            log.warning("model.winograd_convs=%s: the model has no 3x3, stride-1 convolution there, so nothing was "
                        "switched", list(winograd_convs))
        compile_detector(self.model, compile)
        self.val_metric = self.build_metric()
        self.test_metric = self.build_metric()
        self.last_validated_step: int | None = None  # lets train() tell whether the final weights were scored

    def _use_labelled_mask_logits(self) -> None:
        heads = getattr(self.model, "roi_heads", None)
        if not isinstance(heads, ExtRoIHeads) or not heads.has_mask():
            log.warning("model.labelled_mask_logits=true: it applies to Mask R-CNN with model.ops=ext (the RoI heads "
                        "are %s), so nothing was switched", type(heads).__name__)
            return
        if logit_conv(heads.mask_predictor) is None:
            log.warning("model.labelled_mask_logits=true: the mask predictor (%s) is not shaped like torchvision's "
                        "MaskRCNNPredictor, so the loss keeps every class's logits", type(heads.mask_predictor).__name__)
        heads.labelled_mask_logits = True

    # ------------------------------------------------------------------------------ override points
    def build_model(self) -> nn.Module:
        """Constructs the detector from ``self.hparams``. Override to change the architecture."""
        hp = self.hparams
        return build_detector(
            hp.num_classes,
            mask=hp.mask,
            ops=hp.get("ops", "ext"),
            backbone=hp.backbone,
            transform=hp.transform,
            rpn=hp.rpn,
            roi_heads=hp.roi_heads,
            weights=hp.get("weights"),
            load_weights=not hp.get("checkpoint"),  # the checkpoint replaces them: see ``weights``
        )

    def compute_loss(self, loss_dict: Mapping[str, Tensor]) -> Tensor:
        """Reduces torchvision's loss dict to the training loss. Override to weight or add terms."""
        return torch.stack([value.float() for value in loss_dict.values()]).sum()

    def postprocess(self, detections: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """Turns raw detections into fp32 boxes/scores, int64 labels and boolean ``[N, H, W]`` masks.

        The raw masks are ``[N, 1, H, W]``: booleans already thresholded with ``binary_mask_paste`` (the default),
        torchvision's probabilities without it.
        """
        results = []
        for det in detections:
            out = {"boxes": det["boxes"].float(), "scores": det["scores"].float(), "labels": det["labels"].long()}
            if "masks" in det:
                masks = det["masks"][:, 0]
                out["masks"] = masks if masks.dtype == torch.bool else masks.float() > self.hparams.mask_threshold
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
        (``sync_on_compute=False``: torchmetrics' own gather needs equally long shards). ``eval_backend`` picks
        the library that computes it (:data:`EVAL_BACKENDS`).
        """
        iou_types = ("bbox", "segm") if self.hparams.mask else ("bbox",)
        backend = self.hparams.get("eval_backend", "faster_coco_eval")  # checked in __init__
        return MeanAveragePrecision(iou_type=iou_types, backend=backend, sync_on_compute=False)

    def configure_optimizers(self) -> Any:
        """Optimizer from ``hparams.optimizer`` and a per-step schedule from ``hparams.scheduler``.

        With ``hparams.reference_batch`` set, the lr is scaled by the global batch over it (the global batch is
        the data module's ``batch_size`` x devices x nodes x ``accumulate_grad_batches``).
        """
        params = [p for p in self.parameters() if p.requires_grad]
        given = self.hparams.optimizer or _DEFAULT_OPTIMIZER
        optimizer_cfg = given
        reference = self.hparams.get("reference_batch")
        if reference is not None:
            trainer = self.trainer
            batch = global_batch_size(getattr(trainer.datamodule, "batch_size", None), trainer.world_size,
                                      trainer.accumulate_grad_batches)
            optimizer_cfg = scale_lr(given, batch, reference)
            if trainer.is_global_zero:
                log.info("lr %g for a global batch of %d images (%g given for reference_batch=%d)",
                         optimizer_cfg["lr"], batch, given["lr"], reference)
        optimizer = build_optimizer(optimizer_cfg, params)
        scheduler_cfg = self.hparams.scheduler if self.hparams.scheduler is not None else _DEFAULT_SCHEDULER
        if not scheduler_cfg:
            return optimizer
        scheduler = instantiate(
            dict(scheduler_cfg), optimizer=optimizer, total_steps=max(int(self.trainer.estimated_stepping_batches), 1)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------ forward
    @staticmethod
    def prepare_images(images: Sequence[Tensor]) -> list[Tensor]:
        """``uint8`` images (as the loaders deliver them) become float in [0, 1] on their device."""
        return [img.float().div_(255) if img.dtype == torch.uint8 else img for img in images]

    @staticmethod
    def training_targets(targets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """Crowd regions are not objects to learn: they only matter for evaluation."""
        return [
            {k: v for k, v in drop_crowd(t).items() if k in ("boxes", "labels", "masks")} for t in targets
        ]

    def forward(self, images: Sequence[Tensor]) -> list[dict[str, Tensor]]:
        """Detections (post-processed, fp32) for a list of ``[3, H, W]`` images."""
        transform = getattr(self.model, "transform", None)
        if isinstance(transform, BinaryMaskTransform):  # the threshold is read per call, as postprocess reads it
            transform.mask_threshold = float(self.hparams.mask_threshold)
        return self.postprocess(self.model(self.prepare_images(images)))

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        images, targets = batch
        loss_dict = self.model(self.prepare_images(images), self.training_targets(targets))
        loss = self.compute_loss(loss_dict)
        batch_size = len(images)
        self.log_dict({f"train/{k}": v.detach().float() for k, v in loss_dict.items()}, batch_size=batch_size)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch_size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], prog_bar=True, batch_size=batch_size)
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
            f"{stage}/{key.replace('map', 'mAP', 1) if key.startswith(('bbox_map', 'segm_map')) else key}": value
            for key, value in results.items()
            if key.split("_", 1)[-1] in wanted and value.numel() == 1
        }
        # torchmetrics already gathered every rank's images before compute(), so the values are global and equal
        # on all ranks; sync_dist averages equal numbers (a few scalars once per epoch) and keeps every rank's
        # checkpoint callback seeing the same value
        self.log_dict({k: v.float() for k, v in values.items()}, prog_bar=False, sync_dist=True)

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> list[dict[str, Any]]:
        """Detections with the dataset's image ids and category ids, ready for a COCO results file."""
        images, targets = batch
        predictions = self(images)
        category_ids = self.hparams.category_ids
        for pred, target in zip(predictions, targets):
            pred["image_id"] = int(target["image_id"])
            if "file_name" in target:  # a folder of pictures (data.predict_images): the writer records it
                pred["file_name"] = target["file_name"]
            if category_ids:
                pred["category_ids"] = torch.tensor([category_ids[int(i) - 1] for i in pred["labels"]])
        return predictions
