"""The import graph: no cycles, and every module imports only from its own layer or the layers below it.

Layers, bottom up (``errors``, the library's argument error, and ``settings``, the typed defaults of every
config node, under all of them): ``profiling`` and ``ops``
(kernels and their front end) -> ``precision``, ``data``, ``models`` -> ``deploy`` -> ``module``,
``module_settings``, ``optim``, ``checkpoints``, ``checkpoint_io``, ``distributed``, ``slurm`` ->
``callbacks`` (each on its own: no callback imports another) -> the application: the ``app`` package
(``tasks``, ``config``, ``runs``, ``sweep``, ``launch``: Hydra and launch plumbing), ``bench`` and ``cli``.
The core (the module, models, precision, callbacks, data, ops) holds no CPU-only speed transform. Read from
the source (``ast``), so nothing is imported and lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lit_amp_det"

#: module prefix -> the prefixes it may import from (besides itself and its own package)
ALLOWED = {
    "lit_amp_det.errors": (),
    "lit_amp_det.settings": (),
    "lit_amp_det.profiling": (),
    "lit_amp_det.ops": (),
    "lit_amp_det.precision": (),
    "lit_amp_det.data": (),
    "lit_amp_det.models": ("lit_amp_det.ops",),
    "lit_amp_det.optim": ("lit_amp_det.ops",),  # the layout checks of the fused optimizers' step hook
    "lit_amp_det.distributed": (),
    "lit_amp_det.slurm": (),
    "lit_amp_det.checkpoints": (),
    "lit_amp_det.checkpoint_io": (),
    "lit_amp_det.module_settings": ("lit_amp_det.optim",),
    "lit_amp_det.deploy": (
        "lit_amp_det.models",
        "lit_amp_det.ops",
    ),  # the exported graph and its ONNX translations
    "lit_amp_det.module": (
        "lit_amp_det.models",
        "lit_amp_det.data",
        "lit_amp_det.optim",
        "lit_amp_det.module_settings",
        "lit_amp_det.checkpoints",
        "lit_amp_det.distributed",
        "lit_amp_det.precision",
        "lit_amp_det.deploy",
    ),
    "lit_amp_det.callbacks": (
        "lit_amp_det.module",  # CUDAGraphTraining installs its captured step through the module's hook
        "lit_amp_det.profiling",
        "lit_amp_det.models",
        "lit_amp_det.precision",
        "lit_amp_det.distributed",
        "lit_amp_det.slurm",
    ),
}
APPLICATION = ("lit_amp_det.app", "lit_amp_det.bench", "lit_amp_det.cli")
#: what every layer may import: the error type they raise and the typed config defaults (both import only
#: each other from the package)
BASE = ("lit_amp_det.errors", "lit_amp_det.settings")
#: modules in callbacks/ that are not callbacks, but the measuring or reporting parts of one
CALLBACK_HELPERS = ("lit_amp_det.callbacks.memory_savings", "lit_amp_det.callbacks.drawing")
#: the package face (lazy re-exports) and the ``python -m`` entry sit on top of everything
TOP = ("lit_amp_det", "lit_amp_det.__main__")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports; importing through one's own parent package does not count."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if (
                candidate.startswith("lit_amp_det")
                and candidate != name
                and not name.startswith(candidate + ".")
            ):
                targets.add(candidate)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> str | None:
    matches = [prefix for prefix in ALLOWED if name == prefix or name.startswith(prefix + ".")]
    return max(matches, key=len) if matches else None


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            assert state.get(target) != 1, " -> ".join(path[path.index(target) :] + [target])
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_library_modules_import_only_from_their_layer_or_below():
    graph = _graph()
    checked = 0
    for name, targets in sorted(graph.items()):
        layer = _layer(name)
        if layer is None:
            assert name in TOP or name.startswith(APPLICATION), (
                f"{name} belongs to no layer; add it to ALLOWED or app"
            )
            continue
        checked += 1
        for target in targets:
            if (
                layer == "lit_amp_det.callbacks"
                and target.startswith("lit_amp_det.callbacks")
                and target not in CALLBACK_HELPERS
            ):
                assert name == "lit_amp_det.callbacks", f"callback {name} imports callback {target}"
                continue
            if target in BASE:
                continue
            assert target == layer or target.startswith(layer + ".") or target.startswith(ALLOWED[layer]), (
                f"{name} ({layer} layer) imports {target}, which is not below it"
            )
    assert checked > 30


def test_application_modules_live_in_the_app_package():
    """Hydra/launch plumbing stays out of the library's top level: only the package face, ``cli`` and the
    library layers sit directly in ``lit_amp_det``.
    """
    top_level = {name for name in _graph() if name.count(".") == 1}
    misplaced = {name for name in top_level if _layer(name) is None and name not in TOP + APPLICATION}
    assert not misplaced, f"move {sorted(misplaced)} into lit_amp_det/app/ or give them a library layer"
    assert {
        "lit_amp_det.app.tasks",
        "lit_amp_det.app.config",
        "lit_amp_det.app.runs",
        "lit_amp_det.app.sweep",
        "lit_amp_det.app.launch",
    } <= set(_graph())


#: The core: what every user's training step runs. It holds no CPU-only speed machinery.
CORE = (
    "lit_amp_det.module",
    "lit_amp_det.models",
    "lit_amp_det.precision",
    "lit_amp_det.callbacks",
    "lit_amp_det.data",
    "lit_amp_det.ops",
)


def _in_core(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in CORE)


def _transform_classes() -> dict[str, tuple[str, ...] | None]:
    """``module.Class`` -> the device types it declares (``default_devices``; None when it inherits them) for
    every class of the package that subclasses a ``ModelTransform`` (read from the source, transitively).
    """
    classes: dict[str, tuple[list[str], tuple[str, ...] | None]] = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            devices = None
            for statement in node.body:
                targets = getattr(statement, "targets", [getattr(statement, "target", None)])
                if (
                    "default_devices" in [getattr(t, "id", None) for t in targets]
                    and statement.value is not None
                ):
                    try:
                        devices = tuple(ast.literal_eval(statement.value))
                    except ValueError:  # a name (the base class's DEVICE_TYPES): every device
                        devices = None
            classes[f"{name}.{node.name}"] = (bases, devices)
    by_short = {qualified.rpartition(".")[2]: qualified for qualified in classes}
    found: dict[str, tuple[str, ...] | None] = {}
    for qualified, (_, devices) in classes.items():
        seen, todo = set(), [qualified]
        while todo:
            current = todo.pop()
            for base in classes.get(current, ([], None))[0]:
                if base == "ModelTransform":
                    found[qualified] = devices
                elif base in by_short and base not in seen:
                    seen.add(base)
                    todo.append(by_short[base])
    return found


def test_the_transform_scan_finds_the_packages_transforms_and_their_devices():
    """The check below relies on this scan: it finds every transform and reads the device types each declares
    (a transform that declared only ``cpu`` would be read as CPU-only the way ``SyncFree``'s ``cuda`` is read
    here).
    """
    found = _transform_classes()
    assert {"lit_amp_det.models.speedups.ExtensionOps", "lit_amp_det.models.speedups.ChannelsLast"} <= set(
        found
    )
    assert found["lit_amp_det.models.speedups.SyncFree"] == ("cuda",)
    assert found["lit_amp_det.models.speedups.ExtensionOps"] is None  # every device (the base class's)


def test_no_core_module_holds_or_imports_a_cpu_only_transform():
    """A speed trick for one CPU lives outside the core, applies only where it declares, and no core module
    imports it: the core is what a GPU user runs.
    """
    graph = _graph()
    cpu_only = {
        qualified.rpartition(".")[0]
        for qualified, devices in _transform_classes().items()
        if devices is not None and "cuda" not in devices
    }
    assert not {module for module in cpu_only if _in_core(module)}, "a CPU-only transform lives in the core"
    for name, targets in graph.items():
        if _in_core(name):
            assert not targets & cpu_only, (
                f"{name} imports a CPU-only transform: {sorted(targets & cpu_only)}"
            )
