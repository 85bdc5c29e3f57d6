# make up   : set up (once) and run router + prefill + decode on loopback (demo model unless MODEL=dir)
# make test : set up (once), lint (ruff, mypy, stubs) and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?=
ARGS ?=

.PHONY: up test lint setup protos protos-check clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.4"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(BIN)/pdserve up $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: lint
	$(BIN)/python -m pytest -q $(ARGS)

# lint: generated stubs up to date, ruff (lint + format), mypy over the pdserve package
lint: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/typecheck.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
