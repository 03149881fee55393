"""Paired A/B of a CPU change inside a training step: one model in one state, steps alternating between the
change's two arms in one process.

``--change weight-transforms``: the matrix-product weight transforms of commit be19dda (A) against the C++ kernels
(B). ``--change size-rule``: the fp32 size rule of commit 10865c7 (A: >= 128 2x2 tiles, channels x tiles
>= 32768, F(4x4) on every such layer of ``output_tile=4``) against the current one (B: >= 64 tiles, >= 16384
channel-tiles, F(4x4) from ``F4_MIN_TILES`` tiles). ``--change fp32-deconv``: the mask upsampling
(``model.deconv_as_matmul=true``, which the Winograd rows carry) in fp32 by oneDNN's transposed convolution (A) or
as one matmul (B, what ``FP32_MATMUL_CAPABILITIES`` CPUs take). ``--change all``: the three at once (A: the
step as of commit be19dda). ``--change memory-order-views``: the row's fused SGD as ``torch.optim.SGD`` with the
alignment pre-hook (A) or as ``lit_amp_det.optim.SGD``, stepping channels_last tensors through memory-order views
without PyTorch's gradient copy (B); one optimizer, its step swapped per step.

``--change linear-gradient-layout``: the box head's weight gradients handed to autograd transposed (A) or in the
weights' layout (B).

``--change split-vector-rule``: fp16/bf16 Winograd tiles from ``MIN_TILES`` (A: the full-width rule) or from
``SPLIT_VECTOR_MIN_TILES`` (B: the rule of a CPU that splits its 512-bit vectors), whatever this CPU is.

``--against ROW``: no code change; two ``bench train`` rows' models side by side instead (A: ``ROW``'s, B:
``--row``'s), the ratio of the best row to torchvision fp32 eager without the +-15 % drift between processes. Each
model gets its own optimizer of its row's config; both load the same cached trained state and step on the same batch
at the state's final learning rate, as the bench's rows do.

A step's time on a shared 2-core CPU drifts by more than such a change saves (+-15 % between processes), so the two
arms run in the same process, A B / B A alternately, and the paired differences are reported. The model is a
``bench train`` row's, built from the bench's cached trained state (made here if missing).

    python examples/paired_step_ab.py --change weight-transforms --row winograd-4x4 --pairs 120
    python examples/paired_step_ab.py --change weight-transforms --model maskrcnn_r50_fpn --size 256 --batch 2 \
        --pairs 40
    python examples/paired_step_ab.py --change size-rule --row winograd-4x4 --pairs 120
    python examples/paired_step_ab.py --change fp32-deconv --row winograd-4x4 --pairs 100
    python examples/paired_step_ab.py --change all --row winograd-4x4 --pairs 120
    python examples/paired_step_ab.py --against torchvision-fp32 --row winograd-4x4 --pairs 60
    python examples/paired_step_ab.py --change linear-gradient-layout --row pointwise-matmul --precision bf16 \
        --model maskrcnn_r50_fpn --size 256 --batch 2 --pairs 40
    python examples/paired_step_ab.py --change split-vector-rule --row winograd --precision bf16 \
        --model maskrcnn_r50_fpn --size 256 --batch 2 --pairs 40
    python examples/paired_step_ab.py --against torchvision-fp32 --row winograd --precision bf16 \
        --model maskrcnn_r50_fpn --size 256 --batch 2 --pairs 12
    python examples/paired_step_ab.py --change memory-order-views --row winograd-4x4 --pairs 100
    python examples/paired_step_ab.py --change memory-order-views --row winograd-4x4 --optimizer-only --pairs 200
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import lit_amp_det.models.bounded_matmul as bounded_matmul
import lit_amp_det.models.patch_deconv as patch_deconv
import lit_amp_det.models.winograd_conv as winograd_conv
from lit_amp_det.bench import e2e, e2e_rows, train
from lit_amp_det.ops import winograd
from lit_amp_det.ops.reference import _WINOGRAD_G, _WINOGRAD_GRAD_AT
from lit_amp_det import optim

_BUFFERS: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def matmul_weight_tiles(weight: torch.Tensor, transposed: bool = False, out: torch.Tensor | None = None,
                        output_tile: int = 2) -> torch.Tensor:
    """A: ``kron(G, G) @ filters`` into a kept buffer, the forward's operand a transposed view (be19dda)."""
    kron = torch.kron(*[torch.tensor(_WINOGRAD_G[output_tile], dtype=weight.dtype)] * 2)
    kron = kron.flip(1) if transposed else kron
    c_out, c_in = weight.shape[:2]
    key = (kron.shape[0], c_out * c_in, weight.dtype)
    flat = _BUFFERS.setdefault(key, torch.empty(key[:2], dtype=weight.dtype))
    tiles = torch.mm(kron, weight.reshape(c_out * c_in, 9).t(), out=flat).view(-1, c_out, c_in)
    return tiles if transposed else tiles.transpose(1, 2)


def matmul_weight_gradient(products: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A: ``kron(A', A') @ products``, then a copy into the weight's layout (be19dda)."""
    positions, c_out, c_in = products.shape
    side = winograd.output_tile_of(products)
    kron = torch.kron(*[torch.tensor(_WINOGRAD_GRAD_AT[side], dtype=products.dtype)] * 2)
    grad = torch.mm(kron, products.reshape(positions, c_out * c_in))
    target = torch.empty_like(like) if out is None else out
    return target.copy_(grad.t().reshape(c_out, c_in, 3, 3))


def weight_transforms(arm: str, model: RowModel) -> None:
    """A: the matrix products; B: the kernels."""
    pair = ((matmul_weight_tiles, matmul_weight_gradient) if arm == "A"
            else (winograd.winograd_weight_tiles, winograd.winograd_weight_gradient))
    winograd_conv.winograd_weight_tiles, winograd_conv.winograd_weight_gradient = pair


CURRENT_RULE = {name: getattr(winograd_conv, name)
                for name in ("FP32_MIN_TILES", "FP32_MIN_CHANNEL_TILES", "F4_MIN_TILES")}
EARLIER_RULE = {"FP32_MIN_TILES": 128, "FP32_MIN_CHANNEL_TILES": 32768, "F4_MIN_TILES": 0}


def size_rule(arm: str, model: RowModel) -> None:
    """A: the earlier fp32 size rule; B: the current one."""
    for name, value in (EARLIER_RULE if arm == "A" else CURRENT_RULE).items():
        setattr(winograd_conv, name, value)


CURRENT_DECONV = patch_deconv.FP32_MATMUL_CAPABILITIES


def fp32_deconv(arm: str, model: RowModel) -> None:
    """A: the fp32 mask upsampling by oneDNN on every CPU; B: as one matmul on this one (an AVX2 CPU)."""
    capability = torch.backends.cpu.get_cpu_capability()
    patch_deconv.FP32_MATMUL_CAPABILITIES = frozenset() if arm == "A" else CURRENT_DECONV | {capability}


def all_three(arm: str, model: RowModel) -> None:
    """A: the step as of commit be19dda; B: with all three changes."""
    for change in (weight_transforms, size_rule, fp32_deconv):
        change(arm, model)


def memory_order_views(arm: str, model: RowModel) -> None:
    """A: torch's own fused SGD step; B: lit_amp_det's, in memory order (both on aligned tensors). The optimizer's
    ``step`` is swapped on the instance, where the lr scheduler has put its wrapper around the class's step."""
    optimizer = model.optimizer
    if not optimizer.defaults.get("fused") or not isinstance(optimizer, optim.SGD):
        raise SystemExit(f"--change memory-order-views needs a row with the fused SGD; {type(optimizer).__name__} "
                         f"fused={optimizer.defaults.get('fused')}")
    own_step = model.__dict__.setdefault("own_step", optimizer.step)
    optimizer.step = functools.partial(torch.optim.SGD.step, optimizer) if arm == "A" else own_step


TRANSPOSED_OPERANDS = bounded_matmul._is_transposed


def linear_gradient_layout(arm: str, model: RowModel) -> None:
    """A: the box head's weight gradients as the transpose of ``x^T @ grad`` (autograd copies each into the
    weight's layout); B: as ``(grad^T @ x)^T``, already in it (commit c9a372e)."""
    bounded_matmul._is_transposed = (lambda matrix: False) if arm == "A" else TRANSPOSED_OPERANDS


HALF_MIN_TILES = winograd_conv.half_min_tiles  # what the rule calls (fails here if it is renamed)


def split_vector_rule(arm: str, model: RowModel) -> None:
    """A: fp16/bf16 tiles from ``MIN_TILES``; B: from ``SPLIT_VECTOR_MIN_TILES`` (commit 63b4522's Zen 4 rule)."""
    minimum = winograd_conv.MIN_TILES if arm == "A" else winograd_conv.SPLIT_VECTOR_MIN_TILES
    winograd_conv.half_min_tiles = lambda: minimum


CHANGES = {"weight-transforms": weight_transforms, "size-rule": size_rule, "fp32-deconv": fp32_deconv,
           "all": all_three, "memory-order-views": memory_order_views,
           "linear-gradient-layout": linear_gradient_layout, "split-vector-rule": split_vector_rule}


class RowModel:
    """One ``bench train`` row's model, plugin, optimizer and callbacks, ready to step (:func:`train.prepare_row`)."""

    def __init__(self, row: str, setting: e2e_rows.Setting) -> None:
        self.row = train.prepare_row([r.name for r in train.ROWS].index(row), setting)
        self.optimizer = self.row.optimizer
        self.steps = 0

    def step(self, images: object, targets: object) -> float:
        """One timed training step, in ms."""
        start = time.perf_counter()
        self.row.step(self.steps, images, targets)
        self.steps += 1
        return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--change", choices=sorted(CHANGES), default="weight-transforms")
    parser.add_argument("--against", metavar="ROW", default=None,
                        help="compare --row's model with this row's (A) instead of two arms of --change")
    parser.add_argument("--row", default="winograd-4x4", help="a bench train row (its switches and the ones above)")
    parser.add_argument("--model", default="maskrcnn_light")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=120)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="what the precision rows compute in (bench train's --precision; fp32: the AVX2 rows; "
                             "bf16: a CPU with native bf16)")
    parser.add_argument("--optimizer-only", action="store_true",
                        help="time only optimizer.step() on the gradients of one training step (with --change)")
    args = parser.parse_args()
    rows = [row.name for row in train.ROWS]
    if args.optimizer_only and args.against is not None:
        parser.error("--optimizer-only times one model's optimizer under --change; it does not go with --against")
    for name in (args.row, args.against):
        if name is not None and name not in rows:
            parser.error(f"no bench train row {name!r}; choose from {', '.join(rows)}")
    setting = e2e_rows.Setting(device="cpu", model=args.model, batch=args.batch, height=args.size, width=args.size,
                               num_classes=e2e_rows.default_num_classes(args.model), steps=1, warmup=0,
                               compile_warmup=0, state="trained", state_steps=e2e.DEFAULT_STATE_STEPS,
                               half=args.precision)
    # the bench's cached trained state (made here if missing) and its final learning rate, held constant
    setting, _ = e2e.prepare(setting, argparse.Namespace(cache_dir=None, peak_seconds=0.5), [args.precision])
    images, targets = e2e_rows.synthetic_batch(setting, setting.batch)
    if args.against is None:
        model = RowModel(args.row, setting)
        label = f"{args.change}, {args.row}"

        if args.optimizer_only:
            model.step(images, targets)  # leaves its gradients
            label += ", optimizer.step() only"

        def step(arm: str) -> float:
            CHANGES[args.change](arm, model)
            if not args.optimizer_only:
                return model.step(images, targets)
            start = time.perf_counter()
            model.optimizer.step()
            return 1000 * (time.perf_counter() - start)
    else:
        models = {"A": RowModel(args.against, setting), "B": RowModel(args.row, setting)}
        label = f"{args.row} (B) against {args.against} (A)"

        def step(arm: str) -> float:
            return models[arm].step(images, targets)

    for arm in "ABAB":  # warm-up
        step(arm)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(args.pairs):
        for arm in ("AB" if i % 2 == 0 else "BA"):
            times[arm].append(step(arm))
    diffs = [a - b for a, b in zip(times["A"], times["B"])]
    ratios = sorted(a / b for a, b in zip(times["A"], times["B"]))
    quartiles = statistics.quantiles(diffs, n=4)
    ratio_quartiles = statistics.quantiles(ratios, n=4)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"{label}, {args.model} {args.size} px b{args.batch}: A {a:.1f} ms, B {b:.1f} ms, {a / b:.3f}x; paired "
          f"A - B median {statistics.median(diffs):.1f} ms (quartiles {quartiles[0]:.1f}, {quartiles[2]:.1f}), "
          f"paired A / B median {statistics.median(ratios):.3f}x (quartiles {ratio_quartiles[0]:.3f}, "
          f"{ratio_quartiles[2]:.3f}), B faster in {sum(d > 0 for d in diffs)}/{args.pairs} pairs")


if __name__ == "__main__":
    main()
