"""A trained checkpoint's detections with ``speedups.sync_free`` against the dynamic path, on the embedded
validation split (issue 42's inference check): per image the same count and labels, the largest box
difference, the mask pixels that differ.

    python tools/sync_free_parity.py runs/fit/<run>/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse

import torch
from hydra.utils import instantiate

from lit_amp_det import MaskRCNNModule
from lit_amp_det.bench.rows import compose
from lit_amp_det.models.speedups import DEFAULT_SPEEDUPS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint")
    args = parser.parse_args()
    on_cpu = {**DEFAULT_SPEEDUPS, "sync_free": {**DEFAULT_SPEEDUPS["sync_free"], "devices": ["cpu", "cuda"]}}
    fixed = MaskRCNNModule.load_from_checkpoint(args.checkpoint, map_location="cpu", speedups=on_cpu)
    dynamic = MaskRCNNModule.load_from_checkpoint(
        args.checkpoint, map_location="cpu", speedups=DEFAULT_SPEEDUPS
    )
    for module in (fixed, dynamic):
        module.configure_model()
        module.eval()
    print("sync_free:", fixed.applied_speedups, "| dynamic:", dynamic.applied_speedups)
    data = instantiate(compose([]).data)
    data.setup("validate")
    images = same = pixels = total = 0
    worst = 0.0
    with torch.no_grad():
        for batch, _ in data.val_dataloader():
            for a, b in zip(fixed(batch), dynamic(batch)):
                images += 1
                if a["boxes"].shape != b["boxes"].shape or not torch.equal(a["labels"], b["labels"]):
                    print(
                        f"image {images - 1}: {a['boxes'].shape[0]} detections against {b['boxes'].shape[0]}"
                    )
                    continue
                same += 1
                if a["boxes"].numel():
                    worst = max(worst, float((a["boxes"] - b["boxes"]).abs().max()))
                pixels += int((a["masks"] != b["masks"]).sum())
                total += a["masks"].numel()
    print(
        f"{images} images: {same} with the same count and labels; largest box difference {worst:.2e}; "
        f"{pixels} of {total} mask pixels differ"
    )


if __name__ == "__main__":
    main()
