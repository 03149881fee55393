"""A bare sync-free training step as one CUDA graph, timed against the same step eager: the capture of
``callbacks.cuda_graph`` (which does this inside Lightning, with the precision plugin) without the Trainer
around it.

Forward, backward and the fused SGD step of the ``speedups.sync_free`` Mask R-CNN on static input buffers
(fixed-size images, targets padded to ``--instances`` as ``data.pad_instances`` pads them) are captured with
``torch.cuda.graph`` after warm-up steps on a side stream, then replayed with other targets copied into the
buffers. Prints the eager and the replayed step's median. Without a GPU it runs the warm-up steps on the CPU
and stops before the capture.

    python tools/cuda_graph_step.py [--model maskrcnn_r50_fpn] [--size 800x1344] [--batch 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from lit_amp_det.bench.rows import compose
from lit_amp_det.data.coco import pad_instances
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.models.speedups import BinaryMaskPaste, ExtensionOps, SyncFree


def padded_targets(
    targets: Sequence[dict[str, Tensor]], instances: int, device: str
) -> list[dict[str, Tensor]]:
    """``targets`` padded to ``instances`` each, on ``device``: the step's static target buffers."""
    return [{k: v.to(device) for k, v in pad_instances(t, instances).items()} for t in targets]


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    images: list[Tensor],
    targets: list[dict[str, Tensor]],
) -> Tensor:
    optimizer.zero_grad(
        set_to_none=False
    )  # gradients stay in their buffers: the graph zeroes and refills them
    losses = model(images, targets)
    sum(losses.values()).backward()
    optimizer.step()
    return torch.stack([value.detach() for value in losses.values()])


def capture_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    images: list[Tensor],
    targets: list[dict[str, Tensor]],
    warmup: int = 3,
) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """The graph of one training step on these buffers, after ``warmup`` eager steps on a side stream (which
    compile the Triton kernels and create the optimizer state), and its static loss vector.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            _step(model, optimizer, images, targets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        losses = _step(model, optimizer, images, targets)
    return graph, losses


def _random_targets(
    batch: int, height: int, width: int, instances: int, generator: torch.Generator
) -> list[dict[str, Tensor]]:
    targets = []
    for _ in range(batch):
        count = int(torch.randint(1, instances + 1, (), generator=generator))
        corner = torch.rand(count, 2, generator=generator) * torch.tensor([width * 0.7, height * 0.7])
        size = (torch.rand(count, 2, generator=generator) * 0.25 + 0.05) * torch.tensor([width, height])
        boxes = torch.cat([corner, corner + size], 1)
        masks = torch.zeros(count, height, width, dtype=torch.uint8)
        for k, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
            masks[k, y1:y2, x1:x2] = 1
        targets.append(
            {"boxes": boxes, "labels": torch.randint(1, 7, (count,), generator=generator), "masks": masks}
        )
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="maskrcnn_r50_fpn")
    parser.add_argument("--size", default="800x1344", help="HEIGHTxWIDTH of every image (a fixed size)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--instances", type=int, default=20, help="targets padded to this many instances")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    height, width = (int(side) for side in args.size.split("x"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    node = compose([f"model={args.model}"]).model
    torch.manual_seed(0)
    model = build_detector(
        7,
        backbone={**node.backbone, "weights": None},
        transform={"min_size": min(height, width), "max_size": max(height, width)},
        rpn=dict(node.rpn),
        roi_heads=dict(node.roi_heads),
    )
    model = SyncFree(devices=["cpu", "cuda"])(BinaryMaskPaste()(ExtensionOps()(model))).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, fused=True)
    generator = torch.Generator().manual_seed(0)
    images = [torch.rand(3, height, width, generator=generator).to(device) for _ in range(args.batch)]
    batches = [
        padded_targets(
            _random_targets(args.batch, height, width, args.instances, generator), args.instances, device
        )
        for _ in range(2)
    ]
    if device == "cpu":
        for targets in batches:
            print("eager step on the CPU, losses", _step(model, optimizer, images, targets).tolist())
        print("no GPU: stopped before the capture")
        return
    eager = []
    for i in range(args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        _step(model, optimizer, images, batches[i % 2])
        torch.cuda.synchronize()
        eager.append(time.perf_counter() - started)
    static = batches[0]
    graph, losses = capture_step(model, optimizer, images, static)
    replayed = []
    for i in range(args.steps):
        for buffer, new in zip(static, batches[i % 2]):
            for key, value in buffer.items():
                value.copy_(new[key])
        torch.cuda.synchronize()
        started = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        replayed.append(time.perf_counter() - started)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} {height}x{width} batch "
        f"{args.batch}, fp32: eager step {statistics.median(eager) * 1e3:.1f} ms, one CUDA graph "
        f"{statistics.median(replayed) * 1e3:.1f} ms (medians of {args.steps}); last losses {losses.tolist()}"
    )


if __name__ == "__main__":
    main()
