"""The CUDA configuration's step on fake CUDA tensors: what a GPU would wait for, checked without a GPU.

``tools/fake_cuda_step.py`` builds the module as a GPU run builds it (the speedups for ``cuda``, the precision
plugin for ``cuda``, the configured optimizer) on fake CUDA tensors and counts, by call site, every copy
between the host and the device, every tensor made from host numbers on the device, every value read, and the
ops fake tensors refuse for needing a device value. The sync-free step must wait for nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fake_cuda_step import TINY, configure_for_cuda, count_cuda_steps, instance_count, tiny_batch
from host_syncs import package_sites
from lit_amp_det.bench.measure import instantiate_model
from lit_amp_det.bench.rows import compose

#: the CUDA defaults (speedups, precision 16-mixed, AdamW) with targets padded as the data module pads them
SYNC_FREE = ["trainer=gpu", "trainer.precision=16-mixed", *TINY, "data.pad_instances=32"]


@pytest.fixture(scope="module")
def batch():
    return tiny_batch()


def _describe(counts) -> str:
    return "\n\n".join(f"{step}:\n{count.table()}" for step, count in counts.items())


@pytest.mark.parametrize("model", ["maskrcnn_light", "maskrcnn_r50_fpn", "fasterrcnn_light"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_sync_free_cuda_step_waits_for_nothing(model, precision, batch) -> None:
    """Training (forward, loss, the plugin's optimizer step) and padded inference: no copy between the host
    and the device, no tensor from host numbers, no value read, no op refused for its data-dependent output.
    """
    overrides = [f"model={model}", *SYNC_FREE, f"trainer.precision={precision}"]
    counts = count_cuda_steps(compose(overrides), copy.deepcopy(batch))
    assert set(counts) == {"training", "inference"}
    for count in counts.values():
        assert count.refused is None, _describe(counts)
        assert count.copies == 0 and count.host_data == 0, _describe(counts)
        assert count.total == 0, _describe(counts)


def test_the_detectors_own_instance_count_pads_the_targets_as_the_data_setting_did(batch) -> None:
    """``speedups.sync_free.instances_per_image`` instead of ``data.pad_instances``: the targets are padded to
    the model's count, and the training step still waits for nothing.
    """
    overrides = [
        "model=maskrcnn_light",
        "trainer=gpu",
        "trainer.precision=16-mixed",
        *TINY,
        "speedups.sync_free.instances_per_image=32",
    ]
    cfg = compose(overrides)
    module = instantiate_model(cfg)
    configure_for_cuda(module)
    assert cfg.data.pad_instances is None and instance_count(cfg, module) == 32
    training = count_cuda_steps(cfg, copy.deepcopy(batch), steps=["training"])["training"]
    assert training.refused is None and training.total == 0, training.table()


def test_the_stand_in_sees_what_a_gpu_would_wait_for_in_the_dynamic_path(batch) -> None:
    """The same count on the dynamic path (lit_amp_det's ops without sync_free) finds torchvision's
    normalisation constants made from host numbers on the device, and stops at the first value read, named by
    its line.
    """
    overrides = [
        "model=maskrcnn_light",
        "trainer=gpu",
        "trainer.precision=16-mixed",
        *TINY,
        "speedups.sync_free=null",
    ]
    counts = count_cuda_steps(compose(overrides), copy.deepcopy(batch))
    training, inference = counts["training"], counts["inference"]
    assert training.host_data >= 2, _describe(counts)  # the mean and std of torchvision's normalize
    assert training.refused is not None and "transform.py" in training.refused, _describe(counts)
    assert inference.copies >= 1 and inference.refused is not None, _describe(counts)
    assert "models/ext_ops.py" in "".join(package_sites(inference)), _describe(counts)


def test_the_sync_free_step_made_no_copy_where_torchvision_made_them(batch) -> None:
    """torchvision's transform and box coder, as the sync-free detector used them before, make tensors from
    host numbers in every step: the counter finds them when the detector's own replacements are undone.
    """
    from torchvision.models.detection._utils import BoxCoder

    from lit_amp_det.models import sync_free

    cfg = compose(["model=maskrcnn_light", *SYNC_FREE])
    original = sync_free.device_box_coder
    try:
        sync_free.device_box_coder = lambda coder: BoxCoder(coder.weights, coder.bbox_xform_clip)
        counts = count_cuda_steps(cfg, copy.deepcopy(batch))
    finally:
        sync_free.device_box_coder = original
    training = counts["training"]
    sites = {site.rsplit("/", 1)[-1] for (_, site) in training.sites}
    assert training.host_data == 4 and training.total == 4, _describe(counts)  # the weights, two 0.5s
    assert all(site.startswith("_utils.py:") for site in sites), sites
    assert torch.cuda.is_available() is False  # nothing of the stand-in is left behind


def _quick_rows() -> list[tuple[str, str]]:
    from lit_amp_det.bench import gpu_check

    rows = []
    for bench, options in gpu_check.QUICK.items():
        rows += [(bench, name) for name in options[options.index("--rows") + 1].split(",")]
    return rows


@pytest.mark.parametrize(("bench", "row"), _quick_rows())
def test_every_gpu_check_row_runs_its_step_on_fake_cuda(bench, row) -> None:
    """Each row ``make gpu-check`` runs, composed as ``bench train|infer`` composes it for CUDA (the GPU
    check's model, at 128 px), builds and runs its step on fake CUDA tensors: a sync-free row waits for
    nothing; a dynamic row runs until fake tensors refuse its first data-dependent op (a GPU waits there), and
    fails in no other way.
    """
    from lit_amp_det.bench import gpu_check
    from lit_amp_det.bench.measure import shapes_batch
    from lit_amp_det.bench.rows import BENCHES, Setting, device_defaults, row_overrides

    options = gpu_check.QUICK_OPTIONS
    setting = Setting(
        device="cuda",
        model=device_defaults("cuda")["model"],
        batch=2,
        height=128,
        width=128,
        num_classes=81,
        steps=int(options[options.index("--steps") + 1]),
        warmup=int(options[options.index("--warmup") + 1]),
        compile_warmup=0,
    )
    names = [r.name for r in BENCHES[bench].rows]
    cfg = compose(row_overrides(BENCHES[bench], names.index(row), setting))
    batch = shapes_batch("val", range(2), 128, 128, 81)
    step = "training" if bench == "train" else "inference"
    count = count_cuda_steps(cfg, batch, steps=[step])[step]
    if cfg.speedups.get("sync_free"):
        assert count.refused is None and count.total == 0, count.table()
    else:
        assert count.refused is not None and count.kinds["value read"] >= 1, count.table()
