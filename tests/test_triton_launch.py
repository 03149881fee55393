"""Triton launches without the dispatcher (issue 53, point 5).

An eager launch of a compiled kernel goes straight to Triton's launcher: it neither enters ``wrap_triton``'s
higher-order op nor keeps anything in ``kernel_side_table``; a trace (``make_fx``, non-strict
``torch.export``, ``torch.compile``) still records each launch as a ``triton_kernel_wrapper_mutation`` node;
``torch.compile`` over an op still sees the custom op (its fake kernel) and runs the Triton launcher when the
graph runs.

No GPU is needed: the kernels are compiled for sm_90 and launched up to the driver call with the stand-ins of
``tools/triton_launch_overhead.py`` (Triton's driver answers device 0, the compiled kernel's C launcher counts
calls, tensors report ``cuda:0``). The tests of eager launches also make the launch as it was made before
(``before``): each check sees what it looks for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_amp_det.ops.triton import _launch, _register
from ops_inputs import needs_extension, random_boxes

triton = pytest.importorskip("triton")

from torch._higher_order_ops.triton_kernel_wrap import (  # noqa: E402
    TritonKernelWrapperMutation,
    kernel_side_table,
)

import triton_launch_overhead  # noqa: E402  (tools/; after the skip, as it launches Triton kernels)

LAUNCHES = 1000


@pytest.fixture(scope="module")
def iou_launch() -> Iterator[triton_launch_overhead.Launch]:
    """The IoU matrix's launch, compiled for sm_90, the stand-in GPU active while the module's tests run."""
    kernels = _launch.load_kernels(interpret=False)
    with triton_launch_overhead.stand_in_gpu():
        launch = next(
            x for x in triton_launch_overhead.recorded_launches(kernels) if x.name == "box_iou_kernel"
        )
        _launch._launch(launch.kernel, launch.grid, *launch.args, **launch.meta)  # compiles
        yield launch


def _run(launch: triton_launch_overhead.Launch, path=None) -> None:
    (path or _launch._launch)(launch.kernel, launch.grid, *launch.args, **launch.meta)


def _driver_calls() -> int:
    return triton_launch_overhead._StandInLauncher.calls


def _side_table() -> tuple[int, int, int]:
    return (
        len(kernel_side_table.id_to_kernel),
        len(kernel_side_table.kernel_to_id),
        len(kernel_side_table.constant_args),
    )


@pytest.fixture
def dispatcher_entries(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each call of ``torch.library.wrap_triton`` and of its higher-order op."""
    entries: list[str] = []
    wrap_triton, hop_call = torch.library.wrap_triton, TritonKernelWrapperMutation.__call__

    def spy_wrap(kernel):
        entries.append("wrap_triton")
        return wrap_triton(kernel)

    def spy_hop(self, *args, **kwargs):
        entries.append("triton_kernel_wrapper_mutation")
        return hop_call(self, *args, **kwargs)

    monkeypatch.setattr(torch.library, "wrap_triton", spy_wrap)
    monkeypatch.setattr(TritonKernelWrapperMutation, "__call__", spy_hop)
    return entries


def test_a_thousand_eager_launches_keep_nothing_in_the_side_table(iou_launch):
    tables, calls = _side_table(), _driver_calls()
    for _ in range(LAUNCHES):
        _run(iou_launch)
    assert _driver_calls() - calls == LAUNCHES, "every launch reaches the driver call"
    assert _side_table() == tables
    # the launch as it was made before keeps one entry per call: the check above would see a leak
    _run(iou_launch, triton_launch_overhead.before)
    _run(iou_launch, triton_launch_overhead.before)
    assert _side_table()[2] == tables[2] + 2


def test_eager_launches_do_not_enter_the_dispatcher(iou_launch, dispatcher_entries):
    calls = _driver_calls()
    _run(iou_launch)
    assert _driver_calls() == calls + 1
    assert dispatcher_entries == []
    _run(iou_launch, triton_launch_overhead.before)
    assert dispatcher_entries == ["wrap_triton", "triton_kernel_wrapper_mutation"]


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_under_a_counting_dispatch_mode_the_launch_runs_directly(iou_launch, dispatcher_entries):
    """A profiler's ``TorchDispatchMode`` (not a trace) sees the ops around a launch; the launch itself runs
    directly. Through ``wrap_triton`` it raised: its higher-order op has no rule for such a mode.
    """
    calls = _driver_calls()
    with _CountOps() as mode:
        _run(iou_launch)
    assert _driver_calls() == calls + 1 and dispatcher_entries == [] and mode.ops == []
    with _CountOps(), pytest.raises(NotImplementedError, match="no rule registered for HigherOrderOperator"):
        _run(iou_launch, triton_launch_overhead.before)


def _fake_cuda_boxes() -> tuple[torch.Tensor, torch.Tensor, object]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        return torch.empty(30, 4, device="cuda"), torch.empty(5, 4, device="cuda"), mode


def _triton_nodes(graph: torch.fx.Graph) -> list[str]:
    return [n.target.name() for n in graph.nodes if isinstance(n.target, TritonKernelWrapperMutation)]


def test_make_fx_records_each_launch(iou_launch):
    from torch.fx.experimental.proxy_tensor import make_fx

    boxes1, boxes2, _ = _fake_cuda_boxes()
    calls = _driver_calls()
    graph = make_fx(_launch.box_iou, tracing_mode="fake")(boxes1, boxes2).graph
    assert _triton_nodes(graph) == ["triton_kernel_wrapper_mutation"]
    assert _driver_calls() == calls, "a trace on fake tensors launches nothing"


def test_non_strict_export_records_each_launch(iou_launch):
    class Iou(torch.nn.Module):
        def forward(self, boxes1: torch.Tensor, boxes2: torch.Tensor) -> torch.Tensor:
            return _launch.box_iou(boxes1, boxes2)

    boxes1, boxes2, mode = _fake_cuda_boxes()
    with mode:
        program = torch.export.export(Iou(), (boxes1, boxes2), strict=False)
    assert _triton_nodes(program.graph) == ["triton_kernel_wrapper_mutation"]


def test_while_dynamo_traces_the_launch_goes_through_wrap_triton(iou_launch, dispatcher_entries, monkeypatch):
    """Dynamo folds ``torch.compiler.is_compiling()`` to True; the launch it traces is the wrapped one (Dynamo
    itself recognises Triton kernels only where a GPU is present, so its trace is checked on a GPU).
    """
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _run(iou_launch)
    assert dispatcher_entries[:1] == ["wrap_triton"]


@needs_extension
def test_compile_fullgraph_over_the_op_runs_the_triton_launcher_when_the_graph_runs(monkeypatch):
    """``lit_amp_det::box_iou`` with the Triton launcher as its kernel (on the CPU: interpreted, standing in
    for the CUDA kernel ``_register`` installs): one graph, the op in it through its fake kernel, and the
    launcher runs only when the compiled graph runs, outside any trace, which is where ``_launch`` launches
    directly.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches: list[tuple[bool, bool]] = []
    launch = _launch._launch

    def spy(kernel, grid, *args, **meta):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        launches.append(
            (torch.compiler.is_compiling() or _launch._without_data(tensors), _launch._tracing_mode())
        )
        return launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(_launch, "_launch", spy)
    library = torch.library.Library("lit_amp_det", "IMPL")
    try:
        library.impl("box_iou", _register._box_iou, "CPU")  # overrides the C++ kernel until _destroy
        boxes = random_boxes(40, image=(100, 100), max_size=50)

        def iou(boxes: torch.Tensor) -> torch.Tensor:
            return torch.ops.lit_amp_det.box_iou(boxes, boxes[:7]) * 2

        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, example_inputs):
            graphs.append(gm)
            return gm

        compiled = torch.compile(iou, fullgraph=True, backend=backend)
        got = compiled(boxes)
    finally:
        library._destroy()
    expected = torch.ops.lit_amp_det.box_iou(boxes, boxes[:7]) * 2  # the C++ CPU kernel again
    torch.testing.assert_close(got, expected)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.lit_amp_det.box_iou in targets, targets  # the custom op, traced by its fake kernel
    assert launches == [(False, False)], "the launcher ran once, when the graph ran, outside any trace"
