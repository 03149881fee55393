"""Lightning data modules: any COCO-format folder, and the embedded synthetic "shapes" dataset.

:class:`CocoDataModule` reads a COCO-style tree through :class:`~lit_amp_det.data.coco.CocoInstances`;
:class:`ShapesDataModule` first generates the synthetic dataset into a cache directory and then runs the same
code, so the default path exercises the real COCO loader. Training batches come from a resumable,
deterministic sampler (:mod:`lit_amp_det.data.sampler`), so a run killed mid-epoch resumes onto the same
batches. Images stay ``uint8`` through the loader (less to pin and copy); the model converts them on the
device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lit_amp_det.data.coco import INVALID_BOX_MODES, CocoInstances, drop_crowd, pad_instances
from lit_amp_det.data.image_folder import ImageFolder
from lit_amp_det.data.sampler import (
    EvalShardSampler,
    ResumableBatchSampler,
    ResumableDataLoader,
    aspect_ratio_groups,
)
from lit_amp_det.data.shapes import SHAPE_CLASSES, ShapesSpec, ensure_shapes, shapes_dataset_dir
from lit_amp_det.data.transforms import RandomHorizontalFlip, collate_detection
from lit_amp_det.data.verify import BAD_IMAGE_MODES, check_folder, check_splits
from lit_amp_det.errors import ArgumentError
from lit_amp_det.settings import RENAMED_SETTINGS

__all__ = ["CocoDataModule", "ShapesDataModule"]

Split = Literal["train", "val", "test"]


class _SeededAugmentation(Dataset):
    """Applies training augmentation with the per-sample seed that the sampler's ``(index, seed)`` key
    carries.
    """

    def __init__(self, dataset: CocoInstances, transform: Any) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        index, seed = key
        image, target = self.dataset[index]
        return self.transform(image, target, generator=torch.Generator().manual_seed(seed))


class CocoDataModule(LightningDataModule):
    """Train/val/test/predict loaders over a COCO-format folder.

    Args:
        root: dataset folder that relative image and annotation paths are resolved against (only needed when a
            split with relative paths is read).
        train_images: image folder of the training split.
        train_annotations: ``instances_*.json`` of the training split.
        val_images: image folder of the validation split.
        val_annotations: ``instances_*.json`` of the validation split.
        test_images: image folder of the test split; ``None`` (with ``test_annotations``) reuses the
            validation split.
        test_annotations: ``instances_*.json`` of the test split, or ``None``.
        predict_split: which split ``predict`` runs on.
        predict_images: a folder of pictures without annotations that ``predict`` runs on instead of
            ``predict_split`` (relative to the working directory). The model's classes then come from its
            weights where they name them, else from the training annotations.
        batch_size: training images per batch and process.
        eval_batch_size: images per evaluation batch; ``None``: ``batch_size``.
        num_workers: ``DataLoader`` worker processes.
        pin_memory: ``DataLoader`` pinned memory.
        persistent_workers: keep the workers between epochs (with ``num_workers`` > 0).
        flip_prob: probability of a horizontal flip of a training image.
        aspect_ratio_grouping: batch portrait and landscape images separately (less padding).
        invalid_boxes: ``error`` stops at the first degenerate box with its file and annotation id; ``skip``
            drops such boxes and counts them.
        skip_empty_train: drop training images that have no annotations.
        allow_empty_train: accept a training split without a single (non-crowd) annotation, with a warning
            (negative-only data); by default ``fit`` stops before training, naming the file.
        with_masks: decode instance masks (``False`` for Faster R-CNN).
        sampler_seed: seed of the training sampler, from which the order of every epoch and each image's
            augmentation follow (``data.seed`` before).
        verify_images: decode every image a stage reads before it starts (cached by file size and
            modification time under ``verify_cache_dir``).
        bad_images: ``error`` stops with every unreadable image listed; ``skip`` leaves them out with a
            warning.
        verify_cache_dir: where ``verify_images`` caches what it checked; ``None``: ``$LIT_AMP_DET_CACHE``.
        pad_instances: pads every training target to this many instances, with a ``valid`` flag each, so that
            a step's shapes never change (for ``speedups.sync_free``: static inputs); ``None`` pads to the
            fixed-shape detector's ``speedups.sync_free.instances_per_image``, or keeps each image's count.

    Raises:
        ArgumentError: an unknown ``predict_split``, ``invalid_boxes`` or ``bad_images``.
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        train_images: str = "train2017",
        train_annotations: str = "annotations/instances_train2017.json",
        val_images: str = "val2017",
        val_annotations: str = "annotations/instances_val2017.json",
        test_images: str | None = None,
        test_annotations: str | None = None,
        predict_split: Split = "val",
        predict_images: str | os.PathLike | None = None,
        batch_size: int = 2,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        flip_prob: float = 0.5,
        aspect_ratio_grouping: bool = True,
        invalid_boxes: Literal["error", "skip"] = "error",
        skip_empty_train: bool = False,
        allow_empty_train: bool = False,
        with_masks: bool = True,
        sampler_seed: int = 0,
        verify_images: bool = True,
        bad_images: Literal["error", "skip"] = "error",
        verify_cache_dir: str | os.PathLike | None = None,
        pad_instances: int | None = None,
    ) -> None:
        super().__init__()
        if predict_split not in ("train", "val", "test"):
            raise ArgumentError("predict_split", predict_split, "is unknown; choose train, val or test")
        for name, value, modes in (
            ("invalid_boxes", invalid_boxes, INVALID_BOX_MODES),
            ("bad_images", bad_images, BAD_IMAGE_MODES),
        ):
            if value not in modes:
                raise ArgumentError(name, value, f"is unknown; choose {' or '.join(modes)}")
        self.root = Path(root).expanduser() if root is not None else None
        self.split_paths: dict[str, tuple[str, str]] = {
            "train": (train_images, train_annotations),
            "val": (val_images, val_annotations),
            "test": (test_images or val_images, test_annotations or val_annotations),
        }
        self.predict_split, self.predict_images = predict_split, predict_images
        self._predict_folder: ImageFolder | None = None
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        # no more loader workers than the CPUs this process may use (torch warns above). Clamped here, where
        # the data is loaded, not in the config: a sweep's config is composed on the submitting host, whose
        # CPUs say nothing about the node a job runs on (under SLURM, ``sched_getaffinity`` reports the task's
        # ``cpus_per_task``).
        if num_workers < 0:
            raise ArgumentError(
                "num_workers", num_workers, "is negative; use 0 to load in the training process"
            )
        try:
            available = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            available = os.cpu_count() or 1
        num_workers = min(int(num_workers), available)
        self.loader_options = dict(
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
        )
        self.flip = RandomHorizontalFlip(flip_prob)
        self.aspect_ratio_grouping, self.invalid_boxes = aspect_ratio_grouping, invalid_boxes
        self.skip_empty_train, self.allow_empty_train = skip_empty_train, allow_empty_train
        self.with_masks, self.sampler_seed, self.verify_images, self.bad_images = (
            with_masks,
            sampler_seed,
            verify_images,
            bad_images,
        )
        cache = verify_cache_dir or os.environ.get("LIT_AMP_DET_CACHE", "~/.cache/lit_amp_det")
        self.verify_cache_dir = Path(cache).expanduser()
        self._verified: set[str] = set()
        self.pad_instances = pad_instances
        self.datasets: dict[str, CocoInstances] = {}
        self.category_ids: list[int] | None = None
        self._train_loader: ResumableDataLoader | None = None
        self._resume_state: dict[str, int] | None = None

    def _path(self, relative: str, split: str, kind: str) -> Path:
        path = Path(relative).expanduser()
        if path.is_absolute():
            return path
        if self.root is None:
            raise ArgumentError(
                "root",
                None,
                f"is not set, and the {split} split's {kind} {relative!r} is a relative "
                f"path: set data.root=/path/to/dataset, or give {split}_{kind} as an absolute path "
                "(predict on data.predict_images reads no split when ckpt_path or model.weights names "
                "the model's classes)",
            )
        return self.root / path

    def dataset(self, split: Split) -> CocoInstances:
        """The split's dataset, built on first use with the category mapping of the first split built."""
        if split not in self.datasets:
            images, annotations = self.split_paths[split]
            dataset = CocoInstances(
                self._path(images, split, "images"),
                self._path(annotations, split, "annotations"),
                with_masks=self.with_masks,
                invalid_boxes=self.invalid_boxes,
                skip_empty=self.skip_empty_train and split == "train",
                category_ids=self.category_ids,
            )
            self.category_ids = self.category_ids or list(dataset.category_ids)
            self.datasets[split] = dataset
        return self.datasets[split]

    @property
    def num_classes(self) -> int:
        """Classes including background, read from the annotations (builds the first needed split)."""
        return self._reference_dataset().num_classes

    @property
    def class_names(self) -> list[str]:
        return list(self._reference_dataset().class_names)

    def _reference_dataset(self) -> CocoInstances:
        if not self.datasets:
            self.dataset("train")
        return next(iter(self.datasets.values()))

    def setup(self, stage: str | None = None) -> None:
        """Builds the splits ``stage`` needs (idempotent)."""
        needed: dict[str | None, Sequence[Split]] = {
            "fit": ("train", "val"),
            "validate": ("val",),
            "test": ("test",),
            "predict": () if self.predict_images is not None else (self.predict_split,),
            None: ("train", "val", "test"),
        }
        if stage == "predict" and self.predict_images is not None:
            folder = self.predict_folder()  # a folder that cannot be read fails before the model runs
            if (
                self.verify_images and "predict_images" not in self._verified
            ):  # so does any unreadable picture
                check_folder(folder, self.bad_images, self.verify_cache_dir)
                self._verified.add("predict_images")
        for split in needed[stage]:
            self.dataset(split)
        if stage == "fit" and not (train := self.dataset("train")).num_instances:
            # a training split with nothing to learn would run the whole schedule to mAP 0 without a word
            message = (
                f"the training split {train.annotation_file} has no annotations to learn from ({len(train)} "
                "images, 0 non-crowd annotations)"
            )
            if not self.allow_empty_train:
                raise ValueError(
                    f"{message}: training would run the whole schedule to mAP 0. Check data.root and "
                    "data.train_annotations; to train on negative images only, set "
                    "data.allow_empty_train=true"
                )
            rank_zero_warn(
                f"{message}; training anyway because data.allow_empty_train=true (negative-only data): "
                "the model will learn to detect nothing"
            )
        unverified = {split: self.dataset(split) for split in needed[stage] if split not in self._verified}
        if self.verify_images and unverified:  # before training: a corrupt file must not surface hours in
            check_splits(unverified, self.bad_images, self.verify_cache_dir)
        self._verified.update(unverified)

    def train_dataloader(self) -> ResumableDataLoader:
        dataset = self.dataset("train")
        groups = aspect_ratio_groups(dataset.aspect_ratios()) if self.aspect_ratio_grouping else None
        sampler = ResumableBatchSampler(
            len(dataset),
            self.batch_size,
            seed=self.sampler_seed,
            group_ids=groups,
        )
        if (
            self._resume_state
        ):  # before the loader exists, so even eagerly prefetching workers start at the right batch
            sampler.resume(self._resume_state["epoch"], self._resume_state["consumed_batches"])
            self._resume_state = None
        self._train_loader = ResumableDataLoader(
            _SeededAugmentation(dataset, self.flip),
            sampler,
            collate_fn=collate_detection,
            generator=torch.Generator().manual_seed(self.sampler_seed),  # keeps the global RNG untouched
            **self.loader_options,
        )
        return self._train_loader

    def _eval_loader(self, split: Split | ImageFolder) -> DataLoader:
        dataset = split if isinstance(split, ImageFolder) else self.dataset(split)
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            sampler=EvalShardSampler(len(dataset)),  # one shard per DDP rank; the whole split otherwise
            collate_fn=collate_detection,
            generator=torch.Generator().manual_seed(self.sampler_seed),
            **self.loader_options,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        """The ``predict_images`` folder when set, else the ``predict_split``."""
        return self._eval_loader(
            self.predict_folder() if self.predict_images is not None else self.predict_split
        )

    def predict_folder(self) -> ImageFolder:
        """The ``predict_images`` folder's dataset, built on first use."""
        if self.predict_images is None:
            raise ValueError("data.predict_images is not set: predict runs on data.predict_split")
        if self._predict_folder is None:
            self._predict_folder = ImageFolder(self.predict_images)
        return self._predict_folder

    def state_dict(self) -> dict[str, int]:
        """Training-order progress, saved in every checkpoint for exact mid-epoch resume."""
        return self._train_loader.state_dict() if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Lightning restores this before it builds the loaders; the next training loader resumes there."""
        self._resume_state = dict(state_dict) or None

    def padded_instance_count(self) -> int | None:
        """The instance count training targets are padded to: the model's
        (``speedups.sync_free.instances_per_image``, read from the trainer's module), else ``pad_instances``.

        Raises:
            ValueError: both are set, to different counts.
        """
        module = self.trainer.lightning_module if self.trainer is not None else None
        wanted = getattr(module, "instances_per_image", None)
        if wanted is None:
            return self.pad_instances
        if self.pad_instances is not None and self.pad_instances != wanted:
            raise ValueError(
                f"data.pad_instances={self.pad_instances} but the fixed-shape detector pads to "
                f"speedups.sync_free.instances_per_image={wanted}; set only the latter "
                "(data.pad_instances=null)"
            )
        return wanted

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Counts training batches the loop takes (exact mid-epoch resume), drops their crowd instances here,
        on the host (on a GPU each field's boolean index would make the step wait), and pads targets to
        ``pad_instances``.
        """
        if self.trainer is not None and self.trainer.training and self._train_loader is not None:
            self._train_loader.mark_consumed()
            images, targets = batch
            targets = [{k: v for k, v in drop_crowd(t).items() if k != "iscrowd"} for t in targets]
            count = self.padded_instance_count()
            if count is not None:
                targets = [pad_instances(t, count) for t in targets]
            batch = images, targets
        return batch


def _refuse_renamed_arguments(kwargs: dict[str, Any]) -> None:
    """Raises :class:`ArgumentError` for an argument under a setting's old name (``seed``, ``data_seed``),
    naming the new one, instead of Python's "unexpected keyword argument".
    """
    for old, new in RENAMED_SETTINGS.items():
        argument = old.removeprefix("data.")
        if argument in kwargs:
            renamed = new.removeprefix("data.")
            raise ArgumentError(argument, kwargs[argument], f"was renamed {renamed}: pass {renamed}= instead")


class ShapesDataModule(CocoDataModule):
    """The embedded synthetic dataset, generated into ``cache_dir`` on first use, then read as COCO.

    The generation defaults are :class:`~lit_amp_det.data.shapes.ShapesSpec`'s.

    Args:
        cache_dir: where generated datasets live; one sub-folder per set of generation parameters.
        train_size: images of the training split.
        val_size: images of the validation split.
        test_size: images of the test split.
        image_size: side of the square images in pixels.
        min_objects: fewest objects per image.
        max_objects: most objects per image (inclusive).
        min_object_size: smallest object diameter as a fraction of the image side.
        max_object_size: largest object diameter as a fraction of the image side.
        generation_seed: seed of the generated images and annotations (``data.data_seed`` before;
            ``sampler_seed`` seeds the training order).
        **kwargs: :class:`CocoDataModule` loader options.

    Raises:
        ArgumentError: an argument under its old name (``seed``, ``data_seed``), naming the new one.
    """

    classes = SHAPE_CLASSES

    def __init__(
        self,
        cache_dir: str | os.PathLike = "~/.cache/lit_amp_det",
        *,
        train_size: int = 800,
        val_size: int = 100,
        test_size: int = 100,
        image_size: int = ShapesSpec.image_size,
        min_objects: int = ShapesSpec.min_objects,
        max_objects: int = ShapesSpec.max_objects,
        min_object_size: float = ShapesSpec.min_size,
        max_object_size: float = ShapesSpec.max_size,
        generation_seed: int = ShapesSpec.seed,
        **kwargs: Any,
    ) -> None:
        _refuse_renamed_arguments(kwargs)
        self.spec = ShapesSpec(
            image_size=image_size,
            min_objects=min_objects,
            max_objects=max_objects,
            min_size=min_object_size,
            max_size=max_object_size,
            seed=generation_seed,
        )
        self.splits = {"train": train_size, "val": val_size, "test": test_size}
        self.cache_dir = Path(cache_dir).expanduser()
        paths = {
            f"{split}_{kind}": path
            for split in ("train", "val", "test")
            for kind, path in (
                ("images", f"images/{split}"),
                ("annotations", f"annotations/instances_{split}.json"),
            )
        }
        kwargs.setdefault("verify_cache_dir", self.cache_dir)
        super().__init__(shapes_dataset_dir(self.cache_dir, self.spec, splits=self.splits), **paths, **kwargs)

    def prepare_data(self) -> None:
        """Generates the dataset once (atomically; later runs reuse it), except when a Trainer predicts on
        ``predict_images`` (no split read; :meth:`dataset` generates it if the classes must come from the
        data).
        """
        if self.predict_images is not None and self.trainer is not None and self.trainer.predicting:
            return
        ensure_shapes(self.cache_dir, self.spec, splits=self.splits)

    def dataset(self, split: Split) -> CocoInstances:
        if not self.datasets:
            self.prepare_data()  # also when used outside a Trainer
        return super().dataset(split)
