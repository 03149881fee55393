"""Deployable graphs of a trained detector: ONNX (onnxruntime, TensorRT) and ``torch.export`` programs
(``.pt2``).

torchvision's detector returns lists whose lengths depend on the image, which ``torch.export`` cannot trace (a
data-dependent guard) and ONNX can only hold with ``If``/``Loop`` nodes. The exported graph is the
:mod:`fixed-shape computation <lit_amp_det.models.sync_free>` of the same weights instead:
``detections_per_img`` slots per image and each image's count, every shape fixed by the input's. So the batch
size and the image size are fixed at export (``export.batch_size``, ``export.image_size``); a picture of
another size is resized or padded to it by the caller. Resizing to the model's size and normalisation happen
inside the graph.

The ``.pt2`` program calls the package's own ops: ``import lit_amp_det.ops`` before ``torch.export.load``. The
ONNX graph has standard ops only (:mod:`lit_amp_det.ops.onnx`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "FORMATS",
    "OUTPUTS",
    "DeployedDetector",
    "deployed_detector",
    "export_detector",
    "supported_format",
]

FORMATS = ("onnx", "pt2")

#: the graph's outputs, in order, and what they hold
OUTPUTS = {
    "boxes": "float32 [B, D, 4]: x1, y1, x2, y2 in input pixels",
    "scores": "float32 [B, D]: class scores, decreasing within an image",
    "labels": "int64 [B, D]: class index, 1..num_classes-1 (classes[label - 1] names it)",
    "masks": "bool [B, D, H, W]: each detection's mask at the input's size (Mask R-CNN only)",
    "count": "int64 [B]: detections in each image; slots from count[b] on are padding",
}


class DeployedDetector(nn.Module):
    """``images [B, 3, H, W]`` (uint8 RGB, or float in [0, 1]) -> :data:`OUTPUTS` as a tuple, every shape
    fixed.
    """

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector.eval()
        self.names = [name for name in OUTPUTS if name != "masks" or detector.roi_heads.has_mask()]

    def forward(self, images: Tensor) -> tuple[Tensor, ...]:
        if images.dtype == torch.uint8:
            images = images.float() / 255
        detections = self.detector.forward_padded(list(images.unbind(0)))
        stacked = {name: torch.stack([d[name] for d in detections]) for name in self.names}
        if "masks" in stacked:
            stacked["masks"] = stacked["masks"][:, :, 0]
        return tuple(stacked[name] for name in self.names)


def deployed_detector(module: Any) -> DeployedDetector:
    """The fixed-shape graph of ``module``'s detector (a fresh copy with its weights; ``module`` is not
    changed).
    """
    from lit_amp_det.models.sync_free import fixed_shape_detector

    hparams, saved = module.hparams, {key: module.hparams.get(key) for key in ("weights", "backbone")}
    hparams["weights"] = None  # the module's tensors replace every weight: nothing named is read
    if isinstance(saved["backbone"], dict):
        hparams["backbone"] = {**saved["backbone"], "weights": None}
    try:
        detector = module.build_model()
    finally:
        hparams.update(saved)
    detector.load_state_dict(module.model.state_dict())
    try:
        detector = fixed_shape_detector(detector.to(module.device))
    except TypeError:
        raise TypeError(
            f"export writes the fixed-shape computation of torchvision's FasterRCNN or MaskRCNN; "
            f"{type(module).__name__}.build_model() made a {type(detector).__qualname__}"
        ) from None
    detector.transform.mask_threshold = float(module.evaluation_settings.mask_threshold)
    return DeployedDetector(detector).eval()


def supported_format(fmt: str) -> str:
    """``fmt`` if it is one of :data:`FORMATS`, else a ``ValueError`` that names the choices."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def export_detector(
    module: Any,
    path: str | Path | None,
    fmt: str = "onnx",
    image_size: Sequence[int] | None = None,
    batch_size: int = 1,
    sample: Tensor | None = None,
    **exporter_args: Any,
) -> Any:
    """``module``'s detector as ``fmt``: an ``ONNXProgram`` (``onnx``) or an ``ExportedProgram`` (``pt2``).
    With a ``path``, also writes it there and its description to ``path`` with ``.json`` (input,
    normalisation, classes, thresholds, outputs).

    ``image_size`` ``(H, W)``: the input's size; ``None``: the model's inference size (short x long side).
    ``sample``: an input to trace instead of zeros of that size (its dtype and shape are the graph's).
    ``exporter_args`` go to ``torch.onnx.export`` (``onnx``) or ``torch.export.export`` (``pt2``).
    """
    fmt = supported_format(fmt)
    graph = deployed_detector(module)
    transform = graph.detector.transform
    if sample is None:
        size = list(image_size) if image_size is not None else [transform.min_size[-1], transform.max_size]
        if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
            raise ValueError(f"export.image_size={size}: give [height, width], two positive integers")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"export.batch_size={batch_size!r}: give a positive integer")
        sample = torch.zeros((batch_size, 3, *size), dtype=torch.uint8, device=module.device)
    with torch.no_grad():
        if fmt == "pt2":
            program = torch.export.export(graph, (sample,), **{"strict": False, **exporter_args})
        else:
            program = _onnx_program(graph, sample, exporter_args)
    if path is None:
        return program
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pt2":
        torch.export.save(program, str(path))
    else:
        program.save(str(path))
    hparams = module.hparams
    names, ids = list(hparams.get("class_names") or []), list(hparams.get("category_ids") or [])
    description = {
        "format": fmt,
        "file": path.name,
        "input": {
            "name": "images",
            "shape": list(sample.shape),
            "dtype": str(sample.dtype).removeprefix("torch."),
            "layout": "RGB, channels first" + (", 0..255" if sample.dtype == torch.uint8 else ", 0..1"),
            "inside_the_graph": {
                "resize": {"min_size": list(transform.min_size), "max_size": transform.max_size},
                "normalise": {"mean": transform.image_mean, "std": transform.image_std},
            },
        },
        "outputs": {name: OUTPUTS[name] for name in graph.names},
        "classes": [
            {
                "label": i + 1,
                "name": names[i] if i < len(names) else None,
                "category_id": ids[i] if i < len(ids) else i + 1,
            }
            for i in range(int(hparams.num_classes) - 1)
        ],
        "score_threshold": graph.detector.roi_heads.score_thresh,
        "mask_threshold": transform.mask_threshold,
        "detections_per_image": graph.detector.roi_heads.detections_per_img,
        "load": (
            "import lit_amp_det.ops; torch.export.load(file).module()(images)"
            if fmt == "pt2"
            else "onnxruntime.InferenceSession(file).run(None, {'images': images})"
        ),
        "torch": torch.__version__,
    }
    path.with_suffix(".json").write_text(json.dumps(description, indent=2) + "\n")
    return program


def _onnx_program(graph: DeployedDetector, sample: Tensor, exporter_args: dict[str, Any]) -> Any:
    try:
        # the exporter's dependency, named here so that its absence is one clear line
        import onnxscript  # noqa: F401
    except ImportError:
        raise ImportError(
            "format=onnx needs onnx and onnxscript: pip install 'lit_amp_det[export]' (or use format=pt2)"
        ) from None
    from lit_amp_det.ops.onnx import translation_table

    settings = {
        "input_names": ["images"],
        "output_names": graph.names,
        "optimize": True,
        "verbose": False,
        **exporter_args,
        "dynamo": True,
        "custom_translation_table": translation_table(),
    }
    return torch.onnx.export(graph, (sample,), **settings)
