"""``export``: the ONNX graph (onnxruntime) and the ``torch.export`` program give the eager model's
detections; the ONNX translations of the ops match the ops; ``to_onnx`` / ``to_torchscript`` behave as
Lightning documents (issue 44).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from conftest import SMOKE, compose_config, run_cli
from lit_amp_det import MaskRCNNModule
from lit_amp_det.deploy import OUTPUTS, export_detector

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

#: a smoke model trained 8 steps scores everything low: this threshold keeps a few dozen detections per image
SCORE = 0.15


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A smoke fit, exported from the command line in both formats (with the README's flags)."""
    root = tmp_path_factory.mktemp("export")
    run_cli(["fit", *SMOKE], cwd=root)
    files = {}
    for fmt in ("onnx", "pt2"):
        proc = run_cli(
            [
                "export",
                *SMOKE,
                f"model.roi_heads.score_thresh={SCORE}",
                "ckpt_path=last",
                f"format={fmt}",
                "export.batch_size=8",
            ],
            cwd=root,
        )
        files[fmt] = Path(
            next(
                line.split("exported: ", 1)[1].split(" (")[0]
                for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                if "exported: " in line
            )
        )
    files["ckpt"] = next((root / "runs" / "fit").glob("*/checkpoints/last.ckpt"))
    return files


def _validation_images() -> torch.Tensor:
    cfg = compose_config(SMOKE)
    data = instantiate(cfg.data)
    data.prepare_data()
    data.setup("validate")
    images = [image for image, _ in data.val_dataloader().dataset]
    return torch.stack(images)  # uint8 [8, 3, 64, 64], as the loader delivers them


def _trained(ckpt: Path, score: float) -> MaskRCNNModule:
    """The checkpoint's module with ``score`` as its detection threshold, configured as a Trainer would."""
    settings = torch.load(ckpt, weights_only=True)["hyper_parameters"]["roi_heads"]
    module = MaskRCNNModule.load_from_checkpoint(
        ckpt, map_location="cpu", weights_only=True, roi_heads={**settings, "score_thresh": score}
    )
    module.configure_model()
    return module.eval()


def _eager(module: MaskRCNNModule, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    with torch.no_grad():
        return module(list(images))


def _assert_same_detections(expected: list[dict[str, torch.Tensor]], outputs: dict[str, np.ndarray]) -> None:
    got = {name: torch.as_tensor(np.asarray(value)) for name, value in outputs.items()}
    assert [len(e["boxes"]) for e in expected] == got["count"].tolist()
    for index, want in enumerate(expected):
        n = len(want["boxes"])
        torch.testing.assert_close(got["boxes"][index, :n], want["boxes"], atol=1e-2, rtol=0)
        torch.testing.assert_close(got["scores"][index, :n], want["scores"], atol=1e-3, rtol=0)
        assert torch.equal(got["labels"][index, :n], want["labels"])
        masks, want_masks = got["masks"][index, :n], want["masks"]
        union = (masks | want_masks).flatten(1).sum(1)
        iou = torch.where(union > 0, (masks & want_masks).flatten(1).sum(1) / union.clamp(min=1), 1.0)
        assert bool((iou >= 0.99).all()), iou


@pytest.mark.slow
def test_onnxruntime_and_the_pt2_program_give_the_eager_detections(exported: dict[str, Path]) -> None:
    images = _validation_images()
    expected = _eager(_trained(exported["ckpt"], SCORE), images)
    assert min(len(e["boxes"]) for e in expected) > 0
    session = ort.InferenceSession(str(exported["onnx"]), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert names == list(OUTPUTS) and [i.name for i in session.get_inputs()] == ["images"]
    _assert_same_detections(expected, dict(zip(names, session.run(None, {"images": images.numpy()}))))
    import lit_amp_det.ops  # noqa: F401  # the program calls the package's ops

    program = torch.export.load(str(exported["pt2"]))
    with torch.no_grad():
        _assert_same_detections(expected, dict(zip(OUTPUTS, program.module()(images))))
    description = json.loads(exported["onnx"].with_suffix(".json").read_text())
    assert description["input"]["shape"] == [8, 3, 64, 64] and description["score_threshold"] == SCORE
    assert list(description["outputs"]) == list(OUTPUTS)
    assert description["classes"][0] == {"label": 1, "name": "circle", "category_id": 1}


@pytest.mark.slow
def test_images_without_a_detection_export_as_a_zero_count(exported: dict[str, Path], tmp_path: Path) -> None:
    images = _validation_images()
    best = sorted(float(e["scores"].max()) for e in _eager(_trained(exported["ckpt"], 0.0), images))
    threshold = (best[3] + best[4]) / 2  # between two images' best scores: half of them keep no detection
    module = _trained(exported["ckpt"], threshold)
    expected = _eager(module, images)
    assert sum(len(e["boxes"]) == 0 for e in expected) >= 4 and max(len(e["boxes"]) for e in expected) > 0
    module.to_onnx(tmp_path / "model.onnx", images)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    _assert_same_detections(expected, dict(zip(OUTPUTS, session.run(None, {"images": images.numpy()}))))
    program = export_detector(module, None, "pt2", sample=images)
    with torch.no_grad():
        _assert_same_detections(expected, dict(zip(OUTPUTS, program.module()(images))))


def _ops_graph(fn, *args) -> ort.InferenceSession:
    """``fn`` (calling the package's ops) exported to ONNX with the translations, in an onnxruntime
    session.
    """
    from lit_amp_det.ops.onnx import translation_table

    class Graph(torch.nn.Module):
        def forward(self, *inputs):
            return fn(*inputs)

    program = torch.onnx.export(
        Graph().eval(), args, dynamo=True, custom_translation_table=translation_table(), verbose=False
    )
    return ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("with_valid", [False, True])
def test_the_onnx_nms_keeps_what_the_op_keeps(with_valid: bool) -> None:
    from lit_amp_det.ops import batched_nms_padded

    gen = torch.Generator().manual_seed(0)
    corners = torch.rand(300, 2, generator=gen) * 200
    boxes = torch.cat([corners, corners + 5 + torch.rand(300, 2, generator=gen) * 60], 1)
    scores, classes = torch.rand(300, generator=gen), torch.randint(0, 5, (300,), generator=gen)
    valid = torch.rand(300, generator=gen) > 0.3 if with_valid else None

    def nms(b, s, c, *v):
        return batched_nms_padded(b, s, c, 0.5, 100, valid=v[0] if v else None, max_class_size=300)

    inputs = (boxes, scores, classes) + ((valid,) if with_valid else ())
    keep, count = nms(*inputs)
    session = _ops_graph(nms, *inputs)
    got_keep, got_count = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)})
    assert int(got_count) == int(count) and np.array_equal(got_keep, keep.numpy())


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [2, -1])
def test_the_onnx_roi_align_pools_what_the_op_pools(aligned: bool, sampling_ratio: int) -> None:
    from lit_amp_det.ops import multi_level_roi_align, roi_align

    gen = torch.Generator().manual_seed(1)
    features = [torch.randn(2, 8, 200 // s, 200 // s, generator=gen) for s in (4, 8, 16)]
    corners = torch.rand(40, 2, generator=gen) * 150
    boxes = torch.cat([corners, corners + 1 + torch.rand(40, 2, generator=gen) * 50], 1)
    rois = torch.cat([torch.randint(0, 2, (40, 1), generator=gen).float(), boxes], 1)
    levels = torch.randint(0, 3, (40,), generator=gen)
    scales = [0.25, 0.125, 0.0625]

    def pooled(f0, f1, f2, r, lv):
        return (
            multi_level_roi_align([f0, f1, f2], r, lv, scales, (7, 7), sampling_ratio, aligned),
            roi_align(f0, r, (7, 7), 0.25, sampling_ratio, aligned),
        )

    inputs = (*features, rois, levels)
    session = _ops_graph(pooled, *inputs)
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)})
    for want, value in zip(pooled(*inputs), got):
        torch.testing.assert_close(torch.from_numpy(value), want, atol=1e-5, rtol=1e-5)


def test_an_unknown_format_is_refused_naming_the_choices(tmp_path: Path) -> None:
    cfg = compose_config(SMOKE, tmp_path)
    module = instantiate(cfg.model, num_classes=4)
    with pytest.raises(ValueError, match=r"format='tflite'; choose one of onnx, pt2"):
        export_detector(module, tmp_path / "model.tflite", "tflite")
    with pytest.raises(ValueError, match=r"export.batch_size=0: give a positive integer"):
        export_detector(module, tmp_path / "model.onnx", "onnx", batch_size=0)
    for size in ([800], [0, 64], ["abc", 64]):
        with pytest.raises(
            ValueError, match=r"export.image_size=.*: give \[height, width\], two positive integers"
        ):
            export_detector(module, None, "pt2", image_size=size)


def test_lightning_s_to_onnx_writes_the_deployable_graph_and_to_torchscript_names_the_alternatives(
    tmp_path: Path,
) -> None:
    cfg = compose_config(SMOKE, tmp_path)
    module = instantiate(cfg.model, num_classes=4)
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    program = module.to_onnx(tmp_path / "model.onnx", images)
    assert (tmp_path / "model.onnx").is_file() and program.model.graph.inputs[0].shape == [2, 3, 64, 64]
    assert json.loads((tmp_path / "model.json").read_text())["input"]["dtype"] == "uint8"
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    boxes, *_, count = session.run(None, {"images": images.numpy()})
    assert boxes.shape == (2, 50, 4) and count.shape == (2,)
    assert module.training  # left as it was
    with pytest.raises(NotImplementedError, match=r"cannot become TorchScript.*to_onnx.*format=pt2"):
        module.to_torchscript()


def test_the_readme_onnxruntime_example_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    import re

    from PIL import Image

    from conftest import REPO

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Deploy") : text.index("## Tests")]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = instantiate(
        compose_config(SMOKE, tmp_path).model,
        num_classes=4,
        class_names=["a", "b", "c"],
        roi_heads={"score_thresh": 0.0, "detections_per_img": 5},
    )
    with torch.no_grad():  # every box is class "b", scored about 1
        module.model.roi_heads.box_predictor.cls_score.bias.copy_(torch.tensor([0.0, 0.0, 20.0, 0.0]))
    module.to_onnx(tmp_path / "model.onnx", torch.zeros((1, 3, 48, 64), dtype=torch.uint8))
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8)).save(
        tmp_path / "picture.jpg"
    )
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed and all(line.startswith("b 1.0 [") for line in printed), printed


@pytest.mark.slow
def test_the_r50_fpn_exports_at_800x1333_from_the_command_line(tmp_path: Path) -> None:
    proc = run_cli(
        ["export", "model=maskrcnn_r50_fpn", "model.backbone.weights=null", "export.image_size=[800,1333]"],
        cwd=tmp_path,
    )
    assert "randomly initialised" in proc.stdout + proc.stderr
    description = json.loads(next((tmp_path / "runs" / "export").glob("*/model.json")).read_text())
    assert description["input"]["shape"] == [1, 3, 800, 1333] and description["format"] == "onnx"
    assert (tmp_path / "runs" / "export").glob(
        "*/model.onnx"
    ).__next__().stat().st_size > 100e6  # the weights too


def test_a_faster_rcnn_exports_without_masks(tmp_path: Path) -> None:
    cfg = compose_config(
        ["model=fasterrcnn_light", "model.transform.min_size=96", "model.transform.max_size=96"]
    )
    module = instantiate(cfg.model, num_classes=3).eval()
    images = torch.randint(
        0, 256, (2, 3, 96, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = module(list(images))
    module.to_onnx(tmp_path / "model.onnx", images)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert names == ["boxes", "scores", "labels", "count"]
    got = dict(zip(names, session.run(None, {"images": images.numpy()})))
    assert got["count"].tolist() == [len(e["boxes"]) for e in expected]
    for index, want in enumerate(expected):
        torch.testing.assert_close(
            torch.from_numpy(got["boxes"][index, : len(want["boxes"])]), want["boxes"], atol=1e-2, rtol=0
        )


def test_a_detector_of_another_kind_is_refused_naming_it() -> None:
    class Classifier(MaskRCNNModule):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1))

    with pytest.raises(
        TypeError, match=r"FasterRCNN or MaskRCNN; Classifier.build_model\(\) made a Sequential"
    ):
        export_detector(Classifier(4), None, "pt2", image_size=[32, 32])
