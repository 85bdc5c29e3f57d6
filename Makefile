# make up   : install the runtime (once) and run router + prefill + decode + gateway on loopback
#             (variables: MODEL=dir|org/name, PORT=router gRPC port, GATEWAY_PORT=HTTP port, ARGS="more flags")
# make test : install the dev toolchain too (once), lint (ruff, mypy, stubs) and run the test suite
# make compose-up : the whole stack in containers (deploy/docker-compose.yml); GPU=1 for the GPU profile
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
MODEL ?=
PORT ?=
GATEWAY_PORT ?=
ARGS ?=

.PHONY: up test lint setup setup-dev protos protos-check clean compose-up

# the runtime: pyproject's main dependencies (what `pdserve up` needs)
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.4"
	$(BIN)/pip install -q -e .
	touch $(STAMP)

# the dev toolchain on top (pytest, ruff, mypy, triton's interpreter, deploy/ linters): `make test` only
$(DEV_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[dev]"
	touch $(DEV_STAMP)

setup: $(STAMP)
setup-dev: $(DEV_STAMP)

up: $(STAMP)
	$(BIN)/pdserve up $(if $(MODEL),--model $(MODEL)) $(if $(PORT),--port $(PORT)) \
		$(if $(GATEWAY_PORT),--gateway-port $(GATEWAY_PORT)) $(ARGS)

test: lint
	$(BIN)/python -m pytest -q $(ARGS)

# lint: generated stubs up to date, ruff (lint + format), mypy over the pdserve package
lint: $(DEV_STAMP)
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/typecheck.py

compose-up:
	docker compose -f deploy/docker-compose.yml $(if $(GPU),--profile gpu) up --build $(ARGS)

protos: $(DEV_STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
