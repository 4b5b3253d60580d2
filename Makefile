# Two commands on a fresh machine:  `make demo` runs the main job, `make test` runs the tests.
# Each installs what it needs into .venv first (CPU torch before the package, so pip never
# pulls a multi-GB CUDA build).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,app,export]"
	touch $(STAMP)

# The Hydra app with its defaults: pretrain a small CNN on digits, stick 5% of its conv weights
# at random values, retrain around them, verify the pins and report (outputs/<date>/<time>/).
demo: $(STAMP)
	$(PY) -m lightning_pin.train

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) lightning_logs outputs multirun .pytest_cache .hypothesis build dist lightning_pin.egg-info
