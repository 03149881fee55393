"""model.evaluation.backend: faster-coco-eval and pycocotools give the same COCO metrics; bad or missing
backends fail early with the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from conftest import CONFIG_ERRORS, compose_config
from lit_amp_det import MaskRCNNModule
from lit_amp_det.app.config import config_groups
from lit_amp_det.app.tasks import build_model
from lit_amp_det.errors import ArgumentError
from lit_amp_det.module import EVAL_BACKENDS, check_eval_backend
from lit_amp_det.module_settings import check_evaluation

SIZE = 128  # large enough for COCO's small (< 32^2), medium and large (> 96^2) objects


def _module(tmp_path: Path, backend: str) -> MaskRCNNModule:
    cfg = compose_config(["experiment=smoke", f"model.evaluation.backend={backend}"], tmp_path)
    return instantiate(cfg.model, num_classes=4)


def _ellipse(box: torch.Tensor) -> torch.Tensor:
    """Boolean ``[SIZE, SIZE]`` ellipse inscribed in ``box`` (x0, y0, x1, y1): masks that differ from their
    boxes.
    """
    ys, xs = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    cx, cy, rx, ry = (
        (box[0] + box[2]) / 2,
        (box[1] + box[3]) / 2,
        (box[2] - box[0]) / 2,
        (box[3] - box[1]) / 2,
    )
    return ((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1


def _fixed_set() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Seeded predictions and targets for 6 images: a small, a medium and a large object each (one crowd), and
    jittered detections with random scores, one wrong label and one false positive per image.
    """
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([[20.0, 16.0], [60.0, 44.0], [124.0, 116.0]])  # ellipse areas 251, 2073, 11298
    preds, targets = [], []
    for image in range(6):
        corner = torch.rand(3, 2, generator=gen) * (SIZE - sizes)
        boxes = torch.cat([corner, corner + sizes], dim=1)
        labels = torch.randint(1, 4, (3,), generator=gen)
        masks = torch.stack([_ellipse(b) for b in boxes])
        targets.append(
            {
                "boxes": boxes,
                "labels": labels,
                "masks": masks,
                "iscrowd": torch.tensor([0, 0, int(image == 2)]),
                "area": masks.sum((1, 2)).float(),
            }
        )
        jitter = (torch.rand(3, 4, generator=gen) - 0.5) * sizes.repeat(1, 2) * 0.4
        false_positive = torch.tensor([[5.0, 90.0, 40.0, 120.0]])
        det_boxes = torch.cat([(boxes + jitter).clamp(0, SIZE - 1), false_positive])
        det_labels = torch.cat([labels, torch.tensor([1])])
        det_labels[image % 3] = det_labels[image % 3] % 3 + 1  # one detection per image with the wrong class
        preds.append(
            {
                "boxes": det_boxes,
                "labels": det_labels,
                "scores": torch.rand(4, generator=gen),
                "masks": torch.stack([_ellipse(b) for b in det_boxes]),
            }
        )
    return preds, targets


def _count_evaluations(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts ``COCOeval.evaluate`` calls of each library (one per IoU type and ``compute()``)."""
    from faster_coco_eval import COCOeval_faster
    from pycocotools.cocoeval import COCOeval

    calls = dict.fromkeys(EVAL_BACKENDS, 0)
    for backend, cls in (("faster_coco_eval", COCOeval_faster), ("pycocotools", COCOeval)):

        def evaluate(self, _original=cls.evaluate, _backend=backend):
            calls[_backend] += 1
            return _original(self)

        monkeypatch.setattr(cls, "evaluate", evaluate)
    return calls


def test_backends_agree_on_every_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preds, targets = _fixed_set()
    calls = _count_evaluations(monkeypatch)
    results = {}
    for backend in EVAL_BACKENDS:
        metric = _module(tmp_path, backend).build_metric()
        metric.update(preds[:3], targets[:3])  # two updates, as validation batches arrive
        metric.update(preds[3:], targets[3:])
        results[backend] = metric.compute()
        assert calls[backend] == 2, (backend, calls)  # bbox and segm, each scored by the chosen library
    fast, reference = results["faster_coco_eval"], results["pycocotools"]
    assert fast.keys() == reference.keys()
    for kind in ("bbox", "segm"):  # every area range is populated: no key compares -1 with -1
        for key in (
            "map",
            "map_50",
            "map_75",
            "map_small",
            "map_medium",
            "map_large",
            "mar_100",
            "mar_large",
        ):
            assert 0.0 < float(reference[f"{kind}_{key}"]) < 1.0, (kind, key)
    assert float(reference["bbox_map"]) != pytest.approx(float(reference["segm_map"]), abs=1e-3)
    for key, value in reference.items():
        torch.testing.assert_close(fast[key], value, atol=1e-4, rtol=0, check_dtype=False, msg=key)


def test_default_backend_follows_the_measured_image_sizes(tmp_path: Path) -> None:
    """faster_coco_eval for small-image configs, pycocotools at COCO sizes: the faster library at each."""
    expected = {option: "faster_coco_eval" for option in config_groups()["model"]} | {
        "maskrcnn_r50_fpn": "pycocotools"
    }
    for option, backend in expected.items():
        assert compose_config([f"model={option}"], tmp_path).model.evaluation.backend == backend, option
    assert MaskRCNNModule.__init__.__kwdefaults__["evaluation"] is None  # the defaults below
    assert check_evaluation(None).backend == "faster_coco_eval"
    assert check_evaluation({"mask_threshold": 0.3}).backend == "faster_coco_eval"


def test_bad_backend_names_the_argument_and_the_choices(tmp_path: Path) -> None:
    choices = r"='cocoapi'.*faster_coco_eval, pycocotools"
    with pytest.raises(ArgumentError, match=rf"^evaluation\.backend{choices}"):
        check_eval_backend("cocoapi")
    cfg = compose_config(["experiment=smoke", "model.evaluation.backend=cocoapi"], tmp_path)
    with pytest.raises(
        ArgumentError, match=rf"^model\.evaluation\.backend{choices}"
    ):  # as the CLI reports it
        build_model(cfg, SimpleNamespace(num_classes=4))


@pytest.mark.parametrize(
    ("backend", "package", "other"),
    [
        ("faster_coco_eval", "faster-coco-eval", "pycocotools"),
        ("pycocotools", "pycocotools", "faster_coco_eval"),
    ],
)
def test_missing_package_says_how_to_install_or_switch(
    backend: str, package: str, other: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, backend, None)  # the import fails as if the package were not installed
    fix = rf"pip install {package}.*model\.evaluation\.backend={other}"
    with pytest.raises(ModuleNotFoundError, match=fix):
        check_eval_backend(backend)
    with pytest.raises(CONFIG_ERRORS + (ModuleNotFoundError,), match=fix):
        _module(tmp_path, backend)
