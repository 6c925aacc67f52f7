# kubesgl: the two commands that matter are `make up` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install up test lint fmt clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: the CPU wheel lies on the machine; any other spec pulls a CUDA build.
$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/kubesgl up $(ARGS)

test: $(STAMP)
	bash tests/run.sh $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
