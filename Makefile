# Two commands from a fresh clone: `make fit` and `make test` (both install first).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lit_amp_det-installed
ARGS   ?=

.PHONY: install fit test clean-runs

install: $(STAMP)

# Idempotent: reuses .venv and anything already installed; reruns only when the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	touch $(STAMP)

# Trains the default light Mask R-CNN on the embedded shapes dataset and prints bbox and segm mAP.
fit: install
	$(PY) -m lit_amp_det fit $(ARGS)

test: install
	$(PY) -m pytest -q tests $(ARGS)

clean-runs:
	rm -rf runs
