"""The resumable sampler: deterministic order, exact mid-epoch resume, grouping, sharding."""

from __future__ import annotations

import pytest
import torch

from lit_amp_det.data.sampler import ResumableBatchSampler, ResumableDataLoader, aspect_ratio_groups


def _epoch(sampler: ResumableBatchSampler, epoch: int) -> list[list[tuple[int, int]]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_order_is_a_function_of_seed_and_epoch() -> None:
    a, b = ResumableBatchSampler(23, 4, seed=3), ResumableBatchSampler(23, 4, seed=3)
    assert _epoch(a, 0) == _epoch(b, 0)
    assert _epoch(a, 1) != _epoch(a, 0)
    assert _epoch(ResumableBatchSampler(23, 4, seed=4), 0) != _epoch(b, 0)
    indices = sorted(i for batch in _epoch(a, 2) for i, _ in batch)
    assert indices == list(range(23))
    assert len(a) == 6


def test_sample_seeds_differ_per_epoch_and_index() -> None:
    sampler = ResumableBatchSampler(8, 8, seed=0)
    first = dict(_epoch(sampler, 0)[0])
    second = dict(_epoch(sampler, 1)[0])
    assert len(set(first.values())) == 8
    assert all(first[i] != second[i] for i in range(8))


def test_resume_skips_exactly_the_consumed_batches() -> None:
    full = _epoch(ResumableBatchSampler(30, 4, seed=1), 2)
    resumed = ResumableBatchSampler(30, 4, seed=1)
    resumed.resume(epoch=2, consumed_batches=3)
    resumed.set_epoch(2)  # Lightning calls this at the epoch start; the offset must survive it
    assert list(resumed) == full[3:]
    resumed.set_epoch(3)
    assert list(resumed) == _epoch(ResumableBatchSampler(30, 4, seed=1), 3)


def test_loader_state_counts_consumed_not_prefetched_batches() -> None:
    sampler = ResumableBatchSampler(10, 2, seed=0)
    loader = ResumableDataLoader(_KeyEcho(), sampler, collate_fn=lambda b: b)
    iterator = iter(loader)
    next(iterator), next(iterator), next(iterator)  # three fetched (one of them only prefetched)
    loader.mark_consumed(), loader.mark_consumed()
    state = loader.state_dict()
    assert state == {"epoch": 0, "consumed_batches": 2, "world_size": 1, "epoch_batches": 5}
    fresh = ResumableDataLoader(_KeyEcho(), ResumableBatchSampler(10, 2, seed=0), collate_fn=lambda b: b)
    fresh.load_state_dict(state)
    expected = _epoch(ResumableBatchSampler(10, 2, seed=0), 0)[2:]
    assert list(fresh) == expected
    assert fresh.state_dict() == state


def _loader_state(monkeypatch: pytest.MonkeyPatch, world: int, consumed: int) -> dict[str, int]:
    monkeypatch.setattr("lit_amp_det.data.sampler._distributed_rank_and_size", lambda: (0, world))
    loader = ResumableDataLoader(_KeyEcho(), ResumableBatchSampler(16, 2, seed=0), collate_fn=lambda b: b)
    for _ in range(consumed):
        loader.mark_consumed()
    return loader.state_dict()


@pytest.mark.parametrize(
    ("saved_world", "world", "consumed", "refused"),
    [
        (4, 2, 1, True),  # mid-epoch, fewer processes: the shares change
        (2, 4, 3, True),  # mid-epoch, more processes
        (4, 2, 2, False),  # the epoch's 2 batches (16 images / 4 / 2) were all consumed: any count resumes
        (4, 2, 0, False),  # nothing of the epoch consumed yet
        (4, 4, 1, False),  # the same count resumes anywhere, mid-epoch too
    ],
)
def test_a_mid_epoch_checkpoint_resumes_only_on_as_many_processes(
    monkeypatch: pytest.MonkeyPatch, saved_world: int, world: int, consumed: int, refused: bool
) -> None:
    state = _loader_state(monkeypatch, saved_world, consumed)
    monkeypatch.setattr("lit_amp_det.data.sampler._distributed_rank_and_size", lambda: (0, world))
    loader = ResumableDataLoader(_KeyEcho(), ResumableBatchSampler(16, 2, seed=0), collate_fn=lambda b: b)
    if refused:
        with pytest.raises(
            ValueError,
            match=rf"taken by {saved_world} processes.*trainer.num_nodes x "
            rf"trainer.devices = {saved_world}",
        ):
            loader.load_state_dict(state)
    else:
        loader.load_state_dict(state)
        assert loader.consumed_batches == consumed


def test_checkpoints_without_a_world_size_resume_as_before() -> None:
    loader = ResumableDataLoader(_KeyEcho(), ResumableBatchSampler(16, 2, seed=0), collate_fn=lambda b: b)
    loader.load_state_dict({"epoch": 1, "consumed_batches": 3})
    assert loader.state_dict()["consumed_batches"] == 3


class _KeyEcho(torch.utils.data.Dataset):
    """Returns the sampler's key itself, so the test sees exactly which samples were loaded."""

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int]:
        return key


def test_aspect_ratio_grouping_keeps_batches_homogeneous() -> None:
    ratios = [0.5, 2.0, 1.5, 0.7, 0.6, 1.0, 1.2, 0.8, 3.0, 0.9]
    groups = aspect_ratio_groups(ratios)
    sampler = ResumableBatchSampler(len(ratios), 2, seed=0, group_ids=groups)
    batches = _epoch(sampler, 0)
    assert sum(len(b) == 2 for b in batches) >= 3
    assert all(len({groups[i] for i, _ in b}) == 1 for b in batches)
    assert sorted(i for b in batches for i, _ in b) == list(range(len(ratios)))


def test_training_shards_are_equal_sized_and_cover_every_sample_padding_with_repeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10 samples over 3 ranks: 4 each, so that every rank runs the same number of steps; the 2 extra slots
    repeat samples (training shards overlap there; evaluation shards, EvalShardSampler, never do).
    """
    seen = []
    for rank in range(3):
        monkeypatch.setattr("lit_amp_det.data.sampler._distributed_rank_and_size", lambda r=rank: (r, 3))
        seen.append([i for batch in _epoch(ResumableBatchSampler(10, 2, seed=5), 0) for i, _ in batch])
    assert [len(s) for s in seen] == [4, 4, 4]
    everything = seen[0] + seen[1] + seen[2]
    assert set(everything) == set(range(10))
    assert len(everything) - len(set(everything)) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset_size": 0, "batch_size": 2}, "training split is empty"),
        ({"dataset_size": 4, "batch_size": 0}, r"data\.batch_size\b"),
        ({"dataset_size": 4, "batch_size": 2, "group_ids": [0]}, r"group_ids .*1 entries"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResumableBatchSampler(**kwargs)


def test_sampler_leaves_global_rng_untouched() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    _epoch(ResumableBatchSampler(50, 4, seed=0), 0)
    assert torch.equal(before, torch.get_rng_state())
