"""Tests for the synthetic COCO shapes dataset (lit_amp_det.data.shapes)."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO

from lit_amp_det.data import shapes, shapes_spec
from lit_amp_det.data.shapes import (
    MARKER_NAME,
    SHAPE_CLASSES,
    ShapesSpec,
    ensure_shapes,
    generate_shapes,
    render_shapes_image,
    shapes_dataset_dir,
)

# pycocotools' Cython decode trips a numpy-2 DeprecationWarning on every call; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SPLITS = {"train": 24, "val": 8}
SMALL = {"train": 6, "val": 3}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("shapes") / "ds", ShapesSpec(seed=3), splits=SPLITS)


@pytest.fixture(scope="module")
def cocos(dataset: Path) -> dict[str, COCO]:
    return {split: COCO(str(dataset / "annotations" / f"instances_{split}.json")) for split in SPLITS}


def _all_anns(coco: COCO) -> list[dict]:
    return coco.loadAnns(coco.getAnnIds())


def _tight_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)


def _read_pixels(root: Path) -> dict[str, np.ndarray]:
    return {
        str(p.relative_to(root)): np.asarray(Image.open(p)) for p in sorted((root / "images").rglob("*.png"))
    }


def test_layout_and_coco_loading(dataset: Path, cocos: dict[str, COCO]) -> None:
    assert (dataset / MARKER_NAME).is_file()
    for split, count in SPLITS.items():
        coco = cocos[split]
        cats = coco.loadCats(coco.getCatIds())
        assert [c["name"] for c in cats] == list(SHAPE_CLASSES)
        assert [c["id"] for c in cats] == list(range(1, len(SHAPE_CLASSES) + 1))
        assert {c["supercategory"] for c in cats} == {"shape"}
        assert sorted(coco.getImgIds()) == list(range(1, count + 1))
        ann_ids = coco.getAnnIds()
        assert sorted(ann_ids) == list(range(1, len(ann_ids) + 1))
        assert len(ann_ids) >= count  # on average several shapes per image
        for img in coco.loadImgs(coco.getImgIds()):
            assert "/" not in img["file_name"]
            with Image.open(dataset / "images" / split / img["file_name"]) as im:
                assert im.format == "PNG" and im.mode == "RGB"
                assert im.size == (img["width"], img["height"]) == (160, 160)
    # No leftovers from the temporary build folder next to the dataset.
    assert sorted(p.name for p in dataset.parent.iterdir()) == [dataset.name]


def test_masks_bbox_area_and_both_encodings(cocos: dict[str, COCO]) -> None:
    kinds = {"polygon": 0, "rle": 0}
    for coco in cocos.values():
        for ann in _all_anns(coco):
            seg = ann["segmentation"]
            if isinstance(seg, dict):
                kinds["rle"] += 1
                assert isinstance(seg["counts"], str) and seg["size"] == [160, 160]
            else:
                kinds["polygon"] += 1
                assert len(seg) == 1 and len(seg[0]) >= 6 and len(seg[0]) % 2 == 0
                xs, ys = np.array(seg[0][0::2]), np.array(seg[0][1::2])
                assert xs.min() >= 0 and ys.min() >= 0 and xs.max() <= 160 and ys.max() <= 160
            mask = coco.annToMask(ann).astype(bool)
            assert mask.sum() >= shapes_spec.MIN_VISIBLE_PIXELS
            assert ann["iscrowd"] == 0
            assert np.allclose(ann["bbox"], _tight_box(mask), atol=1.0)
            assert abs(ann["area"] - mask.sum()) <= 0.03 * mask.sum()
    assert kinds["polygon"] > 0 and kinds["rle"] > 0, kinds


def test_annotations_match_rendered_visible_masks(dataset: Path, cocos: dict[str, COCO]) -> None:
    """Every label is exactly the visible part of a drawn shape; image pixels match."""
    occluded_labelled = 0
    for split, coco in cocos.items():
        for image_id in coco.getImgIds():
            rendered = render_shapes_image(split, image_id - 1, ShapesSpec(seed=3))
            file_name = coco.loadImgs(image_id)[0]["file_name"]
            pixels = np.asarray(Image.open(dataset / "images" / split / file_name))
            np.testing.assert_array_equal(pixels, rendered.image)
            labelled = [inst for inst in rendered.instances if inst.labelled]
            anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
            assert [a["category_id"] for a in anns] == [inst.category_id for inst in labelled]
            for inst, ann in zip(labelled, anns, strict=True):
                decoded = coco.annToMask(ann).astype(bool)
                iou = (decoded & inst.visible_mask).sum() / (decoded | inst.visible_mask).sum()
                assert iou > 0.9
                np.testing.assert_array_equal(decoded, inst.visible_mask)
                assert ann["area"] == inst.visible_mask.sum()
                hidden = not np.array_equal(inst.visible_mask, inst.full_mask)
                if isinstance(ann["segmentation"], list):
                    assert not hidden and inst.name != "ring"
                else:
                    occluded_labelled += hidden
            for inst in rendered.instances:
                visible = int(inst.visible_mask.sum())
                expect = visible >= shapes_spec.MIN_VISIBLE_PIXELS and (
                    visible >= shapes_spec.MIN_VISIBLE_FRACTION * inst.full_mask.sum()
                )
                assert inst.labelled == expect
    assert occluded_labelled > 0


def test_occlusion_hides_earlier_shapes() -> None:
    seen_overlap = False
    for index in range(30):
        rendered = render_shapes_image("train", index)
        for a, b in itertools.combinations(range(len(rendered.instances)), 2):
            lower, upper = rendered.instances[a], rendered.instances[b]
            overlap = lower.full_mask & upper.full_mask
            # Drawing order decides visibility: the later shape owns shared pixels.
            assert not (lower.visible_mask & overlap).any()
            seen_overlap |= bool(overlap.any())
            if overlap.any():
                assert lower.visible_mask.sum() < lower.full_mask.sum()
    assert seen_overlap


def test_classes_differ_in_shape_not_colour(dataset: Path, cocos: dict[str, COCO]) -> None:
    expected_vertices = {"circle": 32, "square": 4, "triangle": 3, "star": 10, "cross": 12}
    checked = set()
    colours: dict[str, list[np.ndarray]] = {}
    for split, coco in cocos.items():
        for ann in _all_anns(coco):
            name = SHAPE_CLASSES[ann["category_id"] - 1]
            seg = ann["segmentation"]
            x, y, w, h = ann["bbox"]
            if isinstance(seg, list) and x > 0 and y > 0 and x + w < 160 and y + h < 160:
                assert len(seg[0]) // 2 == expected_vertices[name], name  # unclipped outline
                checked.add(name)
            img = coco.loadImgs(ann["image_id"])[0]
            pixels = np.asarray(Image.open(dataset / "images" / split / img["file_name"]))
            colours.setdefault(name, []).append(np.median(pixels[coco.annToMask(ann) > 0], axis=0))
    assert len(checked) >= 3
    assert len(colours) >= 3
    spreads = {
        name: max(np.linalg.norm(a - b) for a, b in itertools.combinations(cs, 2))
        for name, cs in colours.items()
        if len(cs) >= 3
    }
    assert len(spreads) >= 3
    assert all(spread > 60 for spread in spreads.values()), spreads


def test_deterministic_and_seed_dependent(tmp_path: Path) -> None:
    a = generate_shapes(tmp_path / "a", ShapesSpec(seed=5), splits=SMALL)
    b = generate_shapes(tmp_path / "b", ShapesSpec(seed=5), splits=SMALL)
    c = generate_shapes(tmp_path / "c", ShapesSpec(seed=6), splits=SMALL)
    for split in SMALL:
        name = f"annotations/instances_{split}.json"
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()
    pa, pb, pc = _read_pixels(a), _read_pixels(b), _read_pixels(c)
    assert pa.keys() == pb.keys() == pc.keys() and len(pa) == sum(SMALL.values())
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert not any(np.array_equal(pa[k], pc[k]) for k in pa)
    # Splits are drawn independently: dropping "val" leaves "train" untouched.
    d = generate_shapes(tmp_path / "d", ShapesSpec(seed=5), splits={"train": SMALL["train"]})
    ja = json.loads((a / "annotations/instances_train.json").read_text())
    jd = json.loads((d / "annotations/instances_train.json").read_text())
    assert ja["images"] == jd["images"] and ja["annotations"] == jd["annotations"]


def test_empty_images_are_valid_coco(tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "e", ShapesSpec(empty_prob=1.0), splits={"train": 3})
    coco = COCO(str(root / "annotations" / "instances_train.json"))
    assert len(coco.getImgIds()) == 3 and coco.getAnnIds() == []


def test_ensure_shapes_reuses_and_regenerates(tmp_path: Path) -> None:
    root = ensure_shapes(tmp_path, ShapesSpec(image_size=64), splits=SMALL)
    assert root == shapes_dataset_dir(tmp_path, ShapesSpec(image_size=64), splits=SMALL)
    assert root.parent == tmp_path and root.name.startswith("shapes-")
    ann = root / "annotations" / "instances_train.json"
    before = (ann.stat().st_mtime_ns, ann.stat().st_ino)

    assert ensure_shapes(tmp_path, ShapesSpec(image_size=64), splits=SMALL) == root
    assert (ann.stat().st_mtime_ns, ann.stat().st_ino) == before

    other = ensure_shapes(tmp_path, ShapesSpec(image_size=(64, 80)), splits=SMALL)
    assert other != root and (other / MARKER_NAME).is_file()
    with Image.open(other / "images" / "train" / "000001.png") as im:
        assert im.size == (80, 64)
    assert (ann.stat().st_mtime_ns, ann.stat().st_ino) == before

    (root / MARKER_NAME).unlink()
    ann.write_text("truncated")
    assert ensure_shapes(tmp_path, ShapesSpec(image_size=64), splits=SMALL) == root
    assert (root / MARKER_NAME).is_file()
    COCO(str(ann))  # a complete, loadable file again


def _as_call(fields: dict) -> dict:
    """``splits`` stays a keyword; every other field goes into the ShapesSpec."""
    fields = dict(fields)
    splits = fields.pop("splits", None)
    return {"spec": ShapesSpec(**fields), **({"splits": splits} if splits is not None else {})}


def test_cache_dir_depends_on_every_parameter(tmp_path: Path) -> None:
    base = shapes_dataset_dir(tmp_path)
    assert base == shapes_dataset_dir(
        tmp_path, ShapesSpec(seed=0), splits={"val": 100, "test": 100, "train": 800}
    )
    variants = [
        dict(splits={"train": 801, "val": 100, "test": 100}),
        dict(image_size=128),
        dict(min_objects=2),
        dict(max_objects=4),
        dict(min_size=0.2),
        dict(max_size=0.4),
        dict(seed=1),
        dict(empty_prob=0.0),
    ]
    names = {shapes_dataset_dir(tmp_path, **_as_call(kw)).name for kw in variants}
    assert len(names) == len(variants) and base.name not in names


def test_generate_refuses_to_clobber(tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "ds", ShapesSpec(image_size=48), splits=SMALL)
    with pytest.raises(FileExistsError, match="other parameters"):
        generate_shapes(root, ShapesSpec(image_size=48, seed=1), splits=SMALL)
    generate_shapes(root, ShapesSpec(image_size=48, seed=1), splits=SMALL, overwrite=True)
    assert json.loads((root / MARKER_NAME).read_text())["params"]["seed"] == 1

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(FileExistsError, match="not a shapes dataset"):
        generate_shapes(foreign, ShapesSpec(image_size=48), splits=SMALL)
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_interrupted_generation_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_render = shapes._render
    calls = itertools.count()

    def flaky(*args, **kwargs):
        if next(calls) == 4:
            raise KeyboardInterrupt
        return real_render(*args, **kwargs)

    monkeypatch.setattr(shapes, "_render", flaky)
    with pytest.raises(KeyboardInterrupt):
        ensure_shapes(tmp_path, ShapesSpec(image_size=48), splits=SMALL)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_generation_is_safe(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(ensure_shapes(tmp_path, ShapesSpec(image_size=48), splits=SMALL))
        except BaseException as err:  # noqa: BLE001 - surfaced by the assert below
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 3 and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert (results[0] / MARKER_NAME).is_file()
    assert len(list((results[0] / "images" / "train").iterdir())) == SMALL["train"]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(splits={"train": 0}), "splits['train']"),
        (dict(splits={}), "splits"),
        (dict(splits={"a/b": 3}), "splits"),
        (dict(image_size=16), "image_size"),
        (dict(image_size=(64, 0)), "image_size"),
        (dict(image_size="64"), "image_size"),
        (dict(min_objects=-1), "min_objects"),
        (dict(max_objects=0), "max_objects"),
        (dict(min_objects=4, max_objects=3), "min_objects"),
        (dict(min_size=0.5, max_size=0.4), "min_size"),
        (dict(max_size=1.5), "max_size"),
        (dict(min_size=0.0), "min_size"),
        (dict(seed=-1), "seed"),
        (dict(empty_prob=2.0), "empty_prob"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument.replace("[", r"\[").replace("]", r"\]")):
        generate_shapes(tmp_path / "x", **_as_call(kwargs))
    with pytest.raises(ValueError, match=argument.replace("[", r"\[").replace("]", r"\]")):
        ensure_shapes(tmp_path, **_as_call(kwargs))
    assert list(tmp_path.iterdir()) == []


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        shapes.main([str(tmp_path / "cli"), "--split", "train=2", "--image-size", "48", "--seed", "2"]) == 0
    )
    assert str(tmp_path / "cli") in capsys.readouterr().out
    marker = json.loads((tmp_path / "cli" / MARKER_NAME).read_text())
    assert marker["params"]["seed"] == 2 and marker["splits"]["train"]["images"] == 2


def test_the_yaml_and_the_code_share_the_generators_defaults():
    """``conf/data/shapes.yaml`` repeats ShapesSpec's defaults for the command line; they must not drift."""
    import inspect

    from omegaconf import OmegaConf

    from lit_amp_det.app.config import config_dir
    from lit_amp_det.data import ShapesDataModule
    from lit_amp_det.data.shapes import ShapesSpec

    yaml = OmegaConf.load(config_dir() / "data" / "shapes.yaml")
    spec = ShapesSpec()
    assert (
        yaml.image_size,
        yaml.min_objects,
        yaml.max_objects,
        yaml.min_object_size,
        yaml.max_object_size,
        yaml.generation_seed,
    ) == (spec.image_size, spec.min_objects, spec.max_objects, spec.min_size, spec.max_size, spec.seed)
    defaults = {k: p.default for k, p in inspect.signature(ShapesDataModule).parameters.items()}
    assert (defaults["max_objects"], defaults["min_object_size"]) == (spec.max_objects, spec.min_size)
    for function in (generate_shapes, ensure_shapes, shapes_dataset_dir, render_shapes_image):
        params = inspect.signature(function).parameters
        keys = ("min_objects", "max_objects", "min_size", "max_size", "empty_prob", "seed", "image_size")
        assert all(
            params[k].default == getattr(spec, k)
            for k in keys
            if k in params and params[k].default is not inspect.Parameter.empty
        ), function
