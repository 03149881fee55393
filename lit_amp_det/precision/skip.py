"""Optimizer steps that are skipped on the device when a gradient is inf or NaN, without the host reading a
flag.

Deciding on the host whether to call ``optimizer.step()`` means reading a flag computed on the GPU, a host
sync every step. Here the decision stays a tensor: :func:`non_finite` computes it with
``torch.amp.GradScaler``'s ``found_inf`` kernel, and :class:`DeviceSkippedStep` hands it to a fused optimizer,
whose kernel skips the update itself as under ``GradScaler``. Any other in-place optimizer gets the tensors it
writes (stepped parameters and their state) copied before the step and selected back with ``torch.where``
where the flag is set. Either way a skipped step leaves parameters and optimizer state exactly as they were.

Where the select cannot work (a parameter's first step, a replaced state tensor or changed Python number,
state on another device than the gradients) the host decides after the step and restores what it created or
replaced.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["DeviceSkippedStep", "gradients", "non_finite"]


def gradients(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients an ``optimizer.step()`` reads: those of its parameters that have one."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


@torch.no_grad()
def non_finite(tensors: Sequence[Tensor]) -> Tensor:
    """Whether any element of ``tensors`` is inf or NaN, as a 0-dim bool tensor on their device (False for
    none).

    Runs GradScaler's ``torch._amp_foreach_non_finite_check_and_unscale_`` at scale 1 (values unchanged) per
    device and dtype group, as ``GradScaler.unscale_`` does. Sparse tensors are checked through their values.
    """
    # the flag lives on the first accelerator among the tensors' devices (moving it to the CPU would sync)
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        values = tensor.coalesce().values() if tensor.is_sparse else tensor
        groups.setdefault((values.device, values.dtype), []).append(values)
    found = torch.zeros((), dtype=torch.bool, device=device)
    for (group_device, _), group in groups.items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=group_device)
        one = torch.ones(1, dtype=torch.float32, device=group_device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, one)
        found |= found_inf.to(device, non_blocking=True).squeeze(0) > 0
    return found


def _identities(state: dict[str, Any] | None) -> dict[str, int]:
    return {} if state is None else {key: id(value) for key, value in state.items()}


class DeviceSkippedStep:
    """``optimizer.step()`` undone on the device where a flag says the step must not happen (see the module);
    holds one reusable copy buffer per tensor the step writes.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, Tensor] = {}
        self._warned: set[int] = set()  # ids of optimizers told that their state forces a host read

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, skip: Tensor, **kwargs: Any) -> None:
        """Runs ``optimizer.step(**kwargs)``; where ``skip`` (a 0-dim bool tensor) is set, the stepped
        parameters and their optimizer state are left exactly as they were.
        """
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # the optimizer's own kernel skips a step flagged in its ``found_inf`` attribute: a fused torch
        # optimizer with every stepped parameter on the flag's device and past its first step (a skipped first
        # step of fused SGD would keep uninitialised momentum buffers)
        if (
            getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups)
            and all(p.device == skip.device and optimizer.state.get(p) for p in params)
        ):
            self._buffers = {}  # the first step's copies, no longer needed
            optimizer.found_inf = skip.to(torch.float32).reshape(())  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                optimizer.step(**kwargs)
            finally:
                del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
            return
        before = {p: dict(optimizer.state[p]) for p in params if p in optimizer.state}
        written = [
            *params,
            *(v for state in before.values() for v in state.values() if isinstance(v, Tensor)),
        ]
        copies = self._copy(written)
        optimizer.step(**kwargs)
        # the copies restore all of the state only if the step changed it inside tensors that were there
        # before it
        kept_in_place = all(_identities(optimizer.state.get(p)) == _identities(before.get(p)) for p in params)
        if kept_in_place and self._on_device(optimizer, written, skip.device):
            for tensor, copy in zip(written, copies):
                torch.where(skip, copy, tensor, out=tensor)
            return
        if bool(skip):  # the host decides: a step that created or replaced state, or state on another device
            for tensor, copy in zip(written, copies):
                tensor.copy_(copy)
            for p in params:
                if p in before:
                    optimizer.state[p] = before[p]
                else:
                    optimizer.state.pop(p, None)

    def _copy(self, tensors: list[Tensor]) -> list[Tensor]:
        """Copies of ``tensors`` into the previous step's buffers where their tensor is still there."""
        buffers: dict[int, Tensor] = {}
        for tensor in tensors:
            buffer = self._buffers.get(id(tensor))
            if (
                buffer is None
                or buffer.shape != tensor.shape
                or buffer.dtype != tensor.dtype
                or (buffer.device != tensor.device or buffer.stride() != tensor.stride())
            ):
                buffer = torch.empty_like(tensor, memory_format=torch.preserve_format)
            buffers[id(tensor)] = buffer
        self._buffers = buffers  # buffers of tensors gone since the last step are dropped
        copies = [buffers[id(t)] for t in tensors]
        if tensors:
            torch._foreach_copy_(copies, tensors)
        return copies

    def _on_device(
        self, optimizer: torch.optim.Optimizer, written: list[Tensor], device: torch.device
    ) -> bool:
        """Whether every written tensor is on the flag's device; warns once per optimizer when not."""
        elsewhere = next((t for t in written if t.device != device), None)
        if elsewhere is None:
            return True
        if id(optimizer) not in self._warned:
            self._warned.add(id(optimizer))
            warnings.warn(
                f"{type(optimizer).__name__} keeps a {tuple(elsewhere.shape)} state tensor on "
                f"{elsewhere.device} while its gradients are on {device}, so the non-finite step guard reads "
                "its flag on the host every step (a sync). Build it with fused=True (optim.optimizer.fused="
                "auto) or capturable=True to keep its state on the gradients' device.",
                stacklevel=3,
            )
        return False
