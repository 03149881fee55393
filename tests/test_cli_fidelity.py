"""The command line on the images users actually have: elongated, tiny and border-touching, on the default
model.

A small COCO-format dataset is written to disk (PNG images of 200x1000, 1000x150, 12x9 and 40x40 pixels with
polygon annotations, boxes touching the image border included) and goes through ``fit``, ``validate`` and
``predict`` with the default ``maskrcnn_light`` model and its default precision: each must exit 0 and write
its outputs. Only the schedule is shortened (one epoch of three steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw
from pycocotools.coco import COCO

from conftest import run_cli

#: (file name, width, height, annotations as (category id, polygon [x1, y1, x2, y2, ...]))
IMAGES = [
    (
        "tall.png",
        200,
        1000,
        [(1, [40, 100, 150, 100, 150, 400, 40, 400]), (2, [0, 880, 90, 880, 90, 1000, 0, 1000])],
    ),  # touches the left and bottom border
    (
        "wide.png",
        1000,
        150,
        [(2, [100, 20, 300, 20, 200, 130]), (1, [880, 0, 1000, 0, 1000, 150, 880, 150])],
    ),  # touches the top, right and bottom
    ("tiny.png", 12, 9, [(1, [0, 0, 12, 0, 12, 9, 0, 9])]),  # the whole image
    ("square.png", 40, 40, [(2, [10, 10, 30, 12, 20, 35])]),
]


def _polygon_bbox(polygon: list[int]) -> list[float]:
    xs, ys = polygon[0::2], polygon[1::2]
    return [float(min(xs)), float(min(ys)), float(max(xs) - min(xs)), float(max(ys) - min(ys))]


def _write_dataset(root: Path) -> Path:
    """Writes ``root/images/*.png`` and ``root/instances.json``; returns the annotation file."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    images, annotations = [], []
    for image_id, (name, width, height, objects) in enumerate(IMAGES, start=1):
        picture = Image.fromarray(rng.integers(0, 80, (height, width, 3), dtype=np.uint8), "RGB")
        draw = ImageDraw.Draw(picture)
        for category, polygon in objects:
            draw.polygon(polygon, fill=(200, 60, 60) if category == 1 else (60, 60, 200))
            bbox = _polygon_bbox(polygon)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category,
                    "bbox": bbox,
                    "area": bbox[2] * bbox[3],
                    "iscrowd": 0,
                    "segmentation": [polygon],
                }
            )
        picture.save(root / "images" / name)
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
    categories = [{"id": 1, "name": "red"}, {"id": 2, "name": "blue"}]
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return path


def _data_overrides(root: Path) -> list[str]:
    return [
        "data=coco",
        f"data.root={root}",
        "data.train_images=images",
        "data.train_annotations=instances.json",
        "data.val_images=images",
        "data.val_annotations=instances.json",
        "data.num_workers=0",
    ]


#: The default model and precision; only the schedule is short.
SHORT = ["trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1", "trainer.enable_progress_bar=false"]


def _run(command: str, run_dir: Path, *overrides: str, cwd: Path) -> dict:
    run_cli([command, *overrides, f"hydra.run.dir={run_dir}"], cwd=cwd)
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow
def test_fit_validate_predict_on_elongated_and_tiny_images(tmp_path: Path) -> None:
    annotations = _write_dataset(tmp_path / "data")
    data = _data_overrides(tmp_path / "data")

    fitted = _run("fit", tmp_path / "fit", *data, *SHORT, cwd=tmp_path)
    assert (
        fitted["command"] == "fit" and fitted["global_step"] == 3
    )  # batches of 2 per aspect group: [tall], [wide, tiny, square]
    assert 0.0 <= fitted["metrics"]["val/segm_mAP"] <= 1.0
    checkpoint = tmp_path / "fit" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()

    validated = _run("validate", tmp_path / "validate", *data, f"ckpt_path={checkpoint}", cwd=tmp_path)
    assert validated["command"] == "validate"
    assert validated["metrics"]["val/bbox_mAP"] == pytest.approx(fitted["metrics"]["val/bbox_mAP"], abs=1e-6)

    _run(
        "predict",
        tmp_path / "predict",
        *data,
        f"ckpt_path={checkpoint}",
        "callbacks.prediction_writer.score_threshold=0.0",
        cwd=tmp_path,
    )
    predictions = tmp_path / "predict" / "predictions.json"
    records = json.loads(predictions.read_text())
    ground_truth = COCO(str(annotations))
    assert records and {"image_id", "category_id", "bbox", "score", "segmentation"} <= records[0].keys()
    assert {r["image_id"] for r in records} <= set(ground_truth.getImgIds())
    assert {r["category_id"] for r in records} <= {1, 2}
    ground_truth.loadRes(str(predictions))  # the official loader accepts the file
