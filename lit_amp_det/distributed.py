"""Distributed helpers the library needs at evaluation time (launch plumbing is in
:mod:`lit_amp_det.app.launch`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["gather_list_states"]


def gather_list_states(metric: Any) -> None:
    """Gives every rank the list states (per-image detections and targets) of all ranks, in rank order.

    torchmetrics gathers list states element by element, which needs the same number of images on every rank;
    evaluation shards (:class:`~lit_amp_det.data.sampler.EvalShardSampler`) differ by one image when the split
    does not divide evenly, and padding them would score some images twice. ``all_gather_object`` has no such
    limit. Call it before ``compute()`` on a metric built with ``sync_on_compute=False``; a no-op in a single
    process.
    """
    import torch.distributed as dist
    from lightning.pytorch.utilities import move_data_to_device

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    names = [name for name, default in metric._defaults.items() if isinstance(default, list)]
    local = {
        name: move_data_to_device(list(getattr(metric, name)), "cpu") for name in names
    }  # tensors or RLE tuples
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    for name in names:
        setattr(
            metric, name, move_data_to_device([item for part in parts for item in part[name]], metric.device)
        )
