# Two commands on a fresh machine:  `make demo` runs the main job, `make test` runs the tests.
# Each installs what it needs into .venv first: torch from PyTorch's CPU wheel index when that
# index answers (so pip does not pull a multi-GB CUDA build), else from the default index.
#   make install TORCH_INDEX=cpu       # default: the CPU index first, then the default index
#   make install TORCH_INDEX=default   # the default index only (on Linux: the CUDA build)
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu126   # any index URL

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# torchvision built for that torch (model=torchvision, data=cifar10): installed beside it from the same CPU index.
# A torchvision that does not load beside this torch (a CUDA build found on a local mirror) is uninstalled again:
# torchmetrics imports torchvision when it is installed. From the default index it is not tried at all.
VISION_SPEC ?= torchvision==0.28.0
# torchao built for that torch (the [deploy] extra: to_torchao, faults --deploy torchao-int8). Installed with
# --no-deps after the extras: a resolver pass over torchao would be free to pick a build for another torch.
# The rest of [deploy] (onnx, onnxscript, onnxruntime) comes with the export extra.
TORCHAO_SPEC ?= torchao==0.18.0
TORCH_INDEX ?= cpu
ifeq ($(TORCH_INDEX),cpu)
TORCH_URL := https://download.pytorch.org/whl/cpu
else ifeq ($(TORCH_INDEX),default)
TORCH_URL :=
else
TORCH_URL := $(TORCH_INDEX)
endif
STAMP := $(VENV)/.installed
# Packages are installed without compiling their bytecode (as uv does): Python compiles a module the first
# time it is imported and keeps it in __pycache__, so only what is used is compiled. Measured on 2 cores:
# the install takes 30 s instead of 97 s, and the tests run no slower. Those files are kept even where the
# environment asks otherwise (PYTHONDONTWRITEBYTECODE): there every process (the suite starts about a
# hundred: DDP ranks, the CLI, the app) would compile again what it imports, torch and this package included.
PIP := $(PY) -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test docs clean

install: $(STAMP)

# The CPU index is probed with a short timeout and no retries, so where it cannot be reached
# (offline mirrors, firewalls) the fallback starts within seconds instead of hanging.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || { \
	  { test -n "$(TORCH_URL)" && \
	    $(PIP) --timeout 5 --retries 0 --index-url "$(TORCH_URL)" "$(TORCH_SPEC)" && \
	    { { $(PIP) --timeout 5 --retries 0 --index-url "$(TORCH_URL)" "$(VISION_SPEC)" && \
	        $(PY) -c "import torchvision" 2>/dev/null; } || \
	      { $(PY) -m pip uninstall -q -y torchvision 2>/dev/null; \
	        echo "make: no $(VISION_SPEC) that loads beside this torch; model=torchvision and data=cifar10 need it"; }; }; } || \
	  { test -z "$(TORCH_URL)" || echo "make: no $(TORCH_SPEC) from $(TORCH_URL); trying the default index"; \
	    $(PIP) "$(TORCH_SPEC)"; }; }
	$(PIP) -e ".[dev,app,export,tune,cluster,docs]"
	$(PIP) --no-deps "$(TORCHAO_SPEC)"
	touch $(STAMP)

# The Hydra app with its defaults: pretrain a small CNN on digits, stick 5% of its conv weights
# at random values, retrain around them, verify the pins and report (outputs/<date>/<time>/).
demo: $(STAMP)
	$(PY) -m lightning_pin.train

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist loadgroup

# The docs site (mkdocs.yml, docs/), strict: a warning or a broken link fails the build. The reference
# pages (API, CLI, config groups) are generated from the code by tools/docs_hooks.py while it builds.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site lightning_logs outputs multirun .pytest_cache .hypothesis build dist lightning_pin.egg-info
