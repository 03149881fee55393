"""Deterministic, resumable training batches with optional aspect-ratio grouping.

Exact mid-epoch resume needs what the stock ``DataLoader`` lacks: an epoch order that is a pure function of
(seed, epoch), augmentation independent of the loading worker, and a count of the batches the loop consumed
(not prefetched). :class:`ResumableBatchSampler` shards ``(index, sample_seed)`` keys over ranks (so
``use_distributed_sampler=False``); :class:`ResumableDataLoader` adds Lightning's
``state_dict``/``load_state_dict`` protocol to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

__all__ = [
    "EpochSampler",
    "EvalShardSampler",
    "ResumableBatchSampler",
    "ResumableDataLoader",
    "aspect_ratio_groups",
]

SampleKey = tuple[int, int]


def aspect_ratio_groups(aspect_ratios: Sequence[float]) -> list[int]:
    """Group id per image: 0 for portrait (w < h), 1 for landscape or square, as Detectron does."""
    return [int(ratio >= 1.0) for ratio in aspect_ratios]


def _distributed_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _splitmix64(value: int) -> int:
    """SplitMix64 finaliser: a cheap, well-mixed 64-bit hash for deriving per-sample seeds."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return value ^ (value >> 31)


class EvalShardSampler(Sampler[int]):
    """Evaluation order for this rank: every ``world``-th image from ``rank``, no padding, no shuffling. Each
    image is scored exactly once across the ranks (the metrics and the prediction writer gather the ranks'
    results), unlike padded training shards, whose repeated images would be counted twice.
    """

    def __init__(self, dataset_size: int) -> None:
        self.dataset_size = dataset_size

    def __iter__(self) -> Iterator[int]:
        rank, world = _distributed_rank_and_size()
        return iter(range(rank, self.dataset_size, world))

    def __len__(self) -> int:
        rank, world = _distributed_rank_and_size()
        return len(range(rank, self.dataset_size, world))


class EpochSampler(Sampler[int]):
    """This rank's sample indices for one epoch: a permutation drawn from ``seed + epoch``, sharded by rank.
    Lightning calls :meth:`set_epoch` on ``dataloader.batch_sampler.sampler`` at every epoch start.
    """

    def __init__(self, dataset_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_size < 1:
            raise ValueError(f"the training split is empty (dataset_size={dataset_size}); check data.root")
        self.dataset_size, self.seed, self.shuffle, self.epoch = dataset_size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        rank, world = _distributed_rank_and_size()
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        per_rank = -(-self.dataset_size // world)
        order += order[: per_rank * world - len(order)]  # pad so every rank gets the same count
        return iter(order[rank::world])

    def __len__(self) -> int:
        return -(-self.dataset_size // _distributed_rank_and_size()[1])


class ResumableBatchSampler(Sampler[list[SampleKey]]):
    """Batches of ``(dataset_index, sample_seed)`` keys over an :class:`EpochSampler`, resumable mid-epoch.

    Args:
        dataset_size: number of samples.
        batch_size: samples per batch on each rank.
        seed: base seed; epoch ``e`` uses the permutation drawn from ``seed + e``.
        group_ids: optional group per sample; a batch then holds samples of one group only
            (aspect-ratio grouping keeps padding small).
        drop_last: drop the last incomplete batch of the epoch.
        shuffle: shuffle (training) or keep dataset order.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        seed: int = 0,
        group_ids: Sequence[int] | None = None,
        drop_last: bool = False,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if group_ids is not None and len(group_ids) != dataset_size:
            raise ValueError(f"group_ids has {len(group_ids)} entries for {dataset_size} samples")
        self.sampler = EpochSampler(dataset_size, seed=seed, shuffle=shuffle)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.group_ids = list(group_ids) if group_ids is not None else None
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches already consumed in it)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def resume(self, epoch: int, consumed_batches: int) -> None:
        """Makes the next iteration of ``epoch`` start after ``consumed_batches`` batches."""
        self.sampler.set_epoch(epoch)
        self._resume_at = (epoch, consumed_batches)

    def _batches(self) -> list[list[int]]:
        indices = list(self.sampler)
        if self.group_ids is None:
            batches = [indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        else:
            batches, buckets = [], {}
            for index in indices:
                bucket = buckets.setdefault(self.group_ids[index], [])
                bucket.append(index)
                if len(bucket) == self.batch_size:
                    batches.append(bucket.copy())
                    bucket.clear()
            batches += [bucket for _, bucket in sorted(buckets.items()) if bucket]  # partial, still one group
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __iter__(self) -> Iterator[list[SampleKey]]:
        skip = self._resume_at[1] if self._resume_at is not None and self._resume_at[0] == self.epoch else 0
        self._resume_at = None
        for batch in self._batches()[skip:]:
            # one seed per (seed, epoch, index), independent of worker, rank and Python's hash randomisation
            epoch_seed = _splitmix64(_splitmix64(self.sampler.seed) ^ self.epoch)
            yield [(index, _splitmix64(epoch_seed ^ index) >> 1) for index in batch]

    def __len__(self) -> int:
        return len(self._batches())


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableBatchSampler` that Lightning can checkpoint mid-epoch.
    Lightning prefetches a batch ahead, so "batches yielded" overstates progress; the count kept here is
    advanced by :meth:`mark_consumed`, which the data module calls when the training loop takes a batch.
    """

    def __init__(self, dataset: Any, batch_sampler: ResumableBatchSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.consumed_batches, self._consumed_epoch = 0, batch_sampler.epoch

    def mark_consumed(self) -> None:
        """Records that the training loop took one more batch of the current epoch."""
        sampler: ResumableBatchSampler = self.batch_sampler  # type: ignore[assignment]
        if sampler.epoch != self._consumed_epoch:
            self._consumed_epoch, self.consumed_batches = sampler.epoch, 0
        self.consumed_batches += 1

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._consumed_epoch,
            "consumed_batches": self.consumed_batches,
            "world_size": _distributed_rank_and_size()[1],
            "epoch_batches": len(self.batch_sampler),
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continues the saved epoch after its consumed batches. Each epoch's order depends on the seed and
        epoch alone, and each of W processes takes every W-th image of it; so a checkpoint taken between
        epochs resumes on any number of processes. One taken mid-epoch resumes only on as many processes as
        saved it: with another count the shares change and images would be seen twice or not at all.
        Checkpoints without a ``world_size`` are not checked.
        """
        saved_world, world = int(state_dict.get("world_size", 0)), _distributed_rank_and_size()[1]
        consumed, epoch_batches = int(state_dict["consumed_batches"]), int(state_dict.get("epoch_batches", 0))
        if saved_world and saved_world != world and 0 < consumed < epoch_batches:
            raise ValueError(
                f"this checkpoint was taken by {saved_world} processes in the middle of epoch "
                f"{state_dict['epoch']} ({consumed} of {epoch_batches} batches); resuming with {world} "
                f"processes (trainer.num_nodes x trainer.devices) would see some of its images twice and "
                f"others not at all. Resume with trainer.num_nodes x trainer.devices = {saved_world}, or "
                f"from a checkpoint taken at the end of an epoch"
            )
        self._consumed_epoch, self.consumed_batches = int(state_dict["epoch"]), consumed
        self.batch_sampler.resume(self._consumed_epoch, self.consumed_batches)  # type: ignore[union-attr]
