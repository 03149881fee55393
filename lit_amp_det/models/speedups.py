"""Implementation choices applied to a built detector: which kernels run, memory format, compilation, mask
paste.

Each is a :class:`ModelTransform`: a callable ``nn.Module -> nn.Module`` that changes how the detector
computes, not what it is. It keeps every ``state_dict`` key and shape (a checkpoint loads with or without it),
and declares the device types it applies to. :class:`~lit_amp_det.MaskRCNNModule` applies the configured ones
in one place, its ``configure_model``, after ``build_model()``; ``conf/speedups/`` lists them
(``speedups=none`` gives torchvision's model as built). Each transform's config is a ``_target_`` mapping, so
a user adds their own the same way.

* :class:`ExtensionOps` -- lit_amp_det's NMS, RoIAlign and IoU kernels in the RPN and RoI heads
  (:func:`~lit_amp_det.models.ext_ops.use_extension_ops`);
* :class:`BinaryMaskPaste` -- inference pastes each detection's mask as booleans, without torchvision's float
  canvas per detection (:mod:`lit_amp_det.models.mask_paste`);
* :class:`SyncFree` -- fixed shapes and no host synchronisation in a step
  (:mod:`lit_amp_det.models.sync_free`);
* :class:`ChannelsLast` -- NHWC weights and activations (tensor-core convolutions without layout copies on a
  GPU);
* :class:`CompileBackbone` -- ``torch.compile`` of the ResNet+FPN, the part with static shapes.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import Tensor, nn

from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.ext_ops import use_extension_ops, uses_extension_ops
from lit_amp_det.models.mask_paste import use_binary_mask_paste
from lit_amp_det.models.sync_free import checked_instance_count, fixed_shape_detector, is_fixed_shape

__all__ = [
    "DEFAULT_SPEEDUPS",
    "DEVICE_TYPES",
    "BinaryMaskPaste",
    "ChannelsLast",
    "CompileBackbone",
    "ExtensionOps",
    "ModelTransform",
    "SyncFree",
    "apply_transforms",
    "build_transforms",
]

log = logging.getLogger(__name__)

#: The device types a transform may declare.
DEVICE_TYPES = ("cpu", "cuda")

#: What ``speedups`` means for the detector :class:`~lit_amp_det.MaskRCNNModule` builds when none are given
#: (the same as ``conf/speedups/default.yaml``).
DEFAULT_SPEEDUPS: dict[str, dict[str, Any]] = {
    "ext_ops": {"_target_": "lit_amp_det.models.speedups.ExtensionOps"},
    "binary_mask_paste": {"_target_": "lit_amp_det.models.speedups.BinaryMaskPaste"},
    "sync_free": {
        "_target_": "lit_amp_det.models.speedups.SyncFree",
        "devices": ["cuda"],
        "instances_per_image": None,
    },
}


class ModelTransform(ABC):
    """An implementation choice: ``transform(model)`` returns the model computing the same function another
    way.

    Subclasses set :attr:`name` and implement :meth:`__call__`, which may change the model in place or
    return a new one made of its modules, and must
    keep its ``state_dict`` keys and shapes. ``devices`` (the device types it applies to, a subset of
    :data:`DEVICE_TYPES`) defaults to the class's :attr:`default_devices`.
    """

    name: ClassVar[str]
    default_devices: ClassVar[tuple[str, ...]] = DEVICE_TYPES

    def __init__(self, devices: Sequence[str] | None = None) -> None:
        chosen = tuple(self.default_devices if devices is None else devices)
        unknown = [d for d in chosen if d not in DEVICE_TYPES]
        if unknown or not chosen:
            raise ArgumentError("devices", list(chosen), f"must list device types among {list(DEVICE_TYPES)}")
        self.devices = chosen

    def applies_to(self, device: torch.device | str) -> bool:
        """Whether this transform is for a model that runs on ``device``."""
        return torch.device(device).type in self.devices

    @abstractmethod
    def __call__(self, model: nn.Module) -> nn.Module:
        """The transformed model: ``model`` itself, changed in place, or a new one made of its modules."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self.devices)})"


class ExtensionOps(ModelTransform):
    """Runs the RPN and RoI heads on lit_amp_det's NMS, RoIAlign and IoU kernels (C++ on a CPU, Triton on
    CUDA).

    They stop NMS at the number of boxes kept afterwards, pool every FPN level in one call, keep fp16/bf16
    features in their dtype and crop a training batch's mask targets in one call; the detections are
    torchvision's.
    """

    name = "ext_ops"

    def __call__(self, model: nn.Module) -> nn.Module:
        return use_extension_ops(model)


class BinaryMaskPaste(ModelTransform):
    """At inference, pastes each detection's mask into the image as booleans at the module's mask threshold.

    torchvision's masks thresholded, bit for bit, without its float image-size canvas per detection (gigabytes
    for a large photo with many detections). :meth:`~lit_amp_det.MaskRCNNModule.postprocess` then receives
    boolean masks; without this transform it receives torchvision's probabilities. A detector without a mask
    head, or with another transform than torchvision's, is left as it is.
    """

    name = "binary_mask_paste"

    def __call__(self, model: nn.Module) -> nn.Module:
        if not use_binary_mask_paste(
            model, 0.5
        ):  # MaskRCNNModule.forward sets evaluation.mask_threshold per call
            log.info(
                "speedups.binary_mask_paste: the detector has no mask head or not torchvision's "
                "transform (%s), "
                "so its masks are pasted as it pastes them",
                type(getattr(model, "transform", None)).__name__,
            )
        return model


class SyncFree(ModelTransform):
    """Computes the detector with shapes fixed by the configuration, so that a step never waits for the
    device.

    Padded proposal and detection slots with validity masks, matching and sampling without boolean indexing,
    losses as masked sums, batches padded to size buckets (:mod:`lit_amp_det.models.sync_free`): the training
    step makes no host synchronisation, inference reads the detection counts once per batch, and the model
    traces as one graph. On CUDA by default, where the host waiting is what costs; ``devices: [cpu, cuda]``
    runs it on a CPU too.

    The fixed-shape heads are lit_amp_det's heads (:class:`ExtensionOps`) with fixed shapes, so it needs
    ``speedups.ext_ops`` applied before it on the same devices, and says so rather than applying it
    silently. It returns a new detector (:func:`~lit_amp_det.models.sync_free.fixed_shape_detector`) made of
    the given one's modules.

    Args:
        devices: the device types it applies to (CUDA by default).
        instances_per_image: pad every training target to this many instances (a ``valid`` flag each), so
            that every step has the same shapes (what a CUDA graph replays). The detector carries it and the
            data module pads to it; ``None`` keeps each image's count.

    Raises:
        ValueError: (when called) the detector's heads are not lit_amp_det's: ``speedups.ext_ops`` is
            missing, off on this device, or listed after ``speedups.sync_free``.
    """

    name = "sync_free"
    default_devices = ("cuda",)

    def __init__(self, devices: Sequence[str] | None = None, instances_per_image: int | None = None) -> None:
        super().__init__(devices)
        self.instances_per_image = checked_instance_count(instances_per_image)

    def __call__(self, model: nn.Module) -> nn.Module:
        if not uses_extension_ops(model):
            raise ValueError(
                f"speedups.sync_free builds on lit_amp_det's heads, but this {type(model).__name__} has "
                f"{type(getattr(model, 'rpn', None)).__name__} and "
                f"{type(getattr(model, 'roi_heads', None)).__name__}: list speedups.ext_ops before it, on "
                f"the same devices ({'/'.join(self.devices)}), or set speedups.sync_free=null"
            )
        return fixed_shape_detector(model, self.instances_per_image)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(devices={list(self.devices)}, "
            f"instances_per_image={self.instances_per_image})"
        )


def _to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    images, *rest = args
    if isinstance(images, Tensor) and images.dim() == 4:
        images = images.contiguous(memory_format=torch.channels_last)
    return (images, *rest)


class ChannelsLast(ModelTransform):
    """The channels_last (NHWC) memory format for the 4-D weights and for the images the backbone receives.

    cuDNN's tensor-core convolutions and lit_amp_det's RoIAlign read NHWC without transposes, so under mixed
    precision on a GPU the backbone, FPN and heads skip the NCHW<->NHWC copies cuDNN otherwise makes around
    every convolution. torchvision's transform batches the images NCHW: a pre-hook on the backbone converts
    them, and the convolutions propagate the format through the FPN and the RoI heads.
    """

    name = "channels_last"

    def __call__(self, model: nn.Module) -> nn.Module:
        if not hasattr(model, "backbone"):
            raise TypeError(
                f"speedups.channels_last needs a detector with a .backbone, got {type(model).__name__}"
            )
        model.to(memory_format=torch.channels_last)
        model.backbone.register_forward_pre_hook(_to_channels_last)
        return model


class CompileBackbone(ModelTransform):
    """``torch.compile`` of the ResNet+FPN, or of the whole detector after :class:`SyncFree`, in place
    (``nn.Module.compile``: parameter names are unchanged).

    The backbone has static shapes (images are padded to ``size_divisible``), so it compiles once per input
    size; the RPN and RoI heads have data-dependent shapes (proposal counts) that would recompile or break the
    graph every step, so they stay eager, unless ``sync_free`` fixed them: then the training forward is one
    graph, and inference one graph before the read of the detection counts. ``options`` are
    ``torch.compile``'s keyword arguments.
    """

    name = "compile"

    def __init__(self, devices: Sequence[str] | None = None, **options: Any) -> None:
        super().__init__(devices)
        self.options = options

    def __call__(self, model: nn.Module) -> nn.Module:
        if not hasattr(model, "backbone"):
            raise TypeError(f"speedups.compile needs a detector with a .backbone, got {type(model).__name__}")
        (model if is_fixed_shape(model) else model.backbone).compile(**self.options)
        return model


def build_transforms(config: Mapping[str, Mapping[str, Any] | None] | None) -> list[ModelTransform]:
    """The transforms a ``speedups`` mapping names, in its order; entries set to ``null`` are off.

    Each value is a ``_target_`` mapping (``{"_target_": "lit_amp_det.models.speedups.ChannelsLast",
    "devices": ["cuda"]}``) naming a :class:`ModelTransform`.
    """
    if config is None:
        return []
    if not isinstance(config, Mapping):
        raise ArgumentError("speedups", config, "must be a mapping of names to _target_ mappings (or null)")
    transforms = []
    for key, entry in config.items():
        if entry is None:
            continue
        if not isinstance(entry, Mapping) or "_target_" not in entry:
            raise ArgumentError(
                f"speedups.{key}",
                entry,
                "must be a _target_ mapping naming a ModelTransform, or null to turn it off",
            )
        try:
            transform = instantiate(dict(entry))
        except (
            InstantiationException
        ) as err:  # Hydra wraps the constructor's own error: name the setting instead
            if isinstance(err.__cause__, ArgumentError):
                raise err.__cause__.at(f"speedups.{key}") from None
            raise
        if not isinstance(transform, ModelTransform):
            raise ArgumentError(
                f"speedups.{key}._target_",
                entry["_target_"],
                f"made a {type(transform).__name__}, not a lit_amp_det.models.speedups.ModelTransform",
            )
        transforms.append(transform)
    return transforms


def apply_transforms(
    model: nn.Module, transforms: Sequence[ModelTransform], device: torch.device | str
) -> tuple[nn.Module, list[str]]:
    """``model`` after each transform that applies to ``device``, in order, and the names of those applied."""
    applied = []
    for transform in transforms:
        if transform.applies_to(device):
            model = transform(model)
            applied.append(transform.name)
        else:
            log.info(
                "speedups.%s is for %s: not applied on %s",
                transform.name,
                "/".join(transform.devices),
                torch.device(device).type,
            )
    return model, applied
