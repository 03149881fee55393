"""Tests for `lit_amp_det.data.coco` and `lit_amp_det.data.transforms` on tiny COCO folders built in
tmp_path.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from lit_amp_det.data import coco as coco_module
from lit_amp_det.data.coco import CocoInstances, drop_crowd
from lit_amp_det.data.transforms import Compose, RandomHorizontalFlip, ToFloat, collate_detection

H, W = 30, 40  # images 1 and 2; image 3 is 20 wide x 50 high


# ---------------------------------------------------------------------- fixture data


def _rect_mask(y0: int, y1: int, x0: int, x1: int, h: int = H, w: int = W) -> np.ndarray:
    m = np.zeros((h, w), dtype=np.uint8)
    m[y0:y1, x0:x1] = 1
    return m


def _uncompressed_rle(mask: np.ndarray) -> dict[str, Any]:
    """Column-major run lengths starting with a background run, as in COCO crowd annotations."""
    flat = mask.flatten(order="F")
    edges = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate(([0], edges, [flat.size]))).tolist()
    if flat[0] == 1:
        runs = [0, *runs]
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": runs}


def _compressed_rle(mask: np.ndarray) -> dict[str, Any]:
    rle = mask_utils.encode(np.asfortranarray(mask))
    return {"size": rle["size"], "counts": rle["counts"].decode("ascii")}


# ann 10: polygon rectangle -> rows 4..11, cols 5..14 (pycocotools rasterisation of [5,15) x [4,12))
MASK_10 = _rect_mask(4, 12, 5, 15)
# ann 11: uncompressed RLE in the bottom-right corner; its bbox extends past the image
MASK_11 = _rect_mask(20, 30, 30, 40)
# ann 12: compressed RLE, irregular shape
MASK_12 = _rect_mask(2, 5, 3, 9)
MASK_12[10, 20] = 1
# ann 13: crowd, uncompressed RLE touching the top-left pixel column
MASK_13 = _rect_mask(15, 25, 0, 10)
# ann 14: two-part polygon
MASK_14 = _rect_mask(2, 6, 25, 30) | _rect_mask(20, 24, 32, 36)

IMAGE_1 = (np.arange(H * W * 3, dtype=np.int64) % 251).astype(np.uint8).reshape(H, W, 3)
IMAGE_2 = (np.arange(H * W, dtype=np.int64) % 199).astype(np.uint8).reshape(H, W)
IMAGE_3 = (np.arange(50 * 20 * 4, dtype=np.int64) % 241).astype(np.uint8).reshape(50, 20, 4)


def _coco_dict() -> dict[str, Any]:
    return {
        "images": [
            {"id": 1, "file_name": "1.png", "width": W, "height": H},
            {"id": 2, "file_name": "2.png", "width": W, "height": H},
            {"id": 3, "file_name": "3.png", "width": 20, "height": 50},
        ],
        "categories": [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}],
        "annotations": [
            {
                "id": 10,
                "image_id": 1,
                "category_id": 3,
                "bbox": [5, 4, 10, 8],
                "area": 80.0,
                "iscrowd": 0,
                "segmentation": [[5, 4, 15, 4, 15, 12, 5, 12]],
            },
            {
                "id": 11,
                "image_id": 1,
                "category_id": 7,
                "bbox": [30, 20, 20, 20],
                "area": 100.0,
                "iscrowd": 0,
                "segmentation": _uncompressed_rle(MASK_11),
            },
            {
                "id": 12,
                "image_id": 2,
                "category_id": 7,
                "bbox": [3, 2, 18, 9],
                "area": 19.0,
                "iscrowd": 0,
                "segmentation": _compressed_rle(MASK_12),
            },
            {
                "id": 13,
                "image_id": 2,
                "category_id": 3,
                "bbox": [0, 15, 10, 10],
                "area": 100.0,
                "iscrowd": 1,
                "segmentation": _uncompressed_rle(MASK_13),
            },
            {
                "id": 14,
                "image_id": 2,
                "category_id": 3,
                "bbox": [25, 2, 11, 22],
                "area": 36.0,
                "iscrowd": 0,
                "segmentation": [[25, 2, 30, 2, 30, 6, 25, 6], [32, 20, 36, 20, 36, 24, 32, 24]],
            },
        ],
    }


def _write_images(image_dir: Path) -> None:
    image_dir.mkdir(parents=True, exist_ok=True)
    Image.fromarray(IMAGE_1, "RGB").save(image_dir / "1.png")
    Image.fromarray(IMAGE_2, "L").save(image_dir / "2.png")
    Image.fromarray(IMAGE_3, "RGBA").save(image_dir / "3.png")


def _write(tmp_path: Path, data: dict[str, Any], name: str = "instances_train.json") -> tuple[Path, Path]:
    image_dir = tmp_path / "images"
    if not image_dir.exists():
        _write_images(image_dir)
    ann_file = tmp_path / name
    ann_file.write_text(json.dumps(data))
    return image_dir, ann_file


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, Path]:
    return _write(tmp_path, _coco_dict())


def _mutated(tmp_path: Path, fn) -> tuple[Path, Path]:
    data = _coco_dict()
    fn(data)
    return _write(tmp_path, data)


def _ann(data: dict[str, Any], ann_id: int) -> dict[str, Any]:
    return next(a for a in data["annotations"] if a["id"] == ann_id)


def _tight_box(mask: torch.Tensor) -> list[float]:
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


# ---------------------------------------------------------------------- loading and targets


def test_metadata_and_label_mapping(folder):
    ds = CocoInstances(*folder)
    assert len(ds) == 3
    assert ds.category_ids == [3, 7]
    assert ds.class_names == ["cat", "dog"]
    assert ds.num_classes == 3
    assert ds.image_ids == [1, 2, 3]
    assert ds.skipped_boxes == 0
    assert ds.aspect_ratios() == [W / H, W / H, 20 / 50]
    assert ds.image_info(2) == {"id": 3, "file_name": "3.png", "width": 20, "height": 50}
    assert sorted(ds.coco.getAnnIds()) == [10, 11, 12, 13, 14]


def test_item_polygon_and_uncompressed_rle(folder):
    image, target = CocoInstances(*folder)[0]
    assert image.dtype == torch.uint8 and image.shape == (3, H, W)
    assert torch.equal(image, torch.from_numpy(IMAGE_1).permute(2, 0, 1))
    assert set(target) == {"boxes", "labels", "masks", "image_id", "area", "iscrowd"}
    assert target["boxes"].dtype == torch.float32
    # ann 11's bbox [30, 20, 20, 20] is clipped to the 40x30 image
    assert target["boxes"].tolist() == [[5.0, 4.0, 15.0, 12.0], [30.0, 20.0, 40.0, 30.0]]
    assert target["labels"].dtype == torch.int64 and target["labels"].tolist() == [1, 2]
    assert (
        target["image_id"].dtype == torch.int64
        and target["image_id"].shape == ()
        and target["image_id"].item() == 1
    )
    assert target["area"].dtype == torch.float32 and target["area"].tolist() == [80.0, 100.0]
    assert target["iscrowd"].dtype == torch.int64 and target["iscrowd"].tolist() == [0, 0]
    masks = target["masks"]
    assert masks.dtype == torch.uint8 and masks.shape == (2, H, W)
    assert torch.equal(masks[0], torch.from_numpy(MASK_10))
    assert torch.equal(masks[1], torch.from_numpy(MASK_11))


def test_item_compressed_rle_crowd_and_multipart_polygon(folder):
    image, target = CocoInstances(*folder)[1]
    grey = torch.from_numpy(IMAGE_2)
    assert image.shape == (3, H, W) and all(torch.equal(image[c], grey) for c in range(3))
    assert target["boxes"].tolist() == [
        [3.0, 2.0, 21.0, 11.0],
        [0.0, 15.0, 10.0, 25.0],
        [25.0, 2.0, 36.0, 24.0],
    ]
    assert target["labels"].tolist() == [2, 1, 1]
    assert target["iscrowd"].tolist() == [0, 1, 0]
    assert target["image_id"].item() == 2
    assert torch.equal(target["masks"][0], torch.from_numpy(MASK_12))
    assert torch.equal(target["masks"][1], torch.from_numpy(MASK_13))
    assert torch.equal(target["masks"][2], torch.from_numpy(MASK_14))


def test_drop_crowd_filters_every_instance_field(folder):
    _, target = CocoInstances(*folder)[1]
    kept = drop_crowd(target)
    assert kept["iscrowd"].tolist() == [0, 0]
    assert kept["labels"].tolist() == [2, 1]
    assert kept["boxes"].tolist() == [[3.0, 2.0, 21.0, 11.0], [25.0, 2.0, 36.0, 24.0]]
    assert kept["area"].tolist() == [19.0, 36.0]
    assert kept["masks"].shape == (2, H, W)
    assert torch.equal(kept["masks"][1], torch.from_numpy(MASK_14))
    assert kept["image_id"].item() == 2
    assert target["labels"].tolist() == [2, 1, 1]  # input not modified


def test_compressed_rle_with_bytes_counts(folder, monkeypatch):
    data = _coco_dict()
    seg = _ann(data, 12)["segmentation"]
    seg["counts"] = seg["counts"].encode("ascii")
    monkeypatch.setattr(coco_module, "load_annotation_file", lambda path: copy.deepcopy(data))
    _, target = CocoInstances(*folder)[1]
    assert torch.equal(target["masks"][0], torch.from_numpy(MASK_12))


def test_image_without_annotations_has_empty_target(folder):
    image, target = CocoInstances(*folder)[2]
    assert torch.equal(image, torch.from_numpy(IMAGE_3[..., :3]).permute(2, 0, 1))  # RGBA -> RGB
    assert target["boxes"].shape == (0, 4) and target["boxes"].dtype == torch.float32
    assert target["labels"].shape == (0,) and target["labels"].dtype == torch.int64
    assert target["masks"].shape == (0, 50, 20) and target["masks"].dtype == torch.uint8
    assert target["area"].shape == (0,) and target["iscrowd"].shape == (0,)
    assert target["image_id"].item() == 3


def test_skip_empty_drops_images_without_annotations(folder):
    ds = CocoInstances(*folder, skip_empty=True)
    assert ds.image_ids == [1, 2]
    assert ds.aspect_ratios() == [W / H, W / H]
    assert ds[1][1]["image_id"].item() == 2


def test_without_masks(folder):
    _, target = CocoInstances(*folder, with_masks=False)[0]
    assert "masks" not in target
    assert target["boxes"].tolist() == [[5.0, 4.0, 15.0, 12.0], [30.0, 20.0, 40.0, 30.0]]


def test_items_do_not_share_memory_with_the_index(folder):
    ds = CocoInstances(*folder)
    ds[0][1]["boxes"].add_(100)
    assert ds[0][1]["boxes"].tolist() == [[5.0, 4.0, 15.0, 12.0], [30.0, 20.0, 40.0, 30.0]]


def test_transforms_are_applied(folder):
    calls = []

    def record(image, target):
        calls.append(target["image_id"].item())
        return image.float(), target

    image, _ = CocoInstances(*folder, transforms=record)[1]
    assert calls == [2]
    assert image.dtype == torch.float32


def test_val_reuses_train_category_mapping(tmp_path, folder):
    train = CocoInstances(*folder)
    val_data = _coco_dict()
    val_data["categories"] = [{"id": 7, "name": "dog"}]  # val file only knows category 7
    val_data["annotations"] = [a for a in val_data["annotations"] if a["category_id"] == 7]
    image_dir, val_file = _write(tmp_path, val_data, "instances_val.json")

    alone = CocoInstances(image_dir, val_file)
    assert alone.category_ids == [7] and alone[0][1]["labels"].tolist() == [1]

    val = CocoInstances(image_dir, val_file, category_ids=train.category_ids)
    assert val.category_ids == [3, 7] and val.num_classes == 3 and val.class_names == ["category_3", "dog"]
    assert val[0][1]["labels"].tolist() == [2] == train[0][1]["labels"][1:].tolist()
    assert val[1][1]["labels"].tolist() == [2] == train[1][1]["labels"][:1].tolist()


def test_category_not_in_given_mapping(folder):
    with pytest.raises(ValueError, match=r"annotation 10 .*category_id 3.*category_ids mapping.*\[7\]"):
        CocoInstances(*folder, category_ids=[7])


# ---------------------------------------------------------------------- errors


def test_missing_annotation_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path)) + r".*data\.root"):
        CocoInstances(tmp_path, path)


def test_malformed_json_names_file_and_position(tmp_path):
    _write_images(tmp_path / "images")
    path = tmp_path / "instances_bad.json"
    path.write_text('{"images": [\n  {"id": 1,,}\n]}')
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" is not valid JSON: .* line 2, column 12"):
        CocoInstances(tmp_path / "images", path)


def test_missing_top_level_key(tmp_path):
    image_dir, path = _mutated(tmp_path, lambda d: d.pop("categories"))
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" has no top-level key 'categories'"):
        CocoInstances(image_dir, path)


def test_missing_image_file_named_at_construction(folder):
    image_dir, path = folder
    (image_dir / "2.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 of 3 images .*" + re.escape(str(image_dir / "2.png"))):
        CocoInstances(image_dir, path)


def test_corrupt_image_named_at_getitem(folder):
    image_dir, path = folder
    (image_dir / "1.png").write_bytes(b"definitely not a png")
    ds = CocoInstances(image_dir, path)  # construction only checks existence
    with pytest.raises(OSError, match=r"cannot read image " + re.escape(str(image_dir / "1.png"))):
        ds[0]
    assert ds[1][1]["image_id"].item() == 2


def test_image_size_disagreeing_with_json(tmp_path):
    def heighten(d):
        d["images"][2]["height"] = 51

    image_dir, path = _mutated(tmp_path, heighten)
    ds = CocoInstances(image_dir, path)
    with pytest.raises(
        ValueError,
        match=r"image 3 \("
        + re.escape(str(image_dir / "3.png"))
        + r"\) is 20x50 pixels but .* says 20x51; fix the 'width'/'height'",
    ):
        ds[2]


@pytest.mark.parametrize(
    ("bbox", "message"),
    [
        ([5, 4, -3, 8], "has bbox width -3.0;"),
        ([5, 4, 10, 0], "has bbox height 0.0;"),
        ([45, 5, 5, 5], "has bbox [45.0, 5.0, 5.0, 5.0] completely outside the 40x30 image"),
        ([-20, 5, 15, 5], "has bbox [-20.0, 5.0, 15.0, 5.0] completely outside the 40x30 image"),
        ([float("nan"), 4, 10, 8], "has non-finite bbox [nan, 4.0, 10.0, 8.0]"),
    ],
)
def test_degenerate_box_errors(tmp_path, bbox, message):
    image_dir, path = _mutated(tmp_path, lambda d: _ann(d, 10).update(bbox=bbox))
    with pytest.raises(
        ValueError,
        match=r"annotation 10 \(image 1\) in "
        + re.escape(str(path) + " " + message)
        + r".*data\.invalid_boxes=skip",
    ):
        CocoInstances(image_dir, path)


def test_invalid_boxes_skip_counts_and_drops(tmp_path, caplog):
    def break_boxes(d):
        _ann(d, 10)["bbox"] = [5, 4, -3, 8]
        _ann(d, 11)["bbox"] = [45, 5, 5, 5]

    image_dir, path = _mutated(tmp_path, break_boxes)
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.data.coco"):
        ds = CocoInstances(image_dir, path, invalid_boxes="skip")
    assert ds.skipped_boxes == 2
    assert sorted(ds.coco.getAnnIds()) == [12, 13, 14]  # evaluation ground truth matches the targets
    assert [r.getMessage() for r in caplog.records] == [
        f"dropped 2 degenerate annotation(s) from {path} (data.invalid_boxes=skip)"
    ]
    _, target = ds[0]
    assert target["boxes"].shape == (0, 4) and target["masks"].shape == (0, H, W)
    assert ds[1][1]["labels"].tolist() == [2, 1, 1]
    assert CocoInstances(image_dir, path, invalid_boxes="skip", skip_empty=True).image_ids == [2]


def test_unknown_invalid_boxes_policy(folder):
    with pytest.raises(ValueError, match=r"invalid_boxes.*'drop'"):
        CocoInstances(*folder, invalid_boxes="drop")


def test_unknown_category_id(tmp_path):
    image_dir, path = _mutated(tmp_path, lambda d: _ann(d, 12).update(category_id=5))
    with pytest.raises(
        ValueError,
        match=r"annotation 12 in "
        + re.escape(str(path))
        + r" has category_id 5, .*known category ids: \[3, 7\]",
    ):
        CocoInstances(image_dir, path)


def test_a_misspelt_key_is_named_missing(tmp_path):
    image_dir, path = _mutated(
        tmp_path, lambda d: _ann(d, 12).update(categoryid=_ann(d, 12).pop("category_id"))
    )
    with pytest.raises(
        ValueError,
        match=r"annotation 12 in " + re.escape(str(path)) + r" has no category_id key "
        r"\(its keys: .*categoryid.*\); a COCO annotation needs image_id, category_id and bbox",
    ):
        CocoInstances(image_dir, path)


def test_unknown_image_id(tmp_path):
    image_dir, path = _mutated(tmp_path, lambda d: _ann(d, 12).update(image_id=99))
    with pytest.raises(
        ValueError, match=r"annotation 12 in " + re.escape(str(path)) + r" has image_id 99, which is not"
    ):
        CocoInstances(image_dir, path)


def test_empty_split(tmp_path):
    image_dir, path = _write(
        tmp_path, {"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}]}
    )
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" has no images; check data\.root"):
        CocoInstances(image_dir, path)


def test_skip_empty_leaving_nothing(tmp_path):
    image_dir, path = _mutated(tmp_path, lambda d: d.update(annotations=[]))
    assert len(CocoInstances(image_dir, path)) == 3
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" has no images with annotations"):
        CocoInstances(image_dir, path, skip_empty=True)


@pytest.mark.parametrize(
    ("segmentation", "message"),
    [
        ([[5, 4, 15, 4, 15]], r"polygon \[5, 4, 15, 4, 15\] is not a flat list of"),
        ({"size": [10, 10], "counts": [100]}, r"RLE size \[10, 10\] does not match"),
        ({"size": [H, W], "counts": [5, 10]}, r"RLE runs cover 15 pixels"),
        ("oops", "segmentation 'oops' of type str"),
    ],
)
def test_malformed_segmentation_at_construction(tmp_path, segmentation, message):
    image_dir, path = _mutated(tmp_path, lambda d: _ann(d, 11).update(segmentation=segmentation))
    with pytest.raises(
        ValueError,
        match=r"annotation 11 \(image 1\) in "
        + re.escape(str(path))
        + " has a malformed segmentation: "
        + message,
    ):
        CocoInstances(image_dir, path)
    assert len(CocoInstances(image_dir, path, with_masks=False)) == 3


def test_degenerate_polygon_errors_or_is_skipped(tmp_path):
    image_dir, path = _mutated(tmp_path, lambda d: _ann(d, 10).update(segmentation=[[5, 4, 15, 4]]))
    with pytest.raises(ValueError, match=r"annotation 10 .*fewer than 3 points.*data\.invalid_boxes=skip"):
        CocoInstances(image_dir, path)
    ds = CocoInstances(image_dir, path, invalid_boxes="skip")
    assert ds.skipped_boxes == 1 and ds[0][1]["labels"].tolist() == [2]


@pytest.mark.parametrize("counts", ["garbage!", "PP", "1"])
def test_undecodable_compressed_rle_named_at_getitem(tmp_path, counts):
    image_dir, path = _mutated(tmp_path, lambda d: _ann(d, 12)["segmentation"].update(counts=counts))
    ds = CocoInstances(image_dir, path)
    with pytest.raises(
        ValueError,
        match=r"annotation 12 \(image 2\) in "
        + re.escape(str(path))
        + r" has a segmentation pycocotools cannot decode",
    ):
        ds[1]
    assert ds[0][1]["masks"].shape == (2, H, W)


# ---------------------------------------------------------------------- transforms


def test_flip_p1_mirrors_image_boxes_and_masks(folder):
    image, target = CocoInstances(*folder)[0]
    flipped_image, flipped = RandomHorizontalFlip(p=1.0)(image, target, torch.Generator().manual_seed(0))
    assert torch.equal(flipped_image, image.flip(-1))
    assert flipped["boxes"].tolist() == [[25.0, 4.0, 35.0, 12.0], [0.0, 20.0, 10.0, 30.0]]
    assert [_tight_box(m) for m in flipped["masks"]] == flipped["boxes"].tolist()
    assert torch.equal(flipped["masks"], target["masks"].flip(-1))
    assert torch.equal(flipped["labels"], target["labels"])
    assert target["boxes"].tolist() == [[5.0, 4.0, 15.0, 12.0], [30.0, 20.0, 40.0, 30.0]]  # input untouched


def test_flip_p0_is_identity_and_empty_targets_flip(folder):
    ds = CocoInstances(*folder)
    image, target = ds[1]
    generator = torch.Generator().manual_seed(123)
    for _ in range(5):
        out_image, out = RandomHorizontalFlip(p=0.0)(image, target, generator)
        assert out_image is image and out is target
    image, target = ds[2]
    out_image, out = RandomHorizontalFlip(p=1.0)(image, target)
    assert out["boxes"].shape == (0, 4) and out["masks"].shape == (0, 50, 20)
    assert torch.equal(out_image, image.flip(-1))


def test_flip_is_deterministic_given_generator(folder):
    image, target = CocoInstances(*folder)[0]
    flip = RandomHorizontalFlip(p=0.5)

    def pattern(seed: int) -> list[bool]:
        generator = torch.Generator().manual_seed(seed)
        return [flip(image, target, generator)[1]["boxes"][0, 0].item() == 25.0 for _ in range(32)]

    first = pattern(7)
    assert first == pattern(7)
    assert True in first and False in first
    assert first != pattern(8)


def test_compose_passes_generator_and_to_float(folder):
    image, target = CocoInstances(*folder)[0]
    pipeline = Compose([RandomHorizontalFlip(0.5), ToFloat()])
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(3)
        runs.append([pipeline(image, target, generator) for _ in range(8)])
    for (img_a, tgt_a), (img_b, tgt_b) in zip(*runs, strict=True):
        assert torch.equal(img_a, img_b) and torch.equal(tgt_a["boxes"], tgt_b["boxes"])
    out_image, _ = runs[0][0]
    assert out_image.dtype == torch.float32
    assert torch.equal(out_image * 255, out_image.mul(255).round())  # exact k/255 values
    assert torch.allclose(ToFloat()(image, target)[0], image.float() / 255)
    assert {tuple(t["boxes"][0].tolist()) for _, t in runs[0]} == {
        (5.0, 4.0, 15.0, 12.0),
        (25.0, 4.0, 35.0, 12.0),
    }


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", True])
def test_flip_rejects_bad_probability(p):
    with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1\], got " + re.escape(repr(p))):
        RandomHorizontalFlip(p)


def test_to_float_rejects_float_input():
    with pytest.raises(TypeError, match=r"ToFloat .*torch\.float32"):
        ToFloat()(torch.zeros(3, 2, 2), {})


def test_reprs():
    assert repr(RandomHorizontalFlip(0.25)) == "RandomHorizontalFlip(p=0.25)"
    assert repr(ToFloat()) == "ToFloat()"
    assert repr(Compose([RandomHorizontalFlip(), ToFloat()])) == (
        "Compose([\n    RandomHorizontalFlip(p=0.5),\n    ToFloat(),\n])"
    )


def test_collate_detection_keeps_lists(folder):
    ds = CocoInstances(*folder)
    images, targets = collate_detection([ds[0], ds[2]])
    assert isinstance(images, list) and isinstance(targets, list)
    assert [tuple(i.shape) for i in images] == [(3, H, W), (3, 50, 20)]
    assert [t["image_id"].item() for t in targets] == [1, 3]


# ---------------------------------------------------------------------- a training split with nothing to
# learn


def _datamodule(tmp_path: Path, data: dict[str, Any], **options: Any):
    from lit_amp_det.data import CocoDataModule

    _write(tmp_path, data)
    return CocoDataModule(
        tmp_path,
        train_images="images",
        train_annotations="instances_train.json",
        val_images="images",
        val_annotations="instances_train.json",
        **options,
    )


def _no_annotations(data: dict[str, Any]) -> None:
    data.update(annotations=[])


def _crowd_only(data: dict[str, Any]) -> None:
    data.update(annotations=[_ann(data, 13)])


@pytest.mark.parametrize("mutate", [_no_annotations, _crowd_only], ids=["no_annotations", "crowd_only"])
def test_training_split_without_annotations_stops_fit(tmp_path, mutate):
    data = _coco_dict()
    mutate(data)
    dm = _datamodule(tmp_path, data)
    dm.setup("validate")  # scoring such a split is not training on it
    path = tmp_path / "instances_train.json"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"the training split {path} has no annotations to learn from (3 images, 0 non-crowd annotations)"
        ),
    ) as info:
        dm.setup("fit")
    assert "mAP 0" in str(info.value) and "set data.allow_empty_train=true" in str(info.value)


def test_allow_empty_train_trains_with_a_warning(tmp_path):
    dm = _datamodule(tmp_path, {**_coco_dict(), "annotations": []}, allow_empty_train=True)
    with pytest.warns(UserWarning, match=r"training anyway because data\.allow_empty_train=true"):
        dm.setup("fit")
    assert len(dm.dataset("train")) == 3 and dm.dataset("train").num_instances == 0


def test_allow_empty_train_is_silent_when_there_are_annotations(tmp_path, recwarn):
    dm = _datamodule(tmp_path, _coco_dict(), allow_empty_train=True)
    dm.setup("fit")
    assert dm.dataset("train").num_instances == 4  # ann 13 is a crowd region
    assert not [w for w in recwarn if "allow_empty_train" in str(w.message)]


def test_skip_empty_train_on_a_split_without_annotations(tmp_path):
    dm = _datamodule(
        tmp_path, {**_coco_dict(), "annotations": []}, skip_empty_train=True, allow_empty_train=True
    )
    path = tmp_path / "instances_train.json"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{path} has no images with annotations, so skip_empty=True "
            "(data.skip_empty_train=true) leaves no image at all"
        ),
    ) as info:
        dm.setup("fit")
    assert "set data.skip_empty_train=false data.allow_empty_train=true" in str(info.value)
