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

# lint and the SDK checks (and their set-ups: pip, npm, go) side by side, then the suite
test:
	$(MAKE) --no-print-directory -j2 lint sdk-check
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

# --- client SDKs (clients/go, clients/ts; docs/api.md): `make test` runs sdk-check and the contract tests ---
# sdk-setup: the Go toolchain from Debian (as root; apt-get) and clients/ts's pinned npm packages (buf, protoc-gen-es,
# connect, typescript); sdk: build both clients; sdk-check: buf lint + breaking, generated code and docs up to date,
# the Go client's unit tests (the three-language contract runs in pytest: tests/clients/test_contract.py).
.PHONY: sdk-setup sdk sdk-check stubs release-api-image
SDK_STAMP := build/.sdk-toolchain
TS_STAMP := clients/ts/node_modules/.installed
GO_DEBS := golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev
GOPATH_DIR := $(CURDIR)/build/gopath
GO_SRC := $(GOPATH_DIR)/src/github.com/pdserve/pdserve/clients/go
# no module proxy needed: GOPATH mode over Debian's /usr/share/gocode (with a proxy: cd clients/go && go mod tidy && go build ./...)
GO_ENV := GO111MODULE=off GOPATH=$(GOPATH_DIR):/usr/share/gocode GOCACHE=$(CURDIR)/build/gocache
BUF := clients/ts/node_modules/.bin/buf
GO_CONTRACT := build/go-bin/pdserve-contract
TS_CONTRACT := clients/ts/dist/examples/contract.js

$(SDK_STAMP):
	@if ! command -v go >/dev/null || ! command -v protoc-gen-go-grpc >/dev/null || ! test -d /usr/share/gocode/src/google.golang.org/grpc; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "make sdk-setup: the Go toolchain is missing and apt-get cannot run here (needs root): apt-get install $(GO_DEBS)" >&2; exit 1; fi; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(GO_DEBS); fi
	@command -v node >/dev/null && command -v npm >/dev/null || { echo "make sdk-setup: node >= 18 and npm are needed" >&2; exit 1; }
	mkdir -p build && touch $@

$(TS_STAMP): $(SDK_STAMP) clients/ts/package.json clients/ts/package-lock.json
	cd clients/ts && npm ci --no-audit --no-fund
	touch $@

sdk-setup: $(SDK_STAMP) $(TS_STAMP)

$(GO_CONTRACT): $(SDK_STAMP) $(shell find clients/go -name '*.go')
	mkdir -p $(dir $(GO_SRC)) && ln -sfn $(CURDIR)/clients/go $(GO_SRC)
	cd $(GO_SRC) && $(GO_ENV) go vet ./... && $(GO_ENV) go build -o $(CURDIR)/build/go-bin/ ./cmd/...

$(TS_CONTRACT): $(TS_STAMP) clients/ts/tsconfig.json $(shell find clients/ts/src -name '*.ts')
	cd clients/ts && node_modules/.bin/tsc -p tsconfig.json

sdk: $(GO_CONTRACT) $(TS_CONTRACT)

sdk-check: sdk $(DEV_STAMP)
	$(BUF) lint protos
	$(BUF) breaking protos --against protos/released/pdserve-v1.json
	$(BIN)/python scripts/gen_stubs.py --check
	cd $(GO_SRC) && $(GO_ENV) go test ./...

stubs: $(DEV_STAMP) $(TS_STAMP)
	$(BIN)/python scripts/gen_stubs.py

# at a release: the public API image `buf breaking` compares against from then on
release-api-image: $(TS_STAMP)
	cd protos && ../$(BUF) build --path pdserve/v1/generate.proto --exclude-source-info -o released/pdserve-v1.json

