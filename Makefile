# Kiln's entry points. `make demo` and `make test` work on a fresh clone: they create .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The state folder (Dagster home, MLflow store, storage root): KILN_STATE_DIR, as the CLI reads it.
STATE := $(or $(KILN_STATE_DIR),$(CURDIR)/.kiln)
export DAGSTER_HOME ?= $(STATE)/dagster
UI_PORT ?= 3000
MLFLOW_PORT ?= 5000
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-quick ui mlflow clean

$(BIN)/kiln: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build (any other spec pulls GBs of CUDA wheels).
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

install: $(BIN)/kiln

demo: install
	$(BIN)/kiln demo

# Tests also cover the optional lm-evaluation-harness step ([eval]) and compare C4's line removal
# with datatrove's own filter ([bench]), so they install both extras.
$(VENV)/.test-extras: $(BIN)/kiln
	$(BIN)/pip install --quiet -e '.[dev,eval,bench]'
	@touch $@

test: $(VENV)/.test-extras
	$(BIN)/python -m pytest -q

test-quick: $(VENV)/.test-extras
	$(BIN)/python -m pytest -q -m "not slow"

ui: install
	@# $(DAGSTER_HOME)/dagster.yaml: sqlite, or Postgres when DAGSTER_PG_HOST/USER/DB (+PASSWORD, PORT) are set.
	@$(BIN)/python -m workflows.instance >/dev/null
	$(BIN)/dagster dev -m workflows.definitions -h 127.0.0.1 -p $(UI_PORT)

mlflow: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(STATE)/mlflow.db --host 127.0.0.1 --port $(MLFLOW_PORT)

clean:
	rm -rf $(STATE)
