"""Inference latency of the exported detector against the eager model on this machine's CPU (issue 44's
benchmark): the eager module (its default CPU speedups), the same weights' fixed-shape graph in eager PyTorch,
the ``.pt2`` program and onnxruntime (CPU provider). Rows are interleaved, every repeat runs each row once on
the same batch; the table gives the median time per batch and the ratio to the eager module.

    python tools/export_bench.py                                      # light model, 224 px, batch 1 python
    tools/export_bench.py model=maskrcnn_r50_fpn model.backbone.weights=null --size 800 1333 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra.utils import instantiate

from lit_amp_det.bench.rows import compose
from lit_amp_det.deploy import deployed_detector, export_detector


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="config overrides (the model to export)")
    parser.add_argument(
        "--size", type=int, nargs=2, default=None, help="image height and width (default: the model's)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    import onnxruntime as ort

    torch.manual_seed(0)
    cfg = compose(args.overrides)
    module = instantiate(cfg.model, num_classes=7)
    module.configure_model()
    module.eval()
    transform = module.model.transform
    height, width = args.size or (transform.min_size[-1], transform.max_size)
    images = torch.randint(0, 256, (args.batch, 3, height, width), dtype=torch.uint8)
    folder = Path(tempfile.mkdtemp())
    export_detector(module, folder / "model.onnx", "onnx", sample=images)
    program = export_detector(module, folder / "model.pt2", "pt2", sample=images).module()
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    fixed = deployed_detector(module)
    rows = {
        "eager module": lambda: module(list(images)),
        "eager fixed-shape graph": lambda: fixed(images),
        "pt2 program": lambda: program(images),
        "onnxruntime": lambda: session.run(None, {"images": images.numpy()}),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    with torch.no_grad():
        for repeat in range(args.warmup + args.repeats):
            for name, run in rows.items():
                started = time.perf_counter()
                run()
                if repeat >= args.warmup:
                    times[name].append(time.perf_counter() - started)
    base = statistics.median(times["eager module"])
    print(
        f"torch {torch.__version__}, onnxruntime {ort.__version__}, {torch.get_num_threads()} threads, "
        f"batch {args.batch} x {height}x{width}, {args.repeats} interleaved repeats"
    )
    print("| row | median ms / batch | vs eager |\n|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
