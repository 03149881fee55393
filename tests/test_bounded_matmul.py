"""Matrix products in chunks of a few fixed shapes (lit_amp_det.models.bounded_matmul) equal torch's products.

oneDNN keeps about 0.5 MB for every bf16 matmul shape it has run on the CPU; the mask head's products change shape
with every step's RoI count. Checked here: the chunk plan covers every row count with few sizes; the chunked
``addmm``/``bmm`` equal ``torch.addmm``/``torch.bmm`` (float64 gradcheck of the chunked Functions with overlapping
last chunks, bf16 forward bit for bit, gradients to rounding, autocast); over many row counts they run a bounded
set of shapes; float32/float64 take the plain op (double backward included).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_amp_det.models import bounded_matmul
from lit_amp_det.models.bounded_matmul import chunked_addmm, chunked_bmm, row_chunks


def _randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class _RecordShapes(TorchDispatchMode):
    """Records the operand shapes of every mm/addmm/bmm the code inside runs."""

    PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[str, tuple[tuple[int, ...], ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            self.shapes.add((name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("chunk", "granule"), [(512, 64), (2048, 128), (8, 3), (5, 64), (4, 1)])
def test_chunks_cover_the_rows_in_few_sizes(chunk: int, granule: int) -> None:
    """Every row count is covered exactly: chunks of ``chunk`` rows one after another, the last one grown to a
    multiple of ``granule`` by starting inside the one before (its overlap says by how many rows); so all row counts
    above ``chunk`` together use at most ``chunk / granule`` chunk sizes."""
    sizes = set()
    for rows in range(0, 6 * chunk + 1):
        chunks = row_chunks(rows, chunk, granule)
        covered = 0
        for k, (begin, end, overlap) in enumerate(chunks):
            assert begin == covered - overlap, (rows, chunks)
            assert 0 <= overlap < max(1, end - begin), (rows, chunks)
            if k < len(chunks) - 1:
                assert (end - begin, overlap) == (chunk, 0), (rows, chunks)
            covered = end
        assert covered == rows
        last = chunks[-1].end - chunks[-1].begin
        if rows > chunk:  # several chunks: the last one's size is a multiple of the granule, or a whole chunk
            assert last % min(granule, chunk) == 0 or last == chunk, (rows, chunks)
            sizes.add(last)
    assert len(sizes) <= -(-chunk // min(granule, chunk)), sorted(sizes)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_chunked_addmm_gradcheck_float64(bias: bool) -> None:
    """23 rows in chunks of 8 with a granule of 3: the last chunk starts 1 row inside the one before. Values and
    both gradients (the weight gradient summed over the chunks, the overlap once) pass gradcheck."""
    assert row_chunks(23, 8, 3)[-1] == (15, 23, 1)
    a = _randn(23, 5, seed=1).requires_grad_()
    b = _randn(5, 7, seed=2).requires_grad_()
    c = _randn(7, seed=3).requires_grad_() if bias else None
    torch.testing.assert_close(bounded_matmul._ChunkedAddmm.apply(a, b, c, 8, 3),
                               a @ b + (c if bias else 0), atol=1e-12, rtol=1e-12)
    inputs = (a, b, c) if bias else (a, b)
    assert torch.autograd.gradcheck(
        lambda *t: bounded_matmul._ChunkedAddmm.apply(t[0], t[1], t[2] if bias else None, 8, 3), inputs)


def test_chunked_bmm_gradcheck_float64() -> None:
    """11 batch entries in chunks of 4: the last chunk overlaps the one before by one entry."""
    assert row_chunks(11, 4, 4)[-1] == (7, 11, 1)
    a = _randn(11, 3, 5, seed=1).requires_grad_()
    b = _randn(11, 5, 2, seed=2).requires_grad_()
    torch.testing.assert_close(bounded_matmul._ChunkedBmm.apply(a, b, 4), torch.bmm(a, b), atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(lambda x, y: bounded_matmul._ChunkedBmm.apply(x, y, 4), (a, b))


def _grads(fn, *leaves: torch.Tensor, seed: int = 9) -> list[torch.Tensor]:  # noqa: ANN001
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    grad = _randn(*out.shape, dtype=out.dtype, seed=seed)
    return [out, *torch.autograd.grad(out, leaves, grad)]


def test_chunked_addmm_equals_addmm_in_bf16() -> None:
    """bf16 on the CPU, 3000 rows (chunks of 2048 and an overlapping 1024): the output and the input gradient are
    torch.addmm's bit for bit (each row is one product either way); the weight and bias gradients agree to bf16
    rounding (the weight gradient rounds each chunk's sum once more before the fp32 total)."""
    a, b, c = (_randn(*s, dtype=torch.bfloat16, seed=k) for k, s in enumerate([(3000, 64), (64, 96), (96,)]))
    assert bounded_matmul.keeps_shapes(a)
    chunked = _grads(chunked_addmm, a, b, c)
    plain = _grads(torch.addmm, c, a, b)
    assert torch.equal(chunked[0], plain[0])
    assert torch.equal(chunked[1], plain[2])
    torch.testing.assert_close(chunked[2].float(), plain[3].float(), rtol=2 ** -7, atol=0.5)
    torch.testing.assert_close(chunked[3].float(), plain[1].float(), rtol=2 ** -7, atol=0.5)


def test_chunked_bmm_equals_bmm_in_bf16() -> None:
    a, b = _randn(21, 49, 32, dtype=torch.bfloat16, seed=1), _randn(21, 32, 1, dtype=torch.bfloat16, seed=2)
    for chunked, plain in zip(_grads(chunked_bmm, a, b), _grads(torch.bmm, a, b)):
        assert torch.equal(chunked, plain)


def test_autocast_casts_like_the_torch_ops() -> None:
    """Under CPU autocast (bf16) float32 operands are cast as torch.addmm's / torch.bmm's would be, and the
    products are chunked: the results equal the ops' under autocast."""
    a, b, c = _randn(2100, 16, dtype=torch.float32), _randn(16, 24, dtype=torch.float32), _randn(24, dtype=torch.float32)
    x, y = _randn(9, 5, 16, dtype=torch.float32), _randn(9, 16, 3, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bounded_matmul.keeps_shapes(a)
        out, expected = chunked_addmm(a, b, c), torch.addmm(c, a, b)
        batched, batched_expected = chunked_bmm(x, y), torch.bmm(x, y)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    assert batched.dtype == torch.bfloat16 and torch.equal(batched, batched_expected)


def test_products_take_few_shapes_whatever_the_row_count() -> None:
    """The mask upsampling's rows are K * 14 * 14 for K RoIs: over 40 RoI counts, forward and backward of
    chunked_addmm run at most 3 * MM_CHUNK_ROWS / MM_ROW_GRANULE product shapes (torch.mm: 3 per count), and
    chunked_bmm over 40 batch sizes at or above BMM_CHUNK runs 3."""
    b = _randn(8, 12, dtype=torch.bfloat16).requires_grad_()
    w = _randn(bounded_matmul.BMM_CHUNK + 40, 6, 1, dtype=torch.bfloat16).requires_grad_()
    with _RecordShapes() as products:
        for rois in range(11, 51):
            a = _randn(rois * 196, 8, dtype=torch.bfloat16, seed=rois).requires_grad_()
            out = chunked_addmm(a, b)
            torch.autograd.grad(out, (a, b), torch.ones_like(out))
    assert len(products.shapes) <= 3 * bounded_matmul.MM_CHUNK_ROWS // bounded_matmul.MM_ROW_GRANULE, \
        sorted(products.shapes)
    with _RecordShapes() as batched:
        for rois in range(bounded_matmul.BMM_CHUNK, bounded_matmul.BMM_CHUNK + 40):
            x = _randn(rois, 20, 6, dtype=torch.bfloat16, seed=rois).requires_grad_()
            out = chunked_bmm(x, w[:rois])
            torch.autograd.grad(out, (x, w), torch.ones_like(out))
    assert len(batched.shapes) == 3, sorted(batched.shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_full_precision_takes_the_plain_op_with_double_backward(dtype: torch.dtype) -> None:
    """float32/float64 products keep no per-shape state (MKL): the functions run the torch op itself, one product
    per call, and stay twice differentiable."""
    a, b, c = _randn(3000, 4, dtype=dtype), _randn(4, 5, dtype=dtype), _randn(5, dtype=dtype)
    assert not bounded_matmul.keeps_shapes(a)
    with _RecordShapes() as products:
        chunked_addmm(a, b, c)
        chunked_bmm(a.view(30, 100, 4), b.expand(30, 4, 5))
    assert len(products.shapes) == 2
    if dtype == torch.float64:
        leaves = [t[:20].clone().requires_grad_() if t is a else t.clone().requires_grad_() for t in (a, b, c)]
        assert torch.autograd.gradgradcheck(chunked_addmm, leaves)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\].*\(3, 4\) and \(5, 6\)"):
        chunked_addmm(torch.ones(3, 4), torch.ones(5, 6))
    with pytest.raises(ValueError, match=r"bias must be \[6\]"):
        chunked_addmm(torch.ones(3, 5), torch.ones(5, 6), torch.ones(5))
    with pytest.raises(ValueError, match=r"a \[B, n, m\] and b \[B, m, p\]"):
        chunked_bmm(torch.ones(2, 3, 4), torch.ones(3, 4, 5))
