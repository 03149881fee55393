"""Typed settings of the detector, the optimizer and the precision plugin: the one home of each default.

The YAML files in ``conf/`` are what users read and override (``model.rpn.nms_thresh=0.6``); the dataclasses
here type and document the same keys. :func:`register_schemas` stores them in Hydra's ``ConfigStore`` under
``schema/``; ``conf/model/maskrcnn_light.yaml``, ``conf/precision/default.yaml`` and ``conf/optim/*.yaml``
start from them in their defaults list, so composing a config refuses an unknown key or a value of the wrong
type before anything is built, and a key the YAML leaves out takes the dataclass default. Python callers
(:class:`~lit_amp_det.MaskRCNNModule`, :func:`~lit_amp_det.precision.build_precision_plugin`) take the same
defaults from here, and ``tests/test_config.py`` checks that the default YAML lists exactly these values.

:data:`RENAMED_SETTINGS` lists the settings given clearer names, so that their old names are refused naming
the new ones. This module imports neither torch nor Lightning: the command line registers the schemas before
it composes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_amp_det.errors import ArgumentError

__all__ = [
    "DEFAULT_OPTIMIZER",
    "DEFAULT_SCHEDULER",
    "BackboneSettings",
    "DetectorSettings",
    "OptimSettings",
    "RENAMED_SETTINGS",
    "PrecisionSettings",
    "RPNSettings",
    "RoIHeadsSettings",
    "TransformSettings",
    "model_defaults",
    "plain_settings",
    "register_schemas",
    "typed_settings",
]

# OmegaConf reads these annotations at runtime and does not take ``X | None`` there: ``Optional[X]`` stays.
# ruff: noqa: UP045

#: Settings given clearer names: old dotted key -> new one. The command line
#: (:mod:`lit_amp_det.app.overrides`) and :func:`lit_amp_det.app.config.check_config` (an experiment file
#: written for the old name) refuse the old key, naming the new; a run saved under the old name is compared
#: under the new one when ``ckpt_path=last`` looks for it (:mod:`lit_amp_det.app.runs`).
RENAMED_SETTINGS: dict[str, str] = {
    "data.seed": "data.sampler_seed",
    "data.data_seed": "data.generation_seed",
}

#: The optimizer a module gets when ``optim`` names none: ``conf/optim/adamw.yaml``, the config's default.
DEFAULT_OPTIMIZER: dict[str, Any] = {
    "_target_": "torch.optim.AdamW",
    "lr": 1.0e-3,
    "betas": [0.9, 0.999],
    "weight_decay": 0.05,
    "fused": "auto",
}
#: The schedule a module gets when ``optim`` names none: ``conf/optim/adamw.yaml``'s.
DEFAULT_SCHEDULER: dict[str, Any] = {
    "_target_": "lit_amp_det.optim.warmup_schedule",
    "warmup_steps": 0.05,
    "warmup_factor": 0.001,
    "policy": "cosine",
    "min_lr_ratio": 0.01,
}


@dataclass
class OptimSettings:
    """How the module is optimised (``optim``, ``conf/optim``).

    Attributes:
        optimizer: a ``_target_`` mapping of a ``torch.optim`` optimizer and its keywords (``fused: auto``
            picks the fused kernel where there is one); the default is ``conf/optim/adamw.yaml``'s.
        scheduler: a ``_target_`` mapping called with ``optimizer=`` and ``total_steps=``; ``None``: a
            constant lr.
        reference_batch: the global batch ``optimizer.lr`` is given for (the lr is scaled linearly to the
            run's); ``None``: the lr is used as it is.
    """

    optimizer: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DEFAULT_OPTIMIZER))
    scheduler: Optional[dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(DEFAULT_SCHEDULER))
    reference_batch: Optional[int] = None


@dataclass
class BackboneSettings:
    """The ResNet trunk and its FPN (``model.backbone``): the keywords of
    :func:`~lit_amp_det.models.maskrcnn.build_backbone`.

    Attributes:
        name: the trunk, a key of :data:`~lit_amp_det.models.maskrcnn.BACKBONES` (``resnet10`` ...
            ``resnet101``).
        fpn_channels: channels of every FPN output.
        trainable_layers: stages, counted from the top (layer4 ... conv1), that get gradients; 5 trains all.
        norm: ``bn`` or ``frozen_bn`` (buffers only).
        returned_layers: the ResNet stages (1..4) that feed the FPN.
        weights: ImageNet weights of the trunk by torchvision's name (``IMAGENET1K_V1``, ``DEFAULT``);
            ``None``: random initialisation.
    """

    name: str = "resnet18"
    fpn_channels: int = 64
    trainable_layers: int = 5
    norm: str = "bn"
    returned_layers: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    weights: Optional[str] = None


@dataclass
class TransformSettings:
    """How images are resized and normalised before the backbone (``model.transform``).

    Attributes:
        min_size, max_size: the shorter side is scaled to ``min_size`` unless the longer one would pass
            ``max_size``; ``min_size`` may list several sizes, of which training picks one per batch at random
            (multi-scale training; inference takes the last).
        image_mean, image_std: per-channel normalisation; ``None``: ImageNet's.
        size_divisible: the batch is padded to a multiple of this.
    """

    # an int or a list of ints: OmegaConf types no union with a list, so the value is checked where it is read
    min_size: Any = 224
    max_size: int = 224
    image_mean: Optional[list[float]] = None
    image_std: Optional[list[float]] = None
    size_divisible: int = 32


@dataclass
class RPNSettings:
    """The region proposal network (``model.rpn``).

    Attributes:
        anchor_sizes: one anchor size per FPN level (the returned stages plus the max-pool level).
        aspect_ratios: height/width ratios of the anchors, the same on every level.
        pre_nms_top_n_train, post_nms_top_n_train, pre_nms_top_n_test, post_nms_top_n_test: proposals kept
            per image before and after NMS, in training and at inference.
        nms_thresh: IoU above which NMS drops the lower-scored proposal.
        fg_iou_thresh, bg_iou_thresh: IoU with a ground-truth box above which an anchor is a positive, below
            which a negative.
        batch_size_per_image, positive_fraction: anchors sampled per image for the loss, and the share of
            positives among them.
        score_thresh: proposals scoring below this are dropped.
    """

    anchor_sizes: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    aspect_ratios: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    pre_nms_top_n_train: int = 600
    post_nms_top_n_train: int = 300
    pre_nms_top_n_test: int = 300
    post_nms_top_n_test: int = 150
    nms_thresh: float = 0.7
    fg_iou_thresh: float = 0.7
    bg_iou_thresh: float = 0.3
    batch_size_per_image: int = 128
    positive_fraction: float = 0.5
    score_thresh: float = 0.0


@dataclass
class RoIHeadsSettings:
    """The box and mask heads (``model.roi_heads``).

    Attributes:
        box_head_width: width of the two-layer box head.
        mask_head_layers: channels of each mask-head convolution.
        sampling_ratio: RoIAlign's sampling points per bin side.
        fg_iou_thresh, bg_iou_thresh: IoU with a ground-truth box above which a proposal is a positive, below
            which a negative.
        batch_size_per_image, positive_fraction: proposals sampled per image for the loss, and the share of
            positives among them.
        score_thresh, nms_thresh, detections_per_img: inference: the lowest score kept, the IoU of the
            per-class NMS and the detections kept per image.
        bbox_reg_weights: the box coder's ``(wx, wy, ww, wh)``; ``None``: torchvision's ``(10, 10, 5, 5)``.
    """

    box_head_width: int = 256
    mask_head_layers: list[int] = field(default_factory=lambda: [64, 64])
    sampling_ratio: int = 2
    fg_iou_thresh: float = 0.5
    bg_iou_thresh: float = 0.5
    batch_size_per_image: int = 64
    positive_fraction: float = 0.25
    score_thresh: float = 0.05
    nms_thresh: float = 0.5
    detections_per_img: int = 50
    bbox_reg_weights: Optional[list[float]] = None


@dataclass
class PrecisionSettings:
    """The ``precision`` config node: what configures the plugin that ``trainer.precision`` names.

    Attributes:
        fp32_regions: method paths of the LightningModule mapped to ``fp32`` or ``fp32_outputs``; ``None``
            takes the module's ``fp32_regions()``, ``{}`` is plain autocast.
        init_scale, growth_interval: GradScaler's first loss scale and the overflow-free steps before it
            doubles (fp16 precisions only); torch's defaults.
        fp16_on_cpu: ``16-mixed`` / ``16-weights`` run in fp16 on a CPU too, instead of their bf16 variant.
        max_consecutive_skips: the non-finite step guard stops a fit after this many skipped steps in a row.
        skip_check_every_n_steps: how often, in optimizer steps, the guard reads its counts on the host.
    """

    # a dict or None: Hydra's command-line dict override (``precision.fp32_regions={}``) of a typed dict node
    # that holds None is lost or fails in hydra-core 1.3, so the value is checked where it is read
    fp32_regions: Any = None
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    fp16_on_cpu: bool = False
    max_consecutive_skips: int = 20
    skip_check_every_n_steps: int = 50


#: The model's nested settings by their argument name, as ``MaskRCNNModule`` and ``model.*`` name them.
_MODEL_SCHEMAS = {
    "backbone": BackboneSettings,
    "transform": TransformSettings,
    "rpn": RPNSettings,
    "roi_heads": RoIHeadsSettings,
}

Settings = TypeVar("Settings")


@dataclass(frozen=True)
class DetectorSettings:
    """What :func:`~lit_amp_det.models.maskrcnn.build_detector` builds besides the class count and weights.

    Attributes:
        backbone, transform, rpn, roi_heads: the typed nested settings of the model.
    """

    backbone: BackboneSettings = field(default_factory=BackboneSettings)
    transform: TransformSettings = field(default_factory=TransformSettings)
    rpn: RPNSettings = field(default_factory=RPNSettings)
    roi_heads: RoIHeadsSettings = field(default_factory=RoIHeadsSettings)

    @classmethod
    def of(cls, **given: Mapping[str, Any] | Any | None) -> DetectorSettings:
        """The settings from the module's arguments: each a dataclass, a mapping of some fields, or ``None``.

        Args:
            **given: ``backbone``, ``transform``, ``rpn`` and ``roi_heads``, as
                :class:`~lit_amp_det.MaskRCNNModule` takes them.

        Returns:
            The typed settings, every key left out at its default.

        Raises:
            ArgumentError: an unknown key, named with its argument (``rpn.nms_threshold``).
        """
        return cls(
            **{name: typed_settings(_MODEL_SCHEMAS[name], name, value) for name, value in given.items()}
        )

    def build_kwargs(self) -> dict[str, dict[str, Any]]:
        """The keyword arguments of ``build_detector``: each setting as a plain dict."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


def typed_settings(
    kind: type[Settings], argument: str, given: Mapping[str, Any] | Settings | None
) -> Settings:
    """``given`` as a ``kind`` dataclass: keys it leaves out take their defaults.

    Args:
        kind: one of the settings dataclasses of this module.
        argument: the argument's name (``rpn``), which an error names.
        given: an instance of ``kind`` (returned as it is), a mapping of some of its fields (a ``dict`` or an
            OmegaConf ``DictConfig``), or ``None`` for every default.

    Returns:
        The settings, a ``kind`` instance.

    Raises:
        ArgumentError: a key that is not a field of ``kind``; the message names it and lists the fields.
    """
    if isinstance(given, kind):
        return given
    values = dict(plain_settings(given) or {})
    known = [f.name for f in dataclasses.fields(kind)]  # type: ignore[arg-type]
    for key, value in values.items():
        if key not in known:
            raise ArgumentError(
                f"{argument}.{key}", value, f"is not a known {_label(argument)}; known: {known}"
            )
    return kind(**values)


def _label(argument: str) -> str:
    """How an error calls a setting of ``argument``: ``RPN setting``, ``RoI-head setting``, ..."""
    return {"rpn": "RPN setting", "roi_heads": "RoI-head setting"}.get(argument, f"{argument} setting")


def plain_settings(value: Any) -> Any:
    """``value`` as plain data: a settings dataclass or an OmegaConf node becomes builtin dicts and lists, so
    that hyper-parameters are saved in checkpoints that load with ``weights_only=True``.

    Args:
        value: anything a module argument may be.

    Returns:
        ``value`` with dataclasses and OmegaConf containers converted; anything else as it is.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def model_defaults() -> dict[str, Any]:
    """Every default of the model's typed settings by its dotted config key (``model.rpn.nms_thresh``).

    A run saved before a key was typed here did not list it and ran with this same default (the values of
    keys the YAML leaves out are torchvision's, as ``build_detector`` has them), so comparing a saved run's
    settings fills them in from here.

    Returns:
        ``{"model.<argument>.<field>": default}`` for the four nested settings.
    """
    defaults = DetectorSettings().build_kwargs()
    return {
        f"model.{argument}.{key}": value
        for argument, values in defaults.items()
        for key, value in values.items()
    }


def register_schemas() -> None:
    """Stores the settings dataclasses in Hydra's ``ConfigStore``: ``schema/model/<argument>`` for the model's
    nested settings, ``schema/precision`` and ``schema/optim`` for those nodes, which the YAML defaults lists
    name.
    """
    from hydra.core.config_store import ConfigStore  # deferred: plain Python callers never need Hydra

    store = ConfigStore.instance()
    for argument, kind in _MODEL_SCHEMAS.items():
        store.store(group="schema/model", name=argument, node=kind)
    store.store(group="schema", name="precision", node=PrecisionSettings)
    # typed but empty: each conf/optim option names its own optimizer (a merge would add AdamW's keys to SGD)
    store.store(group="schema", name="optim", node=OptimSettings(optimizer={}, scheduler=None))
