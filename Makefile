# Quick start: `make test` runs the test suite, `make train` trains the built-in tiny model,
# `make test-gpu` runs the gpu-marked tests on a CUDA machine, `make export-check` exports the
# upstream PR stack and tests the exported tree (docs/upstreaming.md).
# All of them create .venv (Python >= 3.12, preferring 3.12, from PATH or pyenv) and install the project on first use;
# `make <target> PYTHON=python3` uses that interpreter as it is instead (a machine whose Python already has
# torch, megatron-core, mamba_ssm and the test packages, and no package index: CONTRIBUTING.md).

VENV := .venv
ifdef PYTHON
PY := $(PYTHON)
STAMP :=
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
endif
# Processes that share the GPU in `make test-gpu` (pytest-xdist): half the CPU cores, at most 8.
# Most of a GPU test's time is kernel compilation and imports on the host, which they run side by
# side (on a fresh 16-core H200 machine, 8 processes took 173 s where 4 were not done after 270).
GPU_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n / 2)); echo $$((n < 1 ? 1 : n > 8 ? 8 : n)))

.PHONY: test test-gpu train export-check

ifndef PYTHON
$(PY):
	@python=""; \
	for c in python3.12 python3 python3.13; do \
	  p=$$(command -v $$c) && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	    && python=$$p && break; \
	done; \
	if [ -z "$$python" ] && command -v pyenv >/dev/null; then \
	  for v in $$(pyenv versions --bare | grep -E '^3\.1[2-9]' | sort -V); do \
	    python=$$(PYENV_VERSION=$$v pyenv which python3 2>/dev/null) && break; \
	  done; \
	fi; \
	if [ -z "$$python" ]; then echo "make: need Python >= 3.12 on PATH or through pyenv" >&2; exit 1; fi; \
	echo "creating $(VENV) with $$python"; $$python -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)
endif

test: $(STAMP)
	TORCH_COMPILE_DISABLE=1 $(PY) -m pytest -q

# The gpu-marked tests on a CUDA machine (torch.compile on, mamba_ssm autotuning off), each test
# file in one of GPU_WORKERS processes (module fixtures compile once); in one process where
# pytest-xdist is missing.
test-gpu: $(STAMP)
	@if $(PY) -c 'import xdist' 2>/dev/null; then workers="-n $(GPU_WORKERS) --dist loadfile"; \
	else echo "make: pytest-xdist not found: the GPU tests run in one process"; workers=""; fi; \
	MAMBA_DETERMINISTIC=1 TORCH_COMPILE_DISABLE=0 $(PY) -m pytest -q -m gpu $$workers --durations=20

train: $(STAMP)
	TORCH_COMPILE_DISABLE=1 $(PY) pretrain_hybrid.py --shared-prefix-packing

export-check: $(STAMP)
	$(PY) tools/check_pr_stack.py
