# One-command set-up for a fresh machine with only python3 and make.
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

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python scripts/demo.py --out demo_out

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) demo_out .pytest_cache
