"""Matrix products over a data-dependent number of rows, cut into chunks of a few fixed shapes.

On the CPU, a bf16/fp16 ``torch.mm``/``bmm`` runs a oneDNN primitive made for its exact shape, and oneDNN and
PyTorch's ideep keep every primitive they have made: about 0.5 MB each (JIT code, packed operands), up to 1024 of
them (~540 MB; fp32 products go to MKL and keep nothing; a direct convolution keeps 0.05 MB). Measured on the dev
CPU: 0.53 MB per new ``[R, 256] @ [256, 1024]`` shape, 1.3 ms to make it. In a training step the mask head's
products have ``K * 14 * 14`` rows for the step's K positive RoIs, a new K nearly every step, so a run's resident
memory grows by ~1.6 MB a step per product until the caches are full (R50-FPN on 256 px shapes batches that
change every step: +4.5 MB a step with the matmul switches on, +0.4 with plain autocast).

Cutting the rows into chunks of ``chunk`` rows, the last one grown to a multiple of ``granule`` rows by starting
inside the one before (:func:`row_chunks`), bounds the shapes at ``chunk / granule`` per product whatever the row
count. Rows of a product are independent, so the overlapping rows are just computed twice; a product that sums over
the rows (a weight gradient) leaves the overlap out.

Only fp16/bf16 products on the CPU are chunked; elsewhere (float32/float64 go to MKL, CUDA to cuBLAS, which keep
no per-shape state) the functions are the plain torch op, double backward included.

* :func:`row_chunks` -- the chunk plan (also used by :mod:`lit_amp_det.models.winograd_conv`).
* :func:`chunked_addmm` -- ``a @ b (+ bias)`` for ``a`` ``[M, K]``, differentiable (the mask upsampling as a matmul).
* :func:`chunked_bmm` -- ``torch.bmm(a, b)`` in chunks of the batch, differentiable (the own-class mask logits).
* :func:`bounded_linear` -- ``F.linear`` over a data-dependent number of rows, also below one chunk (the box head
  at inference, whose row count is the proposals NMS kept).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_amp_det.models.half_compute import apply_in_autocast_dtype, apply_with_autocast_casts, computes_in_half
from lit_amp_det.ops.winograd import accumulation_dtype

__all__ = ["BMM_CHUNK", "LINEAR_CHUNK_ROWS", "LINEAR_ROW_GRANULE", "MM_CHUNK_ROWS", "MM_ROW_GRANULE", "Chunk",
           "bounded_linear", "chunked_addmm", "chunked_bmm", "keeps_shapes", "row_chunks"]

#: :func:`chunked_addmm`'s chunk: 2048 rows (~10 RoIs of 14x14 pixels), in granules of 128 rows: at most 16 shapes
#: per product; the overlap costs under 128 rows (1 % of the R50 mask head's 70 RoIs).
MM_CHUNK_ROWS = 2048
MM_ROW_GRANULE = 128
#: :func:`chunked_bmm`'s chunk of the batch (RoIs): one shape for 8 or more RoIs, one each for 1 to 7.
BMM_CHUNK = 8
#: :func:`bounded_linear`'s chunk: 1024 rows (a training step's 2 x 512 sampled RoIs run as one product, as before),
#: fewer rows padded to a multiple of 64: at most 16 shapes per layer; the padding costs under 64 rows.
LINEAR_CHUNK_ROWS = 1024
LINEAR_ROW_GRANULE = 64


class Chunk(NamedTuple):
    """Rows ``[begin, end)``, of which the first ``overlap`` belong to the chunk before too."""

    begin: int
    end: int
    overlap: int


def row_chunks(rows: int, chunk: int, granule: int) -> list[Chunk]:
    """Chunks of ``chunk`` rows covering ``[0, rows)``, the last one grown to a multiple of ``granule`` rows (at most
    ``chunk``) by starting it inside the one before. Fewer than ``chunk`` rows are one chunk of their own size (no
    rows: one empty chunk). Sizes of the chunks of all row counts together: ``chunk`` and the multiples of
    ``min(granule, chunk)`` below it, plus the single-chunk sizes."""
    size = max(1, chunk)
    if rows <= size:
        return [Chunk(0, rows, 0)]
    chunks = [Chunk(begin, begin + size, 0) for begin in range(0, rows - size + 1, size)]
    rest = rows - chunks[-1].end
    if rest:
        step = min(max(1, granule), size)
        last = min(size, -(-rest // step) * step)
        chunks.append(Chunk(rows - last, rows, last - rest))
    return chunks


def keeps_shapes(a: Tensor) -> bool:
    """True where a product of ``a`` runs a oneDNN primitive kept per shape: on the CPU in fp16/bf16 (``a``'s dtype,
    or autocast's where it is on)."""
    return a.device.type == "cpu" and computes_in_half(a)


def _rows_product(a: Tensor, b: Tensor, bias: Tensor | None, chunks: list[Chunk]) -> Tensor:
    """``a @ b (+ bias)`` into a new ``[M, N]`` tensor, chunk by chunk of rows (each row written by its chunks)."""
    out = a.new_empty((a.shape[0], b.shape[1]))
    for begin, end, _ in chunks:
        if bias is None:
            torch.mm(a[begin:end], b, out=out[begin:end])
        else:
            torch.addmm(bias, a[begin:end], b, out=out[begin:end])
    return out


def _is_transposed(matrix: Tensor) -> bool:
    """A 2-D column-major view, such as ``weight.t()`` of a contiguous ``weight``."""
    return matrix.dim() == 2 and not matrix.is_contiguous() and matrix.t().is_contiguous()


def _summed_over_rows(a: Tensor, grad: Tensor, chunks: list[Chunk], layout_of: Tensor) -> Tensor:
    """``a^T @ grad`` summed chunk by chunk in fp32 (fp64 for fp64), the last chunk's overlap rows zeroed in a copy
    of its ``a`` rows so that each row counts once; returned in ``a``'s dtype, laid out as ``layout_of`` (the
    operand it is the gradient of). Where that is a transposed view (:func:`bounded_linear`'s ``weight.t()``), the
    sum is computed as ``(grad^T @ a)^T``: its transpose, the weight's gradient, is then contiguous, and autograd
    accumulates it without copying it into the weight's layout (11.5 ms a step for the R50-FPN's fc6 gradient,
    ``[1024, 12544]`` in bf16, measured on the dev CPU; the product itself takes the same time either way)."""
    transposed = _is_transposed(layout_of)

    def product(rows: Tensor, rows_grad: Tensor) -> Tensor:
        return torch.mm(rows_grad.t(), rows).t() if transposed else torch.mm(rows.t(), rows_grad)

    if len(chunks) == 1:
        return product(a, grad)
    acc = accumulation_dtype(a.dtype)
    total = (a.new_zeros((grad.shape[1], a.shape[1]), dtype=acc).t() if transposed
             else a.new_zeros((a.shape[1], grad.shape[1]), dtype=acc))
    for begin, end, overlap in chunks:
        rows = a[begin:end]
        if overlap:
            rows = rows.clone()
            rows[:overlap] = 0
        total.add_(product(rows, grad[begin:end]))
    return total.to(a.dtype)  # keeps total's strides


class _ChunkedAddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, bias: Tensor | None, chunk: int, granule: int) -> Tensor:
        ctx.chunks = row_chunks(a.shape[0], chunk, granule)
        ctx.save_for_backward(a, b)
        ctx.has_bias = bias is not None
        return _rows_product(a, b, bias, ctx.chunks)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_b = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_a = _rows_product(grad, b.t(), None, ctx.chunks)
        if ctx.needs_input_grad[1]:
            grad_b = _summed_over_rows(a, grad, ctx.chunks, b)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_a, grad_b, grad_bias, None, None


def chunked_addmm(a: Tensor, b: Tensor, bias: Tensor | None = None, chunk: int | None = None,
                  granule: int | None = None) -> Tensor:
    """``torch.addmm(bias, a, b)`` (``torch.mm`` without ``bias``) for ``a`` ``[M, K]`` and ``b`` ``[K, N]``, in
    chunks of rows (:func:`row_chunks`; :data:`MM_CHUNK_ROWS`, :data:`MM_ROW_GRANULE` by default), so every product
    it runs, forward and backward, has one of a few shapes whatever M is. Differentiable once (the backward's
    weight gradient ``a^T @ grad`` is summed over the chunks in fp32, the input gradient is chunked like the
    forward). Under autocast the operands are cast to its dtype first, as ``torch.addmm``'s would be."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"chunked_addmm needs a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise ValueError(f"chunked_addmm: bias must be [{b.shape[1]}], got {tuple(bias.shape)}")
    if not keeps_shapes(a):
        return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return apply_with_autocast_casts(_ChunkedAddmm, a, b, bias, MM_CHUNK_ROWS if chunk is None else chunk,
                                     MM_ROW_GRANULE if granule is None else granule)


def _batch_product(a: Tensor, b: Tensor, chunks: list[Chunk]) -> Tensor:
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    for begin, end, _ in chunks:
        torch.bmm(a[begin:end], b[begin:end], out=out[begin:end])
    return out


class _ChunkedBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, chunk: int) -> Tensor:
        ctx.chunks = row_chunks(a.shape[0], chunk, chunk)  # the last chunk is a whole one, overlapping
        ctx.save_for_backward(a, b)
        return _batch_product(a, b, ctx.chunks)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:  # every batch entry is a product of its own: the overlap is recomputed only
            grad_a = _batch_product(grad, b.transpose(1, 2), ctx.chunks)
        if ctx.needs_input_grad[1]:
            grad_b = _batch_product(a.transpose(1, 2), grad, ctx.chunks)
        return grad_a, grad_b, None


def chunked_bmm(a: Tensor, b: Tensor, chunk: int | None = None) -> Tensor:
    """``torch.bmm(a, b)`` for ``a`` ``[B, n, m]`` and ``b`` ``[B, m, p]``, run on chunks of ``chunk`` batch
    entries (:data:`BMM_CHUNK` by default; the last chunk overlaps the one before), so that its products, forward
    and backward, take one shape for any ``B >= chunk``. Differentiable once. Under autocast the operands are cast
    to its dtype first, as ``torch.bmm``'s would be."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"chunked_bmm needs a [B, n, m] and b [B, m, p], got {tuple(a.shape)} and {tuple(b.shape)}")
    if not keeps_shapes(a):
        return torch.bmm(a, b)
    return apply_in_autocast_dtype(_ChunkedBmm, (a, b), BMM_CHUNK if chunk is None else chunk)


def bounded_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, chunk: int | None = None,
                   granule: int | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[R, in]`` whose products take one of at most ``chunk / granule``
    shapes whatever R is: R of ``chunk`` rows or more run in chunks (:func:`chunked_addmm`), fewer rows are padded
    with zero rows to a multiple of ``granule`` (:data:`LINEAR_CHUNK_ROWS`, :data:`LINEAR_ROW_GRANULE` by default)
    and the padding's output dropped. Differentiable once. Other inputs (not 2-D, not computing in fp16/bf16 on
    the CPU: :func:`keeps_shapes`, or no rows) and traced calls (``torch.compile``/``torch.export``, where the row
    count may be symbolic) run ``F.linear`` itself."""
    if x.dim() != 2 or not keeps_shapes(x) or torch.compiler.is_compiling() or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    chunk = LINEAR_CHUNK_ROWS if chunk is None else chunk
    granule = LINEAR_ROW_GRANULE if granule is None else granule
    rows = x.shape[0]
    padding = 0 if rows >= chunk else -rows % granule
    return chunked_addmm(F.pad(x, (0, 0, 0, padding)) if padding else x, weight.t(), bias, chunk, granule)[:rows]
