"""A frozen BatchNorm that keeps the input dtype, and the function that swaps it in.

Fine-tuning a detector with small per-GPU batches freezes BatchNorm: the statistics and affine values of the
pretrained trunk become constants. torchvision's :class:`~torchvision.ops.FrozenBatchNorm2d` does that, but it
computes ``x * scale + bias`` with its fp32 buffers, so under autocast a bf16/fp16 activation comes out fp32:
every following conv casts it back and the trunk's activations take twice the memory. The
:class:`FrozenBatchNorm2d` here folds the buffers into a per-channel scale and shift in fp32, casts those to
the input dtype and applies them, so a bf16 trunk stays bf16. It subclasses torchvision's class (code that
looks for that class finds ours) and has the same state-dict keys as :class:`torch.nn.BatchNorm2d` apart from
``num_batches_tracked``, so checkpoints move between frozen and unfrozen models in both directions.
"""

from __future__ import annotations

import torch
import torchvision.ops
from torch import Tensor, nn

__all__ = ["FrozenBatchNorm2d", "convert_frozen_batchnorm"]

#: What :func:`convert_frozen_batchnorm` replaces (torchvision's frozen class too: ours keeps the
#: dtype).
_CONVERTIBLE = (nn.BatchNorm2d, nn.SyncBatchNorm, torchvision.ops.FrozenBatchNorm2d)
_Convertible = nn.BatchNorm2d | nn.SyncBatchNorm | torchvision.ops.FrozenBatchNorm2d


class FrozenBatchNorm2d(torchvision.ops.FrozenBatchNorm2d):
    """BatchNorm2d with fixed statistics and affine values (buffers only) whose output has the input's dtype.

    ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias`` per channel, with the per-channel
    scale and shift computed in fp32 and applied in ``x.dtype``.

    Args:
        num_features (int): number of channels ``C`` of an input of shape ``[N, C, H, W]``.
        eps (float): added to the variance for numerical stability. Default: 1e-5.
    """

    # BatchNorm2d's loader fills in the absent num_batches_tracked for state dicts older than its version 2;
    # pinning ours at 1 is what lets a frozen state dict load strictly into a model with BatchNorm2d.
    _version = 1

    def scale_shift(self) -> tuple[Tensor, Tensor]:
        """Per-channel ``(scale, shift)``, both fp32 of shape ``[C]``: ``y = x * scale + shift``."""
        scale = self.weight.float() * torch.rsqrt(self.running_var.float() + self.eps)
        shift = self.bias.float() - self.running_mean.float() * scale
        return scale, shift

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (Tensor[N, C, H, W]) -> Tensor[N, C, H, W] of ``x.dtype``."""
        scale, shift = self.scale_shift()
        scale = scale.to(x.dtype).reshape(1, -1, 1, 1)
        shift = shift.to(x.dtype).reshape(1, -1, 1, 1)
        return torch.addcmul(shift, x, scale)  # one kernel for x * scale + shift

    @classmethod
    def from_batchnorm(cls, bn: _Convertible, name: str = "") -> FrozenBatchNorm2d:
        """A frozen copy of ``bn`` (BatchNorm2d, SyncBatchNorm or torchvision's FrozenBatchNorm2d).

        Buffers keep ``bn``'s device and dtype. ``name`` is only used in the error message.
        """
        if bn.running_mean is None or bn.running_var is None:
            raise ValueError(
                f"{name or type(bn).__name__} has no running statistics (track_running_stats=False), so "
                "there is nothing to freeze; build it with track_running_stats=True and load statistics "
                "before freezing"
            )
        frozen = cls(bn.running_mean.numel(), eps=bn.eps)
        frozen.running_mean = bn.running_mean.detach().clone()
        frozen.running_var = bn.running_var.detach().clone()
        # affine=False BatchNorm has no weight/bias: the identity affine
        frozen.weight = (
            bn.weight.detach().clone() if bn.weight is not None else torch.ones_like(bn.running_mean)
        )
        frozen.bias = bn.bias.detach().clone() if bn.bias is not None else torch.zeros_like(bn.running_mean)
        return frozen


def convert_frozen_batchnorm(module: nn.Module) -> nn.Module:
    """Replaces every BatchNorm2d and SyncBatchNorm in ``module`` with a :class:`FrozenBatchNorm2d`.

    The running statistics and affine values are copied; torchvision's FrozenBatchNorm2d is replaced too
    (same values, dtype-keeping forward). Children are swapped in place; the return value is ``module``
    itself, or its frozen copy when ``module`` is a BatchNorm: use the return value, as with
    ``nn.SyncBatchNorm.convert_sync_batchnorm``.
    """
    return _convert(module, "")


def _convert(module: nn.Module, name: str) -> nn.Module:
    if isinstance(module, _CONVERTIBLE) and not isinstance(module, FrozenBatchNorm2d):
        return FrozenBatchNorm2d.from_batchnorm(module, name)
    for child_name, child in module.named_children():
        frozen = _convert(child, f"{name}.{child_name}" if name else child_name)
        if frozen is not child:
            setattr(module, child_name, frozen)
    return module
