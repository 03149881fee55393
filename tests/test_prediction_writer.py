"""CocoPredictionWriter: the records it writes for a batch of detections."""

from __future__ import annotations

import numpy as np
import pycocotools.mask as mask_utils
import torch

from lit_amp_det.callbacks.prediction_writer import CocoPredictionWriter


def _detections(n: int, size=(20, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 10
    masks = torch.rand(n, *size, generator=g) > 0.5
    return {
        "image_id": 7,
        "boxes": torch.cat([xy, xy + 5], dim=1),
        "scores": torch.linspace(0.9, 0.0, n),
        "labels": torch.arange(n) % 3 + 1,
        "category_ids": torch.arange(n) % 3 + 11,
        "masks": masks,
    }


def test_records_keep_each_detections_own_score_box_category_and_mask(tmp_path):
    det = _detections(40)
    writer = CocoPredictionWriter(tmp_path, score_threshold=0.3)
    writer.write_on_batch_end(None, None, [det, _detections(0)], None, None, 0, 0)
    keep = det["scores"] >= 0.3
    assert len(writer._records) == int(keep.sum()) > 20
    for record, box, score, category, mask in zip(
        writer._records,
        det["boxes"][keep],
        det["scores"][keep],
        det["category_ids"][keep],
        det["masks"][keep],
    ):
        x1, y1, x2, y2 = box.tolist()
        assert record["image_id"] == 7 and record["category_id"] == int(category)
        assert record["score"] == float(score)
        np.testing.assert_allclose(record["bbox"], [x1, y1, x2 - x1, y2 - y1])
        rle = {"size": record["segmentation"]["size"], "counts": record["segmentation"]["counts"].encode()}
        assert np.array_equal(mask_utils.decode(rle), mask.numpy().astype(np.uint8))


def test_boxes_only_detections_have_no_segmentation(tmp_path):
    det = {k: v for k, v in _detections(5).items() if k != "masks"}
    writer = CocoPredictionWriter(tmp_path)
    writer.write_on_batch_end(None, None, [det], None, None, 0, 0)
    assert len(writer._records) == 5 and all("segmentation" not in r for r in writer._records)


def test_the_images_index_names_the_categories_the_records_carry():
    """``predictions_images.json``'s categories: the dataset's category ids where the model has them, else the
    labels 1..K, with the class names.
    """
    from types import SimpleNamespace

    from lit_amp_det.callbacks.prediction_writer import _categories

    names = ["cat", "dog"]
    with_ids = SimpleNamespace(class_names=names, hparams={"category_ids": [17, 18]})
    assert _categories(with_ids) == [{"id": 17, "name": "cat"}, {"id": 18, "name": "dog"}]
    labels_only = SimpleNamespace(class_names=names, hparams={"category_ids": None})
    assert _categories(labels_only) == [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]


def test_the_images_index_leaves_out_torchvision_s_unused_coco_ids():
    """torchvision's COCO weights name 91 labels, the 10 ids COCO never uses ``N/A``: the index lists COCO's
    80.
    """
    from types import SimpleNamespace

    from lit_amp_det.app.model_classes import weights_classes
    from lit_amp_det.callbacks.prediction_writer import _categories

    classes = weights_classes("COCO_V1", mask=True)
    model = SimpleNamespace(class_names=classes["class_names"], hparams=classes)
    categories = _categories(model)
    assert len(categories) == 80 and all(c["name"] != "N/A" for c in categories)
    assert categories[0] == {"id": 1, "name": "person"} and {"id": 13, "name": "stop sign"} in categories
    assert 12 not in {c["id"] for c in categories} and categories[-1] == {"id": 90, "name": "toothbrush"}
