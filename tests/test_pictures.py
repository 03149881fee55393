"""Pictures: detections drawn by ``predict``, ground truth beside predictions at each validation, training
curves.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pycocotools.mask as mask_utils
import pytest
import torch
from lightning.pytorch import Callback
from PIL import Image

from conftest import CONFIG_ERRORS, SMOKE, compose_config
from lit_amp_det.app.tasks import build_datamodule, build_model, build_trainer, predict
from lit_amp_det.callbacks import CocoPredictionWriter, TrainingCurves, ValidationImages
from lit_amp_det.callbacks.drawing import (
    PALETTE,
    DrawingWarning,
    class_names_of,
    draw_detections,
    draw_ground_truth,
    side_by_side,
)

#: one epoch of 2 steps and one validation batch (4 images at the smoke size, 64 px)
TINY_FIT = [
    *SMOKE,
    "trainer.max_epochs=1",
    "trainer.check_val_every_n_epoch=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "callbacks.validation_images.score_threshold=0.0",
]


@pytest.fixture(autouse=True)
def _drawing_failures_are_errors():
    """The callbacks only warn when a picture fails (a run must go on); here that is a bug to see."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrawingWarning)
        yield


def _png(path: Path) -> torch.Tensor:
    """Decodes a PNG file (and checks that it is one) into ``uint8 [3, H, W]``."""
    with Image.open(path) as image:
        assert image.format == "PNG" and image.mode in ("RGB", "RGBA"), (path, image.format, image.mode)
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def _enlarged(image: torch.Tensor, k: int) -> torch.Tensor:
    return image.repeat_interleave(k, dim=-2).repeat_interleave(k, dim=-1)


# ------------------------------------------------------------------------------------------------ drawing
def _gray(h: int = 40, w: int = 60) -> torch.Tensor:
    return torch.full((3, h, w), 0.5)


def test_soft_masks_are_cut_at_one_half_and_boxes_drawn_where_detected():
    probabilities = torch.full((1, 1, 64, 64), 0.3)
    probabilities[0, 0, 30:55, 10:40] = 0.7  # the instance; 0.3 elsewhere is background
    det = {
        "boxes": torch.tensor([[5.0, 10.0, 55.0, 58.0]]),
        "labels": torch.tensor([2]),
        "scores": torch.tensor([0.9]),
        "masks": probabilities,
    }
    out = draw_detections(_gray(64, 64), det, ["a", "b"])
    assert out.dtype == torch.uint8 and out.shape == (3, 64, 64)
    changed = (out != 128).any(0)
    assert changed[30:55, 10:40].all()  # the mask, below the caption
    assert not changed[32:54, 42:53].any()  # inside the box, probability 0.3: not the instance
    assert not changed[60:].any() and not changed[:, :4].any() and not changed[:9].any()  # outside the box
    assert tuple(out[:, 40, 5].tolist()) == PALETTE[1]  # the outline has the class's colour


def test_score_threshold_hides_weak_detections_and_boxes_only_detections_draw_no_mask():
    det = {
        "boxes": torch.tensor([[5.0, 5.0, 55.0, 35.0]]),
        "labels": torch.tensor([1]),
        "scores": torch.tensor([0.3]),
    }
    wide = torch.full((3, 40, 200), 0.5)
    hidden = draw_detections(wide, det, score_threshold=0.5)  # no box, and a note saying why
    assert (hidden[:, 16:] == 128).all() and (hidden[:, :14, :3] == 255).all()  # the note's white patch
    assert (hidden[:, 2:12, 2:140] < 100).all(0).sum() > 60  # its dark text: "no detections above 0.5"
    changed = (draw_detections(_gray(), det, score_threshold=0.3) != 128).any(0)
    assert changed[5, 30] and changed[20, 5]  # the box outline
    assert not changed[25:34, 10:50].any()  # no mask inside: Faster R-CNN draws boxes only


def test_overlapping_masks_show_the_most_confident_instance_not_black():
    masks = torch.zeros(2, 64, 64, dtype=torch.bool)
    masks[0, 30:50, 10:30] = True
    masks[1, 30:50, 20:40] = True  # columns 20..29 are in both
    det = {
        "boxes": torch.tensor([[10.0, 30.0, 30.0, 50.0], [20.0, 30.0, 40.0, 50.0]]),
        "labels": torch.tensor([1, 2]),
        "scores": torch.tensor([0.6, 0.9]),
        "masks": masks,
    }
    out = draw_detections(_gray(64, 64), det)
    overlap, only_first, only_second = out[:, 45, 25], out[:, 45, 12], out[:, 45, 35]
    assert torch.equal(overlap, only_second) and not torch.equal(overlap, only_first)  # 0.9 beats 0.6


def _many_detections(n: int, h: int, w: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    corner = torch.rand(n, 2, generator=gen) * torch.tensor([w * 0.8, h * 0.8])
    boxes = torch.cat(
        [corner, corner + torch.rand(n, 2, generator=gen) * torch.tensor([w * 0.5, h * 0.5]) + 2], 1
    )
    masks = torch.rand(n, h, w, generator=gen) > 0.6
    return {
        "boxes": boxes,
        "labels": torch.randint(1, 14, (n,), generator=gen),
        "scores": torch.rand(n, generator=gen),
        "masks": masks,
    }


def test_masks_drawn_one_per_colour_make_torchvision_s_picture_of_them_all():
    """The disjoint (first-owner) masks merged per colour draw exactly what one torchvision call per detection
    would: 13 classes share tab10's 10 colours, and the masks overlap.
    """
    from torchvision.utils import draw_segmentation_masks

    from lit_amp_det.callbacks.drawing import _first_owner

    image = torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    det = _many_detections(30, 48, 64)
    order = torch.argsort(det["scores"], descending=True)
    owned = _first_owner(det["masks"][order])
    colors = [PALETTE[(int(k) - 1) % len(PALETTE)] for k in det["labels"][order]]
    expected = draw_segmentation_masks(image, owned, alpha=0.5, colors=colors)
    off_image = {
        **det,
        "boxes": torch.zeros(30, 4) - 10,
    }  # boxes outside: only their captions reach the picture
    drawn = draw_detections(image, off_image)
    assert torch.equal(drawn[:, 16:], expected[:, 16:])  # below the captions' row


def test_large_images_are_drawn_shrunk_to_max_side():
    """A picture of a large image is the picture of that image shrunk (antialiased), its masks sampled at the
    nearest pixel and its boxes scaled: nothing full-size is drawn.
    """
    from torchvision.transforms.v2.functional import resize

    image = torch.randint(
        0, 256, (3, 300, 400), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    det = _many_detections(6, 300, 400, seed=3)
    picture = draw_detections(image, det, max_side=200)
    assert picture.shape == (3, 150, 200)
    rows, cols = torch.arange(150) * 2 + 1, torch.arange(200) * 2 + 1  # pixel centres: (k + 0.5) * 2, floored
    shrunk = {**det, "boxes": det["boxes"] / 2, "masks": det["masks"][:, rows][:, :, cols]}
    assert torch.equal(picture, draw_detections(resize(image, [150, 200], antialias=True), shrunk))
    assert torch.equal(draw_detections(image, det, max_side=400), draw_detections(image, det))  # not larger


def test_the_writer_encodes_each_mask_as_pycocotools_encodes_the_stack(tmp_path):
    det = _many_detections(7, 37, 53, seed=4)
    det["image_id"] = 3
    keep = det["scores"] >= 0.3
    stack = np.asfortranarray(det["masks"][keep].to(torch.uint8).permute(1, 2, 0).numpy())
    expected = [{"size": r["size"], "counts": r["counts"].decode("ascii")} for r in mask_utils.encode(stack)]
    records = CocoPredictionWriter(tmp_path, score_threshold=0.3)._image_records(det)
    assert len(records) == int(keep.sum()) > 2 and [r["segmentation"] for r in records] == expected
    soft = CocoPredictionWriter(tmp_path, score_threshold=0.3)._image_records(
        {**det, "masks": det["masks"][:, None]}
    )
    assert [r["segmentation"] for r in soft] == expected  # [N, 1, H, W] as torchvision's output has them
    with pytest.raises(ValueError, match=r"\bmax_side=-1\b"):
        CocoPredictionWriter(tmp_path, max_side=-1)
    with pytest.raises(ValueError, match=r"min_side=512.*max_side=256"):
        CocoPredictionWriter(tmp_path, min_side=512, max_side=256)


def test_a_mask_count_other_than_the_box_count_fails():
    det = {
        "boxes": torch.tensor([[1.0, 1.0, 5.0, 5.0]]),
        "labels": torch.tensor([1]),
        "scores": torch.tensor([1.0]),
    }
    with pytest.raises(ValueError, match=r"\b2 masks.*\b1 boxes"):
        draw_ground_truth(_gray(), {**det, "masks": torch.zeros(2, 40, 60, dtype=torch.uint8)})


def test_small_images_are_enlarged_by_whole_pixels():
    image = torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8)
    det = {
        "boxes": torch.zeros(0, 4),
        "labels": torch.zeros(0, dtype=torch.long),
        "scores": torch.zeros(0),
        "masks": torch.zeros(0, 20, 30, dtype=torch.bool),
    }
    enlarged = draw_detections(image, det, min_side=64)  # ceil(64 / 20) = 4; no detection: a note at the top
    assert enlarged.shape == (3, 80, 120) and torch.equal(enlarged[:, 20:], _enlarged(image, 4)[:, 20:])
    assert draw_detections(image, det).shape == image.shape


def test_ground_truth_draws_uint8_masks_and_names():
    image = torch.zeros(3, 40, 40, dtype=torch.uint8)
    masks = torch.zeros(1, 40, 40, dtype=torch.uint8)
    masks[0, 15:38, 5:25] = 1
    target = {
        "boxes": torch.tensor([[5.0, 15.0, 25.0, 38.0]]),
        "labels": torch.tensor([3]),
        "masks": masks,
        "iscrowd": torch.tensor([0]),
    }
    changed = (draw_ground_truth(image, target, ["x", "y", "z"]) != 0).any(0)
    assert changed[30:37, 7:23].all() and not changed[:14].any() and not changed[:, 27:].any()


def test_masks_of_another_size_fail_with_both_shapes():
    det = {
        "boxes": torch.tensor([[1.0, 1.0, 5.0, 5.0]]),
        "labels": torch.tensor([1]),
        "scores": torch.tensor([1.0]),
        "masks": torch.ones(1, 1, 20, 20),
    }
    with pytest.raises(ValueError, match=r"\(1, 1, 20, 20\).*\[N, 40, 60\]"):
        draw_detections(_gray(), det)


def test_side_by_side_places_pictures_under_captions():
    left, right = torch.zeros(3, 10, 20, dtype=torch.uint8), torch.full((3, 12, 8), 7, dtype=torch.uint8)
    page = side_by_side([left, right], ["a", "b"])
    assert page.shape == (3, 12 + 12, 20 + 4 + 8)
    assert torch.equal(page[:, 12:22, :20], left) and torch.equal(page[:, 12:24, 24:], right)
    with pytest.raises(ValueError, match=r"\b2 pictures.*\b1 captions"):
        side_by_side([left, right], ["a"])


def test_class_names_come_from_the_attribute_or_the_hparams():
    assert class_names_of(SimpleNamespace(class_names=("a", "b"))) == ["a", "b"]
    assert class_names_of(SimpleNamespace(hparams={"class_names": ["c"]})) == ["c"]
    assert class_names_of(SimpleNamespace(hparams={})) == []


# ------------------------------------------------------------------------------------------------ predict
def _writer_batch(n: int, ids: list[int]) -> tuple[tuple, list[dict]]:
    images = [torch.rand(3, 16, 16) for _ in range(n)]
    masks = torch.zeros(1, 16, 16, dtype=torch.bool)
    masks[0, 4:12, 4:12] = True
    dets = [
        {
            "image_id": i,
            "boxes": torch.tensor([[4.0, 4.0, 12.0, 12.0]]),
            "scores": torch.tensor([0.8]),
            "labels": torch.tensor([1]),
            "masks": masks,
        }
        for i in ids
    ]
    return (images, [{} for _ in range(n)]), dets


def test_writer_draws_the_first_images_only_and_not_outside_predict(tmp_path):
    writer = CocoPredictionWriter(tmp_path, num_images=3)
    batch, dets = _writer_batch(2, [5, 6])
    writer.write_on_batch_end(None, None, dets, None, batch, 0, 0)  # no predict run started: no pictures
    assert not (tmp_path / "predictions").exists() and len(writer._records) == 2
    writer.on_predict_start(SimpleNamespace(is_global_zero=True), None)
    for first in (5, 7, 9):
        batch, dets = _writer_batch(2, [first, first + 1])
        writer.write_on_batch_end(None, SimpleNamespace(class_names=["a"]), dets, None, batch, 0, 0)
    assert sorted(p.name for p in (tmp_path / "predictions").iterdir()) == ["5.png", "6.png", "7.png"]
    assert len(writer._records) == 6
    assert _png(tmp_path / "predictions" / "5.png").shape == (3, 256, 256)  # 16 px enlarged 16 times

    writer = CocoPredictionWriter(tmp_path / "none", num_images=0)
    writer.on_predict_start(SimpleNamespace(is_global_zero=True), None)
    writer.write_on_batch_end(None, None, dets, None, batch, 0, 0)
    assert not (tmp_path / "none" / "predictions").exists()


def test_writer_warns_about_a_picture_it_cannot_draw_and_keeps_the_records(tmp_path):
    writer = CocoPredictionWriter(tmp_path, num_images=4)
    writer.on_predict_start(SimpleNamespace(is_global_zero=True), None)
    batch, dets = _writer_batch(2, [1, 2])
    batch[0][0] = torch.rand(3, 8, 8)  # not the size the masks have
    with pytest.warns(DrawingWarning, match=r"1\.png.*ValueError.*\(1, 16, 16\)"):
        writer.write_on_batch_end(None, None, dets, None, batch, 0, 0)
    assert len(writer._records) == 2 and [p.name for p in (tmp_path / "predictions").iterdir()] == ["2.png"]


def test_writer_rejects_a_negative_image_count(tmp_path):
    with pytest.raises(ValueError, match=r"callbacks\.prediction_writer\.num_images=-1\b"):
        CocoPredictionWriter(tmp_path, num_images=-1)


def test_predict_draws_the_json_detections_onto_the_dataset_images(tmp_path):
    cfg = compose_config(
        [
            *SMOKE,
            "command=predict",
            "callbacks.prediction_writer.num_images=3",
            "callbacks.prediction_writer.image_score_threshold=null",
        ],
        tmp_path,
    )  # draw all the JSON has
    predict(cfg)
    dataset = build_datamodule(cfg).dataset("val")
    records = json.loads((tmp_path / "predictions.json").read_text())
    pictures = sorted((tmp_path / "predictions").iterdir())
    assert [p.name for p in pictures] == sorted(f"{i}.png" for i in dataset.image_ids[:3])
    for index in range(3):
        image, target = dataset[index]
        image_id = int(target["image_id"])
        drawn = _png(tmp_path / "predictions" / f"{image_id}.png")
        k = math.ceil(256 / image.shape[-1])
        assert drawn.shape == (3, image.shape[-2] * k, image.shape[-1] * k)
        masks = [
            mask_utils.decode({"size": r["segmentation"]["size"], "counts": r["segmentation"]["counts"]})
            for r in records
            if r["image_id"] == image_id
        ]
        assert masks, f"image {image_id}: no detection above the threshold to draw"
        under = _enlarged(torch.from_numpy(np.any(masks, axis=0)), k)
        assert under.sum() > 0
        differs = (drawn != _enlarged(image, k)).any(0)
        assert differs[under].float().mean() > 0.95  # masks are painted where predictions.json has them


# ------------------------------------------------------------------------------------------------ fit
def _fit(tmp_path: Path, *overrides: str, extra: tuple[Callback, ...] = ()):
    cfg = compose_config([*TINY_FIT, *overrides], tmp_path)
    datamodule = build_datamodule(cfg)
    model = build_model(cfg, datamodule)
    trainer = build_trainer(cfg)
    trainer.callbacks.extend(extra)
    trainer.fit(model, datamodule=datamodule)
    return trainer, datamodule


def _only(trainer, kind):
    (callback,) = [c for c in trainer.callbacks if isinstance(c, kind)]
    return callback


def test_fit_with_the_csv_logger_writes_validation_pngs_and_training_curves(tmp_path):
    trainer, datamodule = _fit(tmp_path)  # the default logger: CSV
    folder = tmp_path / "val_images" / "epoch000-step000002"
    dataset = datamodule.dataset("val")
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{i}.png" for i in dataset.image_ids[:4])
    image, target = dataset[0]
    page = _png(folder / f"{dataset.image_ids[0]}.png")
    ground_truth = draw_ground_truth(image, target, datamodule.class_names, min_side=256)
    assert page.shape == (3, 12 + 256, 2 * 256 + 4)
    assert torch.equal(page[:, 12:, :256], ground_truth)  # left: the annotations
    assert not torch.equal(page[:, 12:, 260:], _enlarged(image, 4))  # right: something predicted is drawn

    curves = _only(trainer, TrainingCurves)
    assert _png(tmp_path / "training_curves.png").shape[0] == 3
    logged = [
        float(row["train/loss"])
        for row in csv.DictReader((tmp_path / "logs" / "metrics.csv").open())
        if row.get("train/loss")
    ]
    assert [step for step, _ in curves.history["train/loss"]] == [
        1,
        2,
    ]  # log_every_n_steps=1 in the smoke run
    assert [value for _, value in curves.history["train/loss"]] == pytest.approx(logged, rel=1e-6)
    assert {"train/lr", "train/loss_mask", "val/segm_mAP", "val/bbox_mAP_50"} <= curves.history.keys()
    assert [step for step, _ in curves.history["val/segm_mAP"]] == [2] and curves.epoch_ends == [2]
    assert "val/bbox_mAP_small" not in curves.history  # no panel asks for it


def test_validate_after_fit_draws_too(tmp_path):
    """``train()`` scores the final weights with ``trainer.validate`` when the last epoch did not validate,
    and the ``validate`` command runs only that: both draw their pictures (the sanity check still draws none).
    """
    trainer, datamodule = _fit(tmp_path, "callbacks.validation_images.num_images=2")
    shutil.rmtree(tmp_path / "val_images")
    (tmp_path / "training_curves.png").unlink()
    trainer.validate(trainer.lightning_module, datamodule=datamodule, verbose=False)
    (folder,) = (tmp_path / "val_images").iterdir()
    ids = datamodule.dataset("val").image_ids[:2]
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{i}.png" for i in ids)
    # the training curves are drawn again with the final scoring's point (fit drew them before it)
    assert [step for step, _ in _only(trainer, TrainingCurves).history["val/segm_mAP"]] == [2, 2]
    assert _png(tmp_path / "training_curves.png").shape[0] == 3


def test_fit_with_tensorboard_logs_image_summaries_instead_of_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, datamodule = _fit(tmp_path, "logger=tensorboard", "callbacks.validation_images.num_images=2")
    assert not (tmp_path / "val_images").exists()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    ids = datamodule.dataset("val").image_ids[:2]
    assert sorted(events.Tags()["images"]) == sorted(f"val_images/{i}" for i in ids)
    (summary,) = events.Images(f"val_images/{ids[0]}")
    assert summary.step == 2 and (summary.width, summary.height) == (2 * 256 + 4, 12 + 256)
    assert (tmp_path / "training_curves.png").is_file()


class _Crash(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            raise RuntimeError("stopped on purpose")


def test_a_fit_that_stops_keeps_its_training_curves(tmp_path):
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        _fit(tmp_path, "trainer.limit_val_batches=0", "trainer.limit_train_batches=4", extra=(_Crash(),))
    assert _png(tmp_path / "training_curves.png").shape[0] == 3


def test_training_curves_survive_a_resume(tmp_path):
    first = TrainingCurves(tmp_path / "a.png")
    first.history = {"train/loss": [[1, 2.0], [2, 1.5]], "val/segm_mAP": [[2, 0.1]]}
    first.epoch_ends = [2]
    state = torch.load(_saved(first.state_dict(), tmp_path), weights_only=True)  # as checkpoints load
    resumed = TrainingCurves(tmp_path / "b.png")
    resumed.load_state_dict(state)
    assert resumed.history == first.history and resumed.epoch_ends == [2]
    assert resumed.write() == tmp_path / "b.png" and _png(tmp_path / "b.png").shape[0] == 3
    assert TrainingCurves(tmp_path / "c.png").write() is None and not (tmp_path / "c.png").exists()


def _saved(state: dict, tmp_path: Path) -> Path:
    torch.save(state, tmp_path / "state.pt")
    return tmp_path / "state.pt"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "callbacks.validation_images.num_images=-1",
            r"callbacks\.validation_images\.num_images=-1\b",
        ),
        ("callbacks.validation_images.png=maybe", r"callbacks\.validation_images\.png='maybe'"),
        (
            "callbacks.training_curves.every_n_steps=0",
            r"callbacks\.training_curves\.every_n_steps=0\b",
        ),
    ],
)
def test_bad_settings_fail_before_training_with_the_field_named(tmp_path, override, message):
    with pytest.raises(CONFIG_ERRORS, match=message):
        _fit(tmp_path, override)


def test_validation_images_only_draw_on_rank_zero_during_fit_and_validate(tmp_path):
    callback = ValidationImages(tmp_path)
    for rank_zero, sanity, fn, active in [
        (True, False, "fit", True),
        (False, False, "fit", False),
        (True, True, "fit", False),
        (True, False, "validate", True),
        (False, False, "validate", False),
        (True, False, "test", False),
    ]:
        trainer = SimpleNamespace(
            is_global_zero=rank_zero, sanity_checking=sanity, state=SimpleNamespace(fn=fn)
        )
        callback.on_validation_epoch_start(trainer, None)
        assert callback._active is active, (rank_zero, sanity, fn)
