# make up   : set up (once) and run router + prefill + decode on loopback (demo model unless MODEL=dir)
# make test : set up (once), lint (ruff, mypy, stubs) and run the test suite
# make compose-up : the whole stack in containers (deploy/docker-compose.yml); GPU=1 for the GPU profile
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?=
ARGS ?=

.PHONY: up test lint setup protos protos-check clean compose-up

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

compose-up:
	docker compose -f deploy/docker-compose.yml $(if $(GPU),--profile gpu) up --build $(ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
