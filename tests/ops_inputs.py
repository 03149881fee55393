"""Inputs shared by the op tests: devices to run on, realistic random boxes and RoIs."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import lit_amp_det.ops as ops

#: skips a test without a CUDA GPU and marks it ``cuda``, the set ``make gpu-check`` runs (``pytest -m cuda``)
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]
#: every device with kernels to test; CUDA only where a GPU exists
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def on_cuda_only(test):
    """Marks ``test`` ``cuda`` (what ``make gpu-check`` runs) and skips it without a GPU."""
    for mark in needs_cuda:
        test = mark(test)
    return test


needs_extension = pytest.mark.skipif(
    not ops.extension_available(), reason=f"lit_amp_det._C is not built: {ops.extension_error()}"
)


def assert_as_close_as_theirs(
    got: Tensor, theirs: Tensor, truth: Tensor, *, atol: float, relative: float = 0.0
) -> None:
    """``got`` (ours) against ``theirs`` (torchvision's op, or the plain-PyTorch reference, in the same
    working precision on the same device) and ``truth`` (the same computation in float64 on the CPU).

    On a CPU both round every operation alike: ``got`` must equal ``theirs`` within ``atol`` (plus
    ``relative`` times ``|theirs|``). On CUDA the two compilers fuse multiply-adds differently, above all in
    the fp32 sampling coordinates, whose rounding at a few hundred pixels moves a bilinear weight by about
    1e-5, so the two results may differ by twice what each differs from the truth: there ``got`` must be no
    further from ``truth`` than ``atol`` or twice the distance of ``theirs``, whichever is larger.
    """
    if got.device.type == "cpu":
        limit = atol + relative * theirs.double().abs()
        assert ((got.double() - theirs.double()).abs() <= limit).all(), (
            f"ours differs from theirs by {(got.double() - theirs.double()).abs().max().item():.3g} "
            f"(atol {atol})"
        )
        return
    truth = truth.double().cpu()
    slack = relative * truth.abs()
    ours_error = ((got.double().cpu() - truth).abs() - slack).max().item()
    their_error = ((theirs.double().cpu() - truth).abs() - slack).max().item()
    assert ours_error <= max(atol, 2 * their_error), (
        f"ours is {ours_error:.3g} from the float64 truth, theirs {their_error:.3g} (atol {atol})"
    )


def random_boxes(
    n: int,
    *,
    image: tuple[int, int] = (800, 1333),
    min_size: float = 4.0,
    max_size: float = 300.0,
    clusters: int = 0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``[n, 4]`` float32 boxes inside ``image`` (height, width); with ``clusters`` they jitter around a few
    objects the way RPN proposals do, so NMS suppresses a lot.
    """
    g = generator or torch.Generator().manual_seed(0)
    height, width = image
    size = min_size + torch.rand(n, 2, generator=g) * (max_size - min_size)
    if clusters:
        centres = torch.rand(clusters, 2, generator=g) * torch.tensor([width, height])
        centre = (
            centres[torch.randint(clusters, (n,), generator=g)] + torch.randn(n, 2, generator=g) * 0.1 * size
        )
    else:
        centre = torch.rand(n, 2, generator=g) * torch.tensor([width, height])
    return torch.cat([centre - size / 2, centre + size / 2], dim=1)


def distinct_scores(n: int, generator: torch.Generator | None = None) -> Tensor:
    """A random permutation of distinct scores, so the NMS order is unambiguous in every dtype we test."""
    g = generator or torch.Generator().manual_seed(1)
    return (torch.randperm(n, generator=g).float() + 1) / (n + 1)


def random_rois(
    k: int, batch: int, image: tuple[int, int], generator: torch.Generator | None = None
) -> Tensor:
    """``[k, 5]`` RoIs (batch index, x1, y1, x2, y2) of all sizes, some leaving the image."""
    g = generator or torch.Generator().manual_seed(2)
    boxes = random_boxes(k, image=image, min_size=1.0, max_size=max(image) * 0.8, generator=g)
    index = torch.randint(batch, (k, 1), generator=g).float()
    return torch.cat([index, boxes], dim=1)
