"""``predict`` on a folder of pictures without annotations (``data.predict_images``): which files are read, in
which order and under which ids, and the errors that name the folder or file (the CLI run: ``test_cli.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lit_amp_det.data.datamodule import ShapesDataModule
from lit_amp_det.data.image_folder import ImageFolder


def pictures_folder(folder: Path) -> dict[str, tuple[int, int]]:
    """Three pictures of different sizes and formats, plus files and a sub-folder that are not read."""
    folder.mkdir(parents=True)
    sizes = {"b_night.png": (48, 64), "a_street.JPG": (40, 72), "c_scan.bmp": (64, 64)}
    rng = np.random.default_rng(0)
    for name, (height, width) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("not a picture")
    (folder / "nested").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(folder / "nested" / "deeper.png")
    return sizes


def test_the_folder_s_pictures_in_name_order_with_ids_from_one(tmp_path: Path) -> None:
    sizes = pictures_folder(tmp_path / "pictures")
    dataset = ImageFolder(tmp_path / "pictures")
    assert [p.name for p in dataset.files] == sorted(sizes)  # no .txt, nothing from the sub-folder
    for index, name in enumerate(sorted(sizes)):
        image, target = dataset[index]
        assert image.dtype == torch.uint8 and tuple(image.shape) == (3, *sizes[name])
        assert int(target["image_id"]) == index + 1 and target["file_name"] == name
        assert target["image_id"].dtype == torch.int64


@pytest.mark.parametrize("case", ["missing", "a_file", "no_pictures"])
def test_a_folder_that_cannot_be_read_names_the_setting(tmp_path: Path, case: str) -> None:
    path = tmp_path / "pictures"
    if case == "a_file":
        path.write_text("x")
    elif case == "no_pictures":
        path.mkdir()
        (path / "readme.md").write_text("x")
    expected = {"missing": "does not exist", "a_file": "is a file", "no_pictures": "holds no pictures"}[case]
    with pytest.raises(FileNotFoundError, match=rf"data.predict_images='{path}' {expected}"):
        ImageFolder(path)


def test_a_corrupt_picture_is_named_when_read(tmp_path: Path) -> None:
    pictures_folder(tmp_path / "pictures")
    (tmp_path / "pictures" / "d_broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    dataset = ImageFolder(tmp_path / "pictures")
    with pytest.raises(OSError, match="d_broken.jpg"):
        dataset[3]


def test_the_data_module_predicts_the_folder_not_the_split(tmp_path: Path) -> None:
    pictures_folder(tmp_path / "pictures")
    datamodule = ShapesDataModule(
        tmp_path / "cache",
        train_size=4,
        val_size=2,
        test_size=2,
        image_size=64,
        predict_images=str(tmp_path / "pictures"),
        verify_images=False,
    )
    datamodule.setup("predict")
    assert "val" not in datamodule.datasets  # the predict split is neither built nor verified
    images, targets = next(iter(datamodule.predict_dataloader()))
    assert len(targets) == len(images) == 2  # eval_batch_size: the first two pictures in name order
    assert [t["file_name"] for t in targets] == ["a_street.JPG", "b_night.png"]
    assert datamodule.num_classes == 7  # the class list still comes from the training annotations


def test_without_a_folder_predict_runs_on_the_split(tmp_path: Path) -> None:
    datamodule = ShapesDataModule(
        tmp_path / "cache", train_size=4, val_size=2, test_size=2, image_size=64, verify_images=False
    )
    datamodule.setup("predict")
    assert "val" in datamodule.datasets and len(datamodule.predict_dataloader().dataset) == 2
    with pytest.raises(ValueError, match=r"data\.predict_images\b"):
        datamodule.predict_folder()


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp"])
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_a_picture_stored_sideways_is_read_as_a_viewer_shows_it(
    tmp_path: Path, suffix: str, orientation: int
) -> None:
    """EXIF orientation (3: upside down, 6 and 8: a quarter turn), as PIL's ``exif_transpose`` applies it; for
    a WebP too, whose tag torchvision's decoder ignores. Annotated datasets keep the stored pixels.
    """
    from PIL import ImageOps

    from lit_amp_det.data.image_io import read_rgb_image

    (tmp_path / "pictures").mkdir()
    path = tmp_path / "pictures" / f"phone{suffix}"
    stored = np.random.default_rng(orientation).integers(0, 256, (40, 72, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(stored).save(path, exif=exif)
    with Image.open(path) as raw:
        shown = torch.from_numpy(np.array(ImageOps.exif_transpose(raw).convert("RGB"))).permute(2, 0, 1)
        decoded = torch.from_numpy(np.array(raw.convert("RGB"))).permute(2, 0, 1)
    assert tuple(shown.shape) == ((3, 40, 72) if orientation == 3 else (3, 72, 40))
    image, _ = ImageFolder(tmp_path / "pictures")[0]
    assert torch.equal(image, shown)
    assert torch.equal(read_rgb_image(path), decoded)  # the default: as stored


def _folder_with_a_broken_picture(tmp_path: Path) -> Path:
    pictures_folder(tmp_path / "pictures")
    (tmp_path / "pictures" / "b_broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return tmp_path / "pictures"


def test_an_unreadable_picture_stops_predict_before_the_model_runs(tmp_path: Path) -> None:
    from lit_amp_det.data.verify import BadImagesError

    folder = _folder_with_a_broken_picture(tmp_path)
    datamodule = ShapesDataModule(
        tmp_path / "cache", train_size=4, val_size=2, test_size=2, image_size=64, predict_images=str(folder)
    )
    with pytest.raises(
        BadImagesError,
        match=r"(?s)1 of 4 images.*b_broken\.jpg"
        r".*Replace these files or move them out of the folder, or set "
        r"data.bad_images=skip",
    ):
        datamodule.setup("predict")
    import pickle

    error = BadImagesError({"x.jpg": "cannot read"}, 3, "Replace these files")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # crosses DDP ranks and loader workers whole


def test_bad_images_skip_leaves_the_picture_out_and_keeps_the_ids(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _folder_with_a_broken_picture(tmp_path)
    datamodule = ShapesDataModule(
        tmp_path / "cache",
        train_size=4,
        val_size=2,
        test_size=2,
        image_size=64,
        predict_images=str(folder),
        bad_images="skip",
    )
    datamodule.setup("predict")
    assert "left out 1 unreadable picture(s) of" in caplog.text and "b_broken.jpg" in caplog.text
    dataset = datamodule.predict_folder()
    assert [dataset[k][1]["file_name"] for k in range(len(dataset))] == [
        "a_street.JPG",
        "b_night.png",
        "c_scan.bmp",
    ]
    assert [int(dataset[k][1]["image_id"]) for k in range(len(dataset))] == [1, 3, 4]  # b_broken.jpg was id 2
    (folder / "b_broken.jpg").write_bytes(b"")  # nothing left to read at all
    for name in ("a_street.JPG", "b_night.png", "c_scan.bmp"):
        (folder / name).write_bytes(b"")
    from lit_amp_det.data.verify import BadImagesError

    with pytest.raises(BadImagesError, match="4 of 4 images"):
        ShapesDataModule(
            tmp_path / "cache",
            train_size=4,
            val_size=2,
            test_size=2,
            image_size=64,
            predict_images=str(folder),
            bad_images="skip",
        ).setup("predict")
