# kubesgl: the two commands that matter are `make up` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install up test fuzz lint fmt clean

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

# Open-ended fuzzing of a live stack with a fresh seed (printed: `make fuzz SEED=<n>` replays a failure).
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	@seed=$${SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "fuzz: $(FUZZ_EXAMPLES) examples per operation, seed $$seed (replay: make fuzz SEED=$$seed)"; \
	KUBESGL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PATH="$$PWD/$(BIN):$$PATH" $(BIN)/python -m pytest -q -s \
	  -p no:cacheprovider tests/test_fuzz_gateway.py --hypothesis-seed=$$seed \
	  || { echo "fuzz: FAILED with seed $$seed (replay: make fuzz SEED=$$seed)"; exit 1; }

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
