# One-command set-up for a fresh machine with only python3 and make.
#   make demo: the core install (`pip install -e .`: JAX, Flax, optax, the MILP solver, matplotlib; no GPU
#              compiler, no Hugging Face stack), then scripts/demo.py.
#   make test: the dev extras on top (pytest, ruff, import-linter, the XLA:GPU compiler for deviceless
#              compiles, transformers, pyarrow), then the suite. `make demo` then `make test` upgrades the venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# The dev extras install the CUDA plugin (deviceless XLA:GPU compiles); without a GPU driver its start-up
# check fails loudly unless JAX is told to use the CPU.
export JAX_PLATFORMS ?= cpu

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

# One stamp per install: the dev install covers the core one too. The core install skips byte-compiling
# (--no-compile): Python compiles the modules the demo imports on first use, not all of SciPy and SymPy.
$(VENV)/.installed-core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(VENV)/.installed-core

demo: $(VENV)/.installed-core
	$(BIN)/python scripts/demo.py --out demo_out

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) demo_out .pytest_cache
