"""Images are decoded before a run starts: every bad file listed in one error, a skip switch, and a cache."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import lit_amp_det.data.verify as verify
from conftest import run_cli
from lit_amp_det.data import CocoDataModule, ShapesDataModule
from lit_amp_det.data.verify import BadImagesError, verify_images

SPLITS = {
    f"{split}_{kind}": path
    for split in ("train", "val", "test")
    for kind, path in (("images", f"images/{split}"), ("annotations", f"annotations/instances_{split}.json"))
}


@pytest.fixture()
def damaged(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A small shapes dataset with a truncated JPEG and a garbage file in val, a truncated PNG in train."""
    # its own cache: other tests expect one generated dataset in the session's cache
    source = ShapesDataModule(
        tmp_path / "generated", train_size=16, val_size=8, test_size=8, image_size=64, verify_images=False
    )
    source.prepare_data()
    root = tmp_path / "coco"
    shutil.copytree(source.root, root)
    array = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    jpeg = io.BytesIO()
    Image.fromarray(array).save(jpeg, "JPEG")
    val = sorted((root / "images" / "val").iterdir())
    train = sorted((root / "images" / "train").iterdir())
    val[1].write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])  # truncated JPEG
    val[4].write_bytes(b"not an image")
    train[2].write_bytes(train[2].read_bytes()[:200])  # truncated PNG
    return root, [train[2], val[1], val[4]]


def _module(root: Path, tmp_path: Path, **kwargs) -> CocoDataModule:
    return CocoDataModule(root, **SPLITS, verify_cache_dir=tmp_path / "verified", **kwargs)


def test_every_unreadable_image_of_the_stage_is_listed_in_one_error(damaged, tmp_path: Path) -> None:
    root, bad = damaged
    with pytest.raises(BadImagesError) as err:
        _module(root, tmp_path).setup("fit")
    message = str(err.value)
    assert message.startswith("3 of 24 images cannot be used")
    for path in bad:
        assert str(path) in message
    assert "data.bad_images=skip" in message
    with pytest.raises(BadImagesError, match="2 of 8 images"):  # validate reads only val
        _module(root, tmp_path).setup("validate")


def test_skip_leaves_bad_images_out_with_a_warning(damaged, tmp_path: Path, caplog) -> None:
    root, _ = damaged
    module = _module(root, tmp_path, bad_images="skip")
    with caplog.at_level("WARNING", logger="lit_amp_det.data.verify"):
        module.setup("fit")
    assert len(module.dataset("train")) == 15 and len(module.dataset("val")) == 6
    assert "left out 2 unreadable image(s) of the val split" in caplog.text
    image, _ = module.dataset("val")[1]  # indices now skip the bad files
    assert image.shape[0] == 3


def test_second_check_reads_nothing_and_a_changed_file_is_read_again(
    damaged, tmp_path: Path, monkeypatch
) -> None:
    root, _ = damaged
    good = sorted((root / "images" / "test").iterdir())
    items = [(str(p), None) for p in good]
    reads: list[str] = []
    real = verify.read_rgb_image
    monkeypatch.setattr(verify, "read_rgb_image", lambda path: reads.append(path) or real(path))
    assert verify_images(items, tmp_path / "cache") == {}
    assert len(reads) == len(good) == 8
    reads.clear()
    assert verify_images(items, tmp_path / "cache") == {}
    assert reads == []  # cached by path, size and modification time
    stat = good[0].stat()
    os.utime(good[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert verify_images(items, tmp_path / "cache") == {}
    assert reads == [str(good[0])]


@pytest.mark.slow
def test_fit_with_a_corrupt_val_image_stops_before_training(damaged, tmp_path: Path) -> None:
    root, bad = damaged
    args = [
        "fit",
        "model=maskrcnn_tiny",
        "trainer.max_epochs=1",
        "data=coco",
        f"data.root={root}",
        "data.num_workers=0",
        *(f"data.{key}={value}" for key, value in SPLITS.items() if not key.startswith("test")),
    ]
    proc = run_cli(args, cwd=tmp_path, check=False)
    assert proc.returncode != 0
    for path in bad:
        assert str(path) in proc.stderr
    (run_dir,) = (tmp_path / "runs" / "fit").iterdir()
    assert not (run_dir / "checkpoints").exists() and "step 1" not in proc.stdout


def test_the_checks_name_an_unknown_mode_before_reading_anything(tmp_path: Path) -> None:
    """``check_splits`` / ``check_folder`` called directly (not through the data module, which checks
    ``data.bad_images`` itself) refuse a mode they do not know before decoding a file.
    """
    from lit_amp_det.data.image_folder import ImageFolder
    from lit_amp_det.errors import ArgumentError

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    with pytest.raises(ArgumentError, match=r"^mode='ignore' "):
        verify.check_folder(ImageFolder(tmp_path), "ignore", tmp_path / "cache")
    with pytest.raises(ArgumentError, match=r"^mode='warn' "):
        verify.check_splits({}, "warn", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
