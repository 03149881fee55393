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
    """Records the operand shapes of every mm/addmm/bmm/linear the code inside runs."""

    PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "linear"}

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[str, tuple[tuple[int, ...], ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            self.shapes.add((name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))

    @property
    def rows(self) -> set[int]:
        """The row counts of the 2-D products (``addmm``'s first operand is the bias)."""
        return {shapes[1 if name == "addmm" else 0][0] for name, shapes in self.shapes if name != "bmm"}


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


# --- bounded_linear / BoundedRowsLinear: the box head's layers ------------------------------------------------------

def test_bounded_linear_gradcheck_float64_padded_and_chunked() -> None:
    """The padded path (rows below one chunk) and the chunked one, through the same Function the half-precision
    path runs (called directly: float64 itself takes F.linear)."""
    from torch.nn import functional as F

    w, c = _randn(5, 7, seed=1).requires_grad_(), _randn(5, seed=2).requires_grad_()
    for rows in (3, 11):  # chunk 8, granule 4: 3 -> padded to 4; 11 -> chunks of 8 and an overlapping 4
        x = _randn(rows, 7, seed=rows).requires_grad_()

        def padded_or_chunked(x, w, c):  # noqa: ANN001, ANN202
            padded = rows if rows >= 8 else 4
            return bounded_matmul._ChunkedAddmm.apply(F.pad(x, (0, 0, 0, padded - rows)), w.t(), c, 8, 4)[:rows]

        assert torch.autograd.gradcheck(padded_or_chunked, (x, w, c))
        torch.testing.assert_close(padded_or_chunked(x, w, c), F.linear(x, w, c))


@pytest.mark.parametrize("rows", [0, 1, 37, 64, 700, 1024, 1500], ids=lambda r: f"{r}-rows")
def test_bounded_linear_equals_linear_in_bf16(rows: int) -> None:
    """bf16 on the CPU: the output and the input gradient equal F.linear's bit for bit (a row's product is the same
    whatever rows run beside it, padding included), the weight and bias gradients to bf16 rounding."""
    from torch.nn import functional as F

    x, w, c = (_randn(*s, dtype=torch.bfloat16, seed=k) for k, s in enumerate([(rows, 96), (48, 96), (48,)]))
    bounded, plain = _grads(bounded_matmul.bounded_linear, x, w, c), _grads(F.linear, x, w, c)
    assert bounded[0].shape == (rows, 48)
    assert torch.equal(bounded[0], plain[0]) and torch.equal(bounded[1], plain[1])
    for ours, theirs in zip(bounded[2:], plain[2:]):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 ** -7, atol=0.5)


def test_bounded_linear_takes_few_shapes_whatever_the_row_count() -> None:
    """The box head's rows at inference are the proposals NMS kept: over 60 row counts from 1 to 2100, forward and
    backward run at most 3 * LINEAR_CHUNK_ROWS / LINEAR_ROW_GRANULE shapes (F.linear: 3 per count); under autocast
    too, where the forward's shapes alone are at most LINEAR_CHUNK_ROWS / LINEAR_ROW_GRANULE."""
    from torch.nn import functional as F

    w = _randn(16, 24, dtype=torch.bfloat16).requires_grad_()
    counts = sorted({int(r) for r in torch.linspace(1, 2100, 60)})
    assert len(counts) == 60
    with _RecordShapes() as products:
        for rows in counts:
            x = _randn(rows, 24, dtype=torch.bfloat16, seed=rows).requires_grad_()
            out = bounded_matmul.bounded_linear(x, w)
            torch.autograd.grad(out, (x, w), torch.ones_like(out))
    limit = bounded_matmul.LINEAR_CHUNK_ROWS // bounded_matmul.LINEAR_ROW_GRANULE
    assert len(products.shapes) <= 3 * limit, sorted(products.shapes)
    with _RecordShapes() as forward, torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in counts:
            bounded_matmul.bounded_linear(_randn(rows, 24, dtype=torch.float32, seed=rows), w.float(), None)
    assert len(forward.shapes) <= limit, sorted(forward.shapes)
    with _RecordShapes() as plain, torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in counts[:10]:
            F.linear(_randn(rows, 24, dtype=torch.float32, seed=rows), w.float())
    assert len(plain.shapes) == 10  # what the bound is against: one shape per row count


def test_full_precision_and_other_inputs_take_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32, 3-D inputs and traced calls (whose row count may be symbolic: torch.export of the box head) run
    F.linear itself, one product of the input's own rows."""
    from torch.nn import functional as F

    w = _randn(6, 4, dtype=torch.float32)
    for x in (_randn(30, 4, dtype=torch.float32), _randn(2, 30, 4, dtype=torch.bfloat16)):
        with _RecordShapes() as products:
            out = bounded_matmul.bounded_linear(x, w.to(x.dtype))
        assert torch.equal(out, F.linear(x, w.to(x.dtype))) and len(products.shapes) == 1
        assert products.rows == {x.numel() // x.shape[-1]}  # unpadded: F.linear's own product of every row
    x = _randn(30, 4, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with _RecordShapes() as traced:
        bounded_matmul.bounded_linear(x, w.to(x.dtype))
    assert traced.rows == {30}


def test_box_head_layers_become_bounded() -> None:
    """use_bounded_linears swaps exact nn.Linear layers only, keeping parameters, state_dict and hooks; the layer
    computes F.linear's result and its switch turns the bound off; model.ops=ext applies it to the box head."""
    from torch import nn
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

    from lit_amp_det.models.bounded_linear import BoundedRowsLinear, use_bounded_linears

    class OwnLinear(nn.Linear):
        pass

    torch.manual_seed(0)
    head, predictor, own = TwoMLPHead(32, 16), FastRCNNPredictor(16, 5), OwnLinear(4, 4)
    state = {k: v.clone() for k, v in head.state_dict().items()}
    calls = []
    head.fc6.register_forward_hook(lambda *args: calls.append("fc6"))
    assert use_bounded_linears(head) == 2 and use_bounded_linears(predictor) == 2 and use_bounded_linears(own) == 0
    assert type(head.fc6) is BoundedRowsLinear and type(own) is OwnLinear
    assert all(torch.equal(v, state[k]) for k, v in head.state_dict().items())
    x = _randn(300, 2, 4, 4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _RecordShapes() as products:
            out = head(x)
        assert calls == ["fc6"] and out.dtype == torch.bfloat16
        assert products.rows == {320}  # 300 rows padded to 5 granules of 64
        head.fc6.bounds_shapes = head.fc7.bounds_shapes = False
        with _RecordShapes() as plain_products:
            plain = head(x)
    assert torch.equal(out, plain) and plain_products.rows == {300}


@pytest.mark.parametrize("rows", [37, 1024, 1500], ids=lambda r: f"{r}-rows")
def test_bounded_linear_hands_autograd_a_weight_gradient_in_the_weight_s_layout(rows: int) -> None:
    """The weight's gradient reaches autograd contiguous, as ``F.linear``'s does, so that it is accumulated into
    ``weight.grad`` without a copy (a transposed one cost 11.5 ms a step for the R50-FPN's fc6); a contiguous
    right-hand operand (the mask upsampling's) keeps its contiguous gradient."""
    from torch.nn import functional as F

    x = _randn(rows, 96, dtype=torch.bfloat16, seed=3)
    incoming: dict[str, torch.Tensor] = {}
    for name, op in (("bounded", bounded_matmul.bounded_linear), ("plain", F.linear)):
        w = _randn(48, 96, dtype=torch.bfloat16, seed=4).requires_grad_()
        w.register_hook(lambda grad, name=name: incoming.__setitem__(name, grad))
        out = op(x, w)
        out.backward(_randn(*out.shape, dtype=out.dtype, seed=9))
        assert w.grad.is_contiguous()
    assert incoming["bounded"].is_contiguous() and incoming["plain"].is_contiguous()
    torch.testing.assert_close(incoming["bounded"].float(), incoming["plain"].float(), rtol=2 ** -7, atol=0.5)
    b = _randn(96, 48, dtype=torch.bfloat16, seed=5).requires_grad_()
    b.register_hook(lambda grad: incoming.__setitem__("mm", grad))
    chunked_addmm(x, b, chunk=512, granule=64).sum().backward()
    assert incoming["mm"].is_contiguous() and b.grad.is_contiguous()
