"""The CUDA configuration's step run on fake CUDA tensors: what a GPU would wait for, counted without a GPU.

``torch._subclasses.fake_tensor.FakeTensorMode`` makes ``device="cuda"`` tensors on a machine without a GPU:
they carry shapes, dtypes and devices but no values, and every op runs through its fake (meta) kernel,
lit_amp_det's ops included. So the module as a GPU run builds it (the speedups that apply on ``cuda``, the
precision plugin built for ``cuda``, the configured optimizer on the parameters' device) runs here as the GPU
would run it, and :class:`lit_amp_det.profiling.HostSyncs`, entered inside the fake mode, sees every copy
between the host and the device, every tensor built from host numbers on the device and every value read, by
call site. An op that needs a device value or sizes its output by one (``nonzero``, ``.item()``) is refused by
fake tensors: it is recorded with its call site and the run stops there.

The module is configured for ``cuda`` on the host (as Lightning does, before moving it), then moved to fake
CUDA. What one step runs on fake CUDA tensors, after one warm-up step (the cell anchors and the cached
constants move to the device once, and the optimizer makes its state, as in a GPU run's first step):

* training: the forward and loss, under the precision plugin's autocast and fp32 regions, then the optimizer
  step the plugin takes (GradScaler's unscale, step and update for 16-mixed; the non-finite guard's step
  otherwise) on gradients of the parameters' shapes. PyTorch's autograd engine cannot run backward on fake
  CUDA tensors (its ``GraphTask`` asks the CUDA driver for each device's current stream, and there is no
  driver), so the backward is covered by the same step on the CPU (``tests/test_profiling.py``,
  ``tests/test_sync_free.py``), where :class:`HostSyncs` counts its value reads and host reads;
* inference: ``forward_padded`` (no read of the detection counts; ``forward`` adds that one read).

    python tools/fake_cuda_step.py [--sites]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from host_syncs import PACKAGE
from lit_amp_det.models.sync_free import is_fixed_shape
from lit_amp_det.profiling import SYNC_KINDS, HostSyncs

#: the tiny sizes every configuration runs at here (the model's own architecture, small images and head
#: widths)
TINY = (
    "model.num_classes=4",
    "model.transform.min_size=128",
    "model.transform.max_size=128",
    "model.rpn.pre_nms_top_n_train=200",
    "model.rpn.post_nms_top_n_train=100",
    "model.rpn.pre_nms_top_n_test=100",
    "model.rpn.post_nms_top_n_test=50",
    "model.roi_heads.batch_size_per_image=64",
    "model.roi_heads.detections_per_img=20",
    "model.backbone.weights=null",
    "model.weights=null",
)
#: the refusals of fake tensors: an op that needs a device value on the host, or an output sized by device
#: values
REFUSALS = (DataDependentOutputException, DynamicOutputShapeException)


@dataclasses.dataclass
class StepCount:
    """What one step on fake CUDA tensors waited for: ``kinds`` (by :data:`SYNC_KINDS`), ``sites`` (``(what,
    path:line) -> count``) and ``refused`` (the op fake tensors refused, with its call site, where the step
    stopped).
    """

    kinds: dict[str, int]
    sites: dict[tuple[str, str], int]
    refused: str | None = None

    @property
    def copies(self) -> int:
        return self.kinds["device copy"]

    @property
    def host_data(self) -> int:
        return self.kinds["host data on a device"]

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def table(self) -> str:
        rows = sorted(self.sites.items(), key=lambda item: -item[1])
        lines = [f"{count:6d}  {what:40s} {site}" for (what, site), count in rows]
        if self.refused:
            lines.append(f"refused: {self.refused}")
        return "\n".join(lines)


_FUSED_SGD_META: torch.library.Library | None = None


def _register_fused_sgd_meta() -> None:
    """A meta kernel for ``aten::_fused_sgd_``, which PyTorch ships without one (fused Adam and AdamW have
    theirs): the op updates its tensor lists in place and returns nothing, so on fake tensors it has nothing
    to do.
    """
    global _FUSED_SGD_META
    if _FUSED_SGD_META is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for overload in ("_fused_sgd_", "_fused_sgd_.tensor_lr"):
        library.impl(overload, lambda *args, **kwargs: None, "Meta")
    _FUSED_SGD_META = library


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A fake tensor mode in which ``cuda`` tensors need no GPU; ``torch.cuda.current_device()`` answers 0
    inside (Lightning's ``module.device`` asks it).
    """
    _register_fused_sgd_meta()
    with (
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
    ):
        yield mode


@contextlib.contextmanager
def cuda_available() -> Iterator[None]:
    """``torch.cuda.is_available()`` and ``is_bf16_supported()`` true inside (a GPU of the H100's generation),
    so that what a GPU run builds and enters (autocast on ``cuda``, a GradScaler) is built as on that GPU;
    only around that, since fake tensors ask ``is_available`` to decide whether to be fake.
    """
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True),
    ):
        yield


def _refused_site(error: BaseException) -> str:
    """``error`` and the innermost frame of its traceback outside torch and the counter: the code that
    asked.
    """
    skipped = (str(Path(torch.__file__).parent) + "/", str(PACKAGE / "profiling.py"))
    site = "?"
    for frame, line in _frames(error.__traceback__):
        if not frame.f_code.co_filename.startswith(skipped):
            site = f"{frame.f_code.co_filename}:{line}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} at {site}"


def _frames(traceback: Any) -> Iterator[tuple[Any, int]]:
    while traceback is not None:
        yield traceback.tb_frame, traceback.tb_lineno
        traceback = traceback.tb_next


def counted(step: Any) -> StepCount:
    """Runs ``step()`` with :class:`HostSyncs` active; a refusal of fake tensors ends it and is recorded."""
    refused = None
    with HostSyncs() as syncs:
        try:
            step()
        except REFUSALS as error:
            refused = _refused_site(error)
    return StepCount(dict(syncs.kinds), dict(syncs.sites), refused)


# ------------------------------------------------------------------------------------------------ the module
@dataclasses.dataclass
class CudaModule:
    """A module as a GPU run builds it, on fake CUDA tensors: the module with its CUDA speedups, the precision
    plugin for ``cuda`` (it converted the module) and the configured optimizer.
    """

    module: Any
    plugin: Any
    optimizer: torch.optim.Optimizer


def configure_for_cuda(module: Any) -> None:
    """``module.configure_model()`` as a Trainer on a GPU calls it, before the module moves there: the
    speedups that apply on ``cuda`` are applied (the Trainer's root device is what the module asks).
    """
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda")))
    with mock.patch.object(type(module), "trainer", trainer):
        module.configure_model()


def build_cuda_module(cfg: Any, module: Any) -> CudaModule:
    """``module`` (``cfg``'s, instantiated and configured for ``cuda`` on the host:
    :func:`configure_for_cuda`) as ``fit`` builds it on a GPU, inside :func:`fake_cuda`: moved to ``cuda``,
    converted by the precision plugin of ``trainer.precision`` built for ``cuda``, and the optimizer of
    ``optim.optimizer`` on its parameters.
    """
    from omegaconf import OmegaConf

    from lit_amp_det.optim import build_optimizer
    from lit_amp_det.precision import build_precision_plugin

    module.to("cuda")
    precision = OmegaConf.to_container(cfg.precision, resolve=True)
    with cuda_available():
        plugin = build_precision_plugin(str(cfg.trainer.precision), "cuda", **precision)
    plugin.convert_module(module)
    optimizer_cfg = OmegaConf.to_container(cfg.optim.optimizer, resolve=True)
    optimizer = build_optimizer(optimizer_cfg, [p for p in module.parameters() if p.requires_grad])
    return CudaModule(module, plugin, optimizer)


def padded(batch: Any, pad_instances: int | None) -> Any:
    """``(images, targets)`` with the targets padded to ``pad_instances`` (:func:`instance_count`), as the
    data module pads them on the host.
    """
    from lit_amp_det.data.coco import pad_instances as pad

    images, targets = batch
    if pad_instances is None:
        return images, targets
    return images, [pad(t, pad_instances) for t in targets]


def instance_count(cfg: Any, module: Any) -> int | None:
    """The count the data module pads ``module``'s training targets to: the fixed-shape detector's
    (``speedups.sync_free.instances_per_image``), else ``data.pad_instances``.
    """
    wanted = module.instances_per_image
    return cfg.data.get("pad_instances") if wanted is None else wanted


def cuda_batch(batch: Any) -> Any:
    """``(images, targets)`` moved to ``cuda``, as Lightning moves a batch before the step."""
    images, targets = batch
    images = [image.to("cuda") for image in images]
    targets = [{k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]
    return images, targets


def _fake_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Gives every parameter of ``optimizer`` a gradient of its shape (what backward would leave)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)


def optimizer_step(built: CudaModule, loss: torch.Tensor) -> None:
    """The optimizer step the precision plugin takes after backward: GradScaler's scale, unscale, step and
    update (16-mixed), or the plugin's step through the non-finite guard.
    """
    plugin, optimizer = built.plugin, built.optimizer
    scaler = getattr(plugin, "scaler", None)
    _fake_gradients(optimizer)
    if scaler is not None:
        scaler.scale(loss)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    else:
        plugin.step_if_finite(optimizer)
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def plugin_context(built: CudaModule) -> Iterator[None]:
    """The precision plugin's forward context (autocast on ``cuda``), entered as on a GPU
    (:func:`cuda_available` only while it is entered: the step inside runs on fake tensors).
    """
    with cuda_available():
        context = built.plugin.forward_context()
        context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def training_step(built: CudaModule, batch: Any, with_optimizer: bool = True) -> torch.Tensor:
    """One training step as ``MaskRCNNModule.training_step`` computes it (forward, loss) under the plugin's
    forward context, and the plugin's optimizer step; returns the loss.
    """
    module = built.module
    images, targets = batch
    module.train()
    with plugin_context(built):
        loss_dict = module.model(module.prepare_images(images), module.training_targets(targets))
        loss = module.compute_loss(loss_dict)
    if with_optimizer:
        optimizer_step(built, loss)
    return loss


def warm_up_training(built: CudaModule, batch: Any) -> None:
    """A first training step: the forward and loss, a plain optimizer step that makes the optimizer's state
    (the non-finite guard reads its flag on the host at a parameter's first step, which fake tensors cannot),
    then the plugin's step (its counters move to the device).
    """
    loss = training_step(built, batch, with_optimizer=False)
    _fake_gradients(built.optimizer)
    built.optimizer.step()
    optimizer_step(built, loss)


def inference_step(built: CudaModule, images: Sequence[torch.Tensor]) -> None:
    """Padded inference: ``forward_padded`` under the plugin's forward context (no read of the counts)."""
    module = built.module
    module.eval()
    detector = module.model
    forward = detector.forward_padded if is_fixed_shape(detector) else detector
    with torch.no_grad(), plugin_context(built):
        forward(module.prepare_images(images))


def count_cuda_steps(
    cfg: Any, batch: Any, steps: Sequence[str] = ("training", "inference")
) -> dict[str, StepCount]:
    """The waits of one training step and one padded inference call (``steps``: either or both) of ``cfg``'s
    module on fake CUDA tensors, each after a warm-up call: ``{"training": ..., "inference": ...}``.
    """
    from lit_amp_det.bench.measure import instantiate_model

    torch.manual_seed(0)
    module = instantiate_model(cfg)
    configure_for_cuda(module)
    batch = padded(batch, instance_count(cfg, module))
    with fake_cuda():
        built = build_cuda_module(cfg, module)
        device_batch = cuda_batch(batch)
        warm_ups = {
            "training": lambda: warm_up_training(built, device_batch),
            "inference": lambda: inference_step(built, device_batch[0]),
        }
        steps_by_name = {
            "training": lambda: training_step(built, device_batch),
            "inference": lambda: inference_step(built, device_batch[0]),
        }
        counts = {}
        for name in steps:
            step = steps_by_name[name]
            warm_up = counted(warm_ups[name])
            counts[name] = warm_up if warm_up.refused else counted(step)
        return counts


# --------------------------------------------------------------------------------------------------- the
# table
def tiny_batch() -> Any:
    """Two 128 x 128 shapes images with their targets, as the loaders deliver them."""
    from lit_amp_det.bench.measure import shapes_batch

    return shapes_batch("train", [0, 1], 128, 128, 4)


def configurations() -> dict[str, list[str]]:
    """The configurations of the table: torchvision's model, the dynamic path (lit_amp_det's ops), the
    sync-free detector (the CUDA default), each under the CUDA defaults' precision (``16-mixed``) and AdamW.
    """
    base = ["trainer=gpu", "trainer.precision=16-mixed", *TINY]
    return {
        "torchvision (speedups=none)": [*base, "speedups=none"],
        "dynamic path (ext_ops, binary_mask_paste)": [*base, "speedups.sync_free=null"],
        "sync_free (the CUDA default), padded targets": [*base, "data.pad_instances=32"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    from lit_amp_det.bench.rows import compose

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", action="store_true", help="list the waits by call site")
    parser.add_argument("--model", default="maskrcnn_light", help="model config (default: maskrcnn_light)")
    args = parser.parse_args(argv)
    batch = tiny_batch()
    print(f"| {args.model}, 128 px, batch 2 | step | " + " | ".join(SYNC_KINDS) + " | refused |")
    print("|---|---|" + "---:|" * len(SYNC_KINDS) + "---|")
    for name, overrides in configurations().items():
        counts = count_cuda_steps(compose([f"model={args.model}", *overrides]), copy.deepcopy(batch))
        for step, count in counts.items():
            cells = " | ".join(str(count.kinds[kind]) for kind in SYNC_KINDS)
            refused = count.refused.split(" at ")[-1] if count.refused else "-"
            print(f"| {name} | {step} | {cells} | {refused} |")
            if args.sites:
                print(f"\n{name}, {step}:\n{count.table()}\n", file=sys.stderr)


if __name__ == "__main__":
    main()
