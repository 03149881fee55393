# Two commands from a fresh clone: `make fit` and `make test` (both install first).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lit_amp_det-installed
ARGS   ?=

.PHONY: install ext fit test lint gpu-check gpu-compile clean-runs

install: $(STAMP) ext

# Idempotent: reuses .venv and anything already installed; reruns only when the pins change. torch comes
# first because the extension is compiled against it (hence --no-build-isolation); the other packages and the
# extension build then run side by side (-j2 below). pip's byte-compiling stays: with PYTHONDONTWRITEBYTECODE=1 (set on
# CI) every process would otherwise compile torch's sources again. No second copy of the ~6 GB of wheels goes into
# pip's cache.
PIP_FLAGS := --quiet --disable-pip-version-check --no-cache-dir
TORCH_STAMP := $(VENV)/.torch-installed
MAKEFLAGS += -j2
$(TORCH_STAMP): constraints.txt
	@echo "install [$$(date +%T)] torch, torchvision into $(VENV) (~3 GB): 40 s on the idle 2-core CI machine, 3 min loaded"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt setuptools ninja torch torchvision
	touch $(TORCH_STAMP)

$(STAMP): $(TORCH_STAMP) pyproject.toml constraints.txt setup.py
	@echo "install [$$(date +%T)] lightning, torchmetrics, hydra, pycocotools, test tools and lit_amp_det (editable)"
	LIT_AMP_DET_BUILD_EXT=0 $(PY) -m pip install $(PIP_FLAGS) --no-build-isolation -c constraints.txt -e ".[test]"
	touch $(STAMP)
	@echo "install [$$(date +%T)] packages done"

# Compiles lit_amp_det/_C*.so in place: the op schemas and their C++ CPU kernels (no nvcc: the CUDA kernels are
# Triton kernels in lit_amp_det/ops/triton, compiled at run time). Incremental: a no-op when nothing changed.
ext: $(TORCH_STAMP)
	@echo "build   [$$(date +%T)] the C++ extension lit_amp_det/_C (schemas, CPU kernels): 40 s to 2.5 min the first time"
	$(PY) setup.py --quiet build_ext --inplace
	@echo "build   [$$(date +%T)] extension ready"

# Trains the default light Mask R-CNN on the embedded shapes dataset and prints bbox and segm mAP.
fit: install
	$(PY) -m lit_amp_det fit $(ARGS)

# Two pytest workers (the CI machine has two cores), one torch thread each, the slow tests first and an idle worker
# taking over the other's queue, so that both end together: tests/conftest.py.
test: install
	$(PY) -m pytest -q -n 2 --dist worksteal tests $(ARGS)

# The formatter's layout and the linter's rules (pyproject.toml: [tool.ruff]) over the package, tests and tools; CI
# runs it before the tests. `$(VENV)/bin/ruff format .` and `$(VENV)/bin/ruff check --fix .` repair most findings.
lint: install
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

# On a GPU machine, within six minutes on an H100 (each step has its time budget, lit_amp_det/bench/gpu_check.py): the
# extension's build, the op tests on CUDA (compiled Triton kernels), bench ops and short train/infer rows (R50-FPN
# 800x1333, batch 8; ARGS=--full for all of them); writes runs/gpu_check/<timestamp>/gpu_check.md. Never runs pip
# (GPU machines may reach no registry): .venv's Python if there is one, else python3 with the packages importable.
# Stops at once, measuring nothing, without a GPU; ARGS=--rehearse times the steps on the CPU.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m lit_amp_det.bench.gpu_check $(ARGS)

# Every Triton launch of the model compiled for sm_80/90/100 (and gfx942): registers and spills, no GPU needed.
gpu-compile: install
	$(PY) tools/triton_compile.py $(ARGS)

clean-runs:
	rm -rf runs
