"""The precision plugin: fp32 regions, low-precision backbone, loss scaling, the non-finite step guard."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from conftest import compose_config
from lit_amp_det.precision import (
    DetectionMixedPrecision,
    DetectionPrecision,
    FiniteStepPrecision,
    MasterWeightPrecision,
    NonFiniteStepGuard,
    build_precision_plugin,
    detection_precision,
    loss_scaler,
)
from lit_amp_det.precision.casting import mixed_precision_dtype

LOW = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _tiny_module(tmp_path: Path):
    cfg = compose_config(["experiment=smoke", "model.roi_heads.score_thresh=0.0"], tmp_path)
    return instantiate(cfg.model, _convert_="all", num_classes=4)


def _batch(size: int = 64):
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen) for _ in range(2)]
    masks = torch.zeros(1, size, size, dtype=torch.uint8)
    masks[0, 10:40, 12:50] = 1
    target = {"boxes": torch.tensor([[12.0, 10.0, 50.0, 40.0]]), "labels": torch.tensor([2]), "masks": masks}
    return images, [target, {k: v.clone() for k, v in target.items()}]


def _record(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, log: list) -> None:
    original = getattr(cls, name)

    def recorder(self, *args, **kwargs):
        floats = [a.dtype for a in _tensors(args) if a.is_floating_point()]
        out = original(self, *args, **kwargs)
        outputs = [t.dtype for t in _tensors(out) if t.is_floating_point()]
        log.append((name, floats, torch.is_autocast_enabled("cpu"), outputs))
        return out

    monkeypatch.setattr(cls, name, recorder)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


#: the region methods every detector's fp32 regions include (whichever classes model.ops and the speedups
#: built)
REGION_NAMES = {
    "compute_loss",
    "filter_proposals",
    "encode",
    "decode",
    "postprocess_detections",
    "postprocess",
}


def _region_methods(module) -> set[tuple[type, str]]:
    """The class and name of each ``fp32`` region method of ``module`` (the classes its config built)."""
    methods = set()
    for path, mode in module.fp32_regions().items():
        *parents, name = path.split(".")
        owner = module
        for part in parents:
            owner = getattr(owner, part)
        if mode == "fp32" and owner is not None:
            methods.add((type(owner), name))
    assert {name for _, name in methods} >= REGION_NAMES
    return methods


def _run(module, plugin, monkeypatch) -> tuple[list, dict, list, list[torch.dtype]]:
    calls: list = []
    for cls, name in _region_methods(module):
        _record(monkeypatch, cls, name, calls)  # patched before the plugin wraps: records inside the region
    plugin.convert_module(module)
    conv_dtypes, predictor_dtypes = [], []
    module.model.backbone.body.layer2.register_forward_hook(lambda m, i, o: conv_dtypes.append(o.dtype))
    for predictor in (module.model.roi_heads.box_predictor, module.model.roi_heads.mask_predictor):
        predictor.register_forward_hook(lambda m, i, o: predictor_dtypes.extend(t.dtype for t in _tensors(o)))
    images, targets = _batch()
    module.train()
    with plugin.forward_context():
        losses = module.model(module.prepare_images(images), module.training_targets(targets))
    module.eval()
    with torch.no_grad(), plugin.forward_context():
        predictions = module(images)
    return calls, losses, predictions, conv_dtypes + ["|"] + predictor_dtypes


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_regions_run_in_fp32_while_the_backbone_runs_low(
    precision: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _tiny_module(tmp_path)
    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True)
    calls, losses, predictions, dtypes = _run(module, plugin, monkeypatch)
    low = LOW[precision]
    backbone, predictors = dtypes[: dtypes.index("|")], dtypes[dtypes.index("|") + 1 :]
    assert backbone and set(backbone) == {low}  # the heavy convolutions really run in low precision
    assert predictors and set(predictors) == {torch.float32}  # losses and mask inference consume fp32
    seen = {name for name, *_ in calls}
    assert seen == {name for _, name in _region_methods(module)}
    for name, inputs, autocast_on, outputs in calls:
        assert set(inputs) <= {torch.float32}, (name, inputs)
        assert not autocast_on, name
        assert set(outputs) <= {torch.float32}, (name, outputs)
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    assert predictions[0]["boxes"].dtype == torch.float32 and predictions[0]["scores"].dtype == torch.float32
    assert mixed_precision_dtype(module.model.rpn) == low


def test_without_regions_the_same_methods_see_low_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _tiny_module(tmp_path)
    plugin = build_precision_plugin("bf16-mixed", "cpu", fp32_regions={})
    calls, *_ = _run(module, plugin, monkeypatch)
    rpn_loss = [inputs for name, inputs, _, _ in calls if name == "compute_loss"][0]
    assert torch.bfloat16 in rpn_loss  # plain autocast: the RPN loss would be computed from bf16 logits
    assert all(autocast for name, _, autocast, _ in calls if name == "compute_loss")


def test_regions_are_configurable_and_checked(tmp_path: Path) -> None:
    module = _tiny_module(tmp_path)
    plugin = build_precision_plugin("bf16-mixed", "cpu", fp32_regions={"model.rpn.nope": "fp32"})
    with pytest.raises(ValueError, match=r"fp32_regions names 'model.rpn.nope'"):
        plugin.convert_module(module)
    plugin = build_precision_plugin("bf16-mixed", "cpu", fp32_regions={"model.rpn.compute_loss": "half"})
    with pytest.raises(ValueError, match=r"fp32_regions\['model.rpn.compute_loss'\]='half'"):
        plugin.convert_module(module)


def test_precision_strings_map_to_plugins(cpu_bf16) -> None:
    cpu_bf16(True)
    assert isinstance(build_precision_plugin("32-true"), FiniteStepPrecision)
    with pytest.warns(UserWarning, match=r"16-mixed.*bf16-mixed"):
        fallback = build_precision_plugin("16-mixed", "cpu")
    assert isinstance(fallback, DetectionMixedPrecision) and fallback.precision == "bf16-mixed"
    assert fallback.scaler is None
    forced = build_precision_plugin("16-mixed", "cpu", fp16_on_cpu=True, init_scale=1024.0, growth_interval=7)
    assert forced.precision == "16-mixed" and forced.scaler.get_scale() == 1024.0
    assert forced.scaler.get_growth_interval() == 7
    assert forced.state_dict()["scale"] == 1024.0  # the scaler state goes into checkpoints
    with pytest.raises(ValueError, match=r"trainer\.precision='fp8'"):
        build_precision_plugin("fp8")


def test_low_precision_weight_strings_map_to_the_master_weight_plugin(cpu_bf16) -> None:
    cpu_bf16(True)
    weights = build_precision_plugin("bf16-weights", "cpu")
    assert isinstance(weights, MasterWeightPrecision) and weights.precision == "bf16-weights"
    assert weights.scaler is None and weights.low_dtype == torch.bfloat16
    with pytest.warns(UserWarning, match=r"16-weights.*bf16-weights"):
        assert build_precision_plugin("16-weights", "cpu").precision == "bf16-weights"
    forced = build_precision_plugin("16-weights", "cpu", fp16_on_cpu=True, init_scale=512.0)
    assert forced.precision == "16-weights" and forced.low_dtype == torch.float16
    assert forced.state_dict()["scale"] == 512.0 and forced.state_dict()["guard"]["skipped"] == 0
    for name in ("bf16-true", "16-true"):  # Lightning's names: everything low, no masters; not ours
        with pytest.raises(ValueError, match="bf16-weights"):
            build_precision_plugin(name)
    with pytest.raises(ValueError, match=r"'bf16-mixed'"):
        MasterWeightPrecision("bf16-mixed", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'bf16-weights'"):
        DetectionMixedPrecision("bf16-weights", "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "scaled", "low_dtype"),
    [
        ("32-true", False, None),
        ("bf16-mixed", False, torch.bfloat16),
        ("16-mixed", True, torch.float16),
        ("bf16-weights", False, torch.bfloat16),
        ("16-weights", True, torch.float16),
    ],
)
def test_every_built_plugin_is_what_callbacks_read(cpu_bf16, precision, scaled, low_dtype) -> None:
    """Each plugin that build_precision_plugin makes is a DetectionPrecision with its GradScaler, low dtype
    and guard, found on the Trainer by detection_precision.
    """
    cpu_bf16(True)
    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True)
    assert plugin.precision == precision and isinstance(plugin, DetectionPrecision)
    assert isinstance(plugin.scaler, torch.amp.GradScaler) if scaled else plugin.scaler is None
    assert plugin.low_dtype == low_dtype and isinstance(plugin.guard, NonFiniteStepGuard)
    trainer = pl.Trainer(accelerator="cpu", plugins=[plugin], logger=False, enable_checkpointing=False)
    assert detection_precision(trainer) is plugin
    assert loss_scaler(plugin) is plugin.scaler


def test_a_plugin_the_user_passes_is_not_read_as_lit_amp_dets() -> None:
    """Lightning's own plugins have no guard: callbacks see none; the loss scale of MixedPrecision is still
    read.
    """
    mixed = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    for plugin in (Precision(), mixed):
        trainer = pl.Trainer(accelerator="cpu", plugins=[plugin], logger=False, enable_checkpointing=False)
        assert trainer.precision_plugin is plugin and detection_precision(trainer) is None
    assert loss_scaler(mixed) is mixed.scaler and isinstance(mixed.scaler, torch.amp.GradScaler)
    assert loss_scaler(Precision()) is None


@pytest.mark.parametrize(
    ("plugin", "precision"), [(DetectionMixedPrecision, "16-mixed"), (MasterWeightPrecision, "16-weights")]
)
def test_both_half_plugins_take_the_same_options(plugin, precision) -> None:
    """One settings object makes both plugins' GradScaler, regions and guard; unknown keywords are refused."""
    built = plugin(
        precision,
        "cpu",
        fp32_regions={"model.roi_heads": "fp32"},
        init_scale=8.0,
        growth_interval=3,
        max_consecutive_skips=4,
        skip_check_every_n_steps=5,
    )
    assert built.scaler.get_scale() == 8.0 and built.scaler.get_growth_interval() == 3
    assert built.fp32_regions == {"model.roi_heads": "fp32"}
    assert (built.guard.max_consecutive, built.guard.check_every_n_steps) == (4, 5)
    defaults = plugin(precision.replace("16", "bf16"), "cpu")
    assert defaults.scaler is None and defaults.fp32_regions is None
    with pytest.raises(TypeError, match="init_scael"):
        plugin(precision, "cpu", init_scael=8.0)


class _Linear(pl.LightningModule):
    """Fits y = 2x; grads of chosen steps are replaced by inf."""

    def __init__(self, poison_steps: set[int]) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.poison_steps = poison_steps
        self.weights: list[float] = []

    def training_step(self, batch, batch_idx):
        x = torch.linspace(-1, 1, 8).unsqueeze(1)
        return ((self.layer(x).float() - 2 * x) ** 2).mean()

    def on_after_backward(self) -> None:
        if self.global_step in self.poison_steps:
            self.layer.weight.grad.fill_(math.inf)

    def on_train_batch_end(self, *args) -> None:
        self.weights.append(float(self.layer.weight.detach()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return [0] * 8


def _fit(module: pl.LightningModule, plugin, steps: int) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=steps,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_an_inf_gradient_skips_the_step_and_training_recovers(precision: str) -> None:
    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True, init_scale=256.0)
    module = _Linear(poison_steps={2})
    _fit(module, plugin, steps=8)
    weights = module.weights
    assert plugin.guard.skipped == 1 and plugin.guard.consecutive == 0
    assert weights[2] == weights[1]  # the poisoned step changed nothing
    assert all(math.isfinite(w) for w in weights) and weights[-1] != weights[2]  # and training went on
    assert abs(weights[-1] - 2.0) < abs(weights[0] - 2.0)


def test_too_many_consecutive_skips_stop_with_a_clear_error_at_the_next_read() -> None:
    """The counts are read on the host every ``skip_check_every_n_steps`` steps: the stop comes at the first
    read after the limit, here the 4th step with a limit of 3; no step changed the weight.
    """
    plugin = build_precision_plugin("bf16-mixed", "cpu", max_consecutive_skips=3, skip_check_every_n_steps=4)
    module = _Linear(poison_steps=set(range(100)))
    before = float(module.layer.weight.detach())
    with pytest.raises(
        RuntimeError,
        match=r"4 consecutive optimizer steps had non-finite gradients.*"
        r"max_consecutive_skips=3.*gradient_clip_val",
    ):
        _fit(module, plugin, steps=10)
    assert module.weights == [before] * 3  # three steps ended; the fourth raised
