"""The box head's fully connected layers with a bounded number of product shapes on the CPU in fp16/bf16.

At inference the box head runs on the proposals the RPN's NMS kept, a different count nearly every batch, and on
the CPU every new row count of a bf16 ``F.linear`` makes a oneDNN primitive that oneDNN and ideep keep (about
0.5 MB each, up to 1024 of them; :mod:`lit_amp_det.models.bounded_matmul`). For the R50-FPN's four box-head layers
that is ~2.3 MB more memory after every inference call on new images, plain autocast included (measured with
``bench infer --drift-steps``). :class:`BoundedRowsLinear` computes the same layer with
:func:`~lit_amp_det.models.bounded_matmul.bounded_linear`: at most 16 shapes per layer. A training step's
sampled RoIs (``batch_size_per_image`` per image) have a fixed count and run as one product, as before.

:func:`use_bounded_linears` changes the class of a module's ``nn.Linear`` layers (parameters, ``state_dict`` and
hooks unchanged); :func:`lit_amp_det.models.ext_ops.use_extension_ops` applies it to the box head and predictor
(``model.ops=ext``).
"""

from __future__ import annotations

from torch import Tensor, nn

from lit_amp_det.models.bounded_matmul import bounded_linear

__all__ = ["BoundedRowsLinear", "use_bounded_linears"]


class BoundedRowsLinear(nn.Linear):
    """``nn.Linear`` whose 2-D fp16/bf16 CPU inputs run in products of a few fixed row counts
    (:func:`~lit_amp_det.models.bounded_matmul.bounded_linear`); everything else runs ``F.linear``.

    ``bounds_shapes`` (class attribute; set it on an instance to A/B) switches back to ``F.linear``."""

    bounds_shapes: bool = True

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (torch's name)
        if not self.bounds_shapes:
            return super().forward(input)
        return bounded_linear(input, self.weight, self.bias)


def use_bounded_linears(module: nn.Module) -> int:
    """Makes every exact ``nn.Linear`` in ``module`` a :class:`BoundedRowsLinear`, in place; returns how many
    changed. Subclasses of ``nn.Linear`` keep their own forward."""
    changed = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = BoundedRowsLinear
            changed += 1
    return changed
