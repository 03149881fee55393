"""Where a Mask R-CNN step makes the host wait for the device, counted on CPU tensors (issue 42's baseline).

For the tiny Mask R-CNN at 128x128, batch 2, seeded weights and data: one training step (forward, backward,
SGD step) and one inference call, with torchvision's ops, with lit_amp_det's (``ExtensionOps``), and with
lit_amp_det's ops and ``BinaryMaskPaste`` (the module's default on a CPU), and with ``SyncFree`` on top (the
default on CUDA). :class:`lit_amp_det.profiling.HostSyncs` counts every aten call that reads a value on the
host or sizes its output by the values; ``--sites`` lists them by call site. The graph breaks are
``torch._dynamo.explain``'s for the training forward and for inference (for ``SyncFree``, its
``forward_padded``: ``forward`` adds the one read of the detection counts).

    python tools/host_syncs.py [--sites]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.models.speedups import BinaryMaskPaste, ExtensionOps, SyncFree
from lit_amp_det.models.sync_free import is_fixed_shape
from lit_amp_det.profiling import HostSyncs


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_detector(
        7,
        backbone={"name": "resnet10", "fpn_channels": 32},
        transform={"min_size": 128, "max_size": 128},
        roi_heads={"box_head_width": 64, "mask_head_layers": [16]},
    )


def batch() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 128, 128, generator=g) for _ in range(2)]
    masks = torch.zeros(2, 128, 128, dtype=torch.uint8)
    masks[0, 10:60, 20:90], masks[1, 70:120, 30:100] = 1, 1
    target = {
        "boxes": torch.tensor([[20.0, 10.0, 90.0, 60.0], [30.0, 70.0, 100.0, 120.0]]),
        "labels": torch.tensor([1, 4]),
        "masks": masks,
    }
    return images, [target, copy.deepcopy(target)]


PACKAGE = Path(__file__).resolve().parents[1] / "lit_amp_det"


def package_sites(syncs: HostSyncs) -> dict[str, int]:
    """The syncs whose call site is lit_amp_det's own code, by ``path:line`` relative to the package."""
    sites: dict[str, int] = {}
    for (_, site), n in syncs.sites.items():
        path, line = site.rsplit(":", 1)
        if Path(path).is_relative_to(PACKAGE):
            key = f"{Path(path).relative_to(PACKAGE).as_posix()}:{line}"
            sites[key] = sites.get(key, 0) + n
    return sites


def count(model: torch.nn.Module, train: bool) -> HostSyncs:
    """Host syncs of one training step (from the forward's first op to the optimizer step's end) or inference
    call.
    """
    images, targets = batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1)  # the samplers draw from the global RNG
    model.train(train)
    with HostSyncs() as syncs:
        if train:
            sum(model(images, targets).values()).backward()
            optimizer.step()
        else:
            with torch.no_grad():
                model(images)
    return syncs


def graph_breaks(model: torch.nn.Module, train: bool) -> int:
    """Graph breaks ``torch.compile`` meets in the training forward (with targets) or in inference."""
    import torch._dynamo

    images, targets = batch()
    model.train(train)
    torch._dynamo.reset()
    torch.manual_seed(1)
    explain = torch._dynamo.explain(model.forward_padded if is_fixed_shape(model) else model)
    return (explain(images, targets) if train else explain(images)).graph_break_count


def variants() -> dict[str, torch.nn.Module]:
    plain = tiny_model()
    ext = ExtensionOps()(copy.deepcopy(plain))
    default = BinaryMaskPaste()(copy.deepcopy(ext))
    return {
        "torchvision ops": plain,
        "lit_amp_det ops": ext,
        "lit_amp_det ops + binary_mask_paste": default,
        "+ sync_free": SyncFree(devices=["cpu"])(copy.deepcopy(default)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", action="store_true", help="list the syncs by call site")
    args = parser.parse_args()
    print(
        "| model | host syncs, training step (in lit_amp_det/) | graph breaks, training forward "
        "| host syncs, inference (in lit_amp_det/) | graph breaks, inference |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, model in variants().items():
        counted = {
            train: count(model, train) for train in (True, False)
        }  # before explain changes the model's state
        cells = []
        for train, syncs in counted.items():
            ours = sum(package_sites(syncs).values())
            cells += [f"{syncs.total} ({ours})", str(graph_breaks(model, train))]
            if args.sites:
                print(f"\n{name}, {'training' if train else 'inference'}:\n{syncs.table()}\n")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
