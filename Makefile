# kubesgl: the two commands that matter are `make up` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install up test test-fast test-numerics fuzz lint fmt clean loadtest-k6 loadtest-locust

$(BIN)/python:
	$(PY) -m venv $(VENV)

# One line per install step, then pip's own progress, then the step's time: the whole install takes minutes.
define step
	@echo "kubesgl install: $(1)"; start=$$(date +%s); $(2) && \
	  echo "kubesgl install: $(1): done in $$(( $$(date +%s) - start )) s"
endef

# torch first, pinned: the CPU wheel lies on the machine; any other spec pulls a CUDA build.
$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(call step,1/3 pip,$(BIN)/pip install -q --upgrade pip)
	$(call step,2/3 torch 2.13.0 (CPU),$(BIN)/pip install --progress-bar on torch==2.13.0)
	$(call step,3/3 kubesgl and its dev tools,$(BIN)/pip install --progress-bar on -e '.[dev]')
	@touch $(STAMP)

install: $(STAMP)

# exec: the recipe's shell (there is one when ARGS holds quotes) becomes `kubesgl up`, so the SIGTERM make
# hands on reaches it; a SIGINT make keeps to itself, and `kubesgl up` watches for that (launcher.MakeParent).
up: $(STAMP)
	exec $(BIN)/kubesgl up $(ARGS)

# Everything, as CI runs it (.ci/run).
test: $(STAMP)
	bash tests/run.sh $(PYTEST_ARGS)

# The unit groups only (tests/unit/, less `slow`), with their 5 slowest tests; pytest's line gives the
# counts and tests/run.sh the wall time: about 2 minutes on a 2-core machine with little else running.
test-fast: $(STAMP)
	bash tests/run.sh --fast $(PYTEST_ARGS)

# The float-comparing tests under capped CPU vector widths (ATen, MKL, oneDNN) and 1 or 2 threads, twice each.
test-numerics: $(STAMP)
	bash tests/numerics.sh $(PYTEST_ARGS)

# Open-ended fuzzing of a live stack with a fresh seed (printed: `make fuzz SEED=<n>` replays a failure).
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	@seed=$${SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "fuzz: $(FUZZ_EXAMPLES) examples per operation, seed $$seed (replay: make fuzz SEED=$$seed)"; \
	KUBESGL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PATH="$$PWD/$(BIN):$$PATH" $(BIN)/python -m pytest -q -s \
	  -p no:cacheprovider tests/e2e/test_fuzz_gateway.py --hypothesis-seed=$$seed \
	  || { echo "fuzz: FAILED with seed $$seed (replay: make fuzz SEED=$$seed)"; exit 1; }

# Load against a running `make up` (in another terminal), bounded by DURATION; the venv's own k6 and locust.
# Other knobs (MODEL, MAX_TOKENS, PROMPT_MIX, API_KEY, k6 thresholds) are read from the environment:
# loadtest/README.md. No install prerequisite: a running `make up` means the venv is there, and a stale
# install stamp must not reinstall under a running stack.
BASE_URL ?= http://127.0.0.1:8000
DURATION ?= 30s
USERS ?= 4
define need_gateway
	@test -x $(BIN)/$(1) || { echo "$(BIN)/$(1) is missing: run \`make install\` first"; exit 1; }
	@$(BIN)/python -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/ready', timeout=5)" \
	  $(BASE_URL) 2>/dev/null || { echo "no ready gateway at $(BASE_URL): start \`make up\` in another \
	terminal first (or set BASE_URL=...)"; exit 1; }
endef

loadtest-k6:
	$(call need_gateway,k6)
	BASE_URL=$(BASE_URL) DURATION=$(DURATION) VUS=$(USERS) \
	  $(BIN)/k6 run --no-usage-report loadtest/k6/chat_stream.js

loadtest-locust:
	$(call need_gateway,locust)
	BASE_URL=$(BASE_URL) $(BIN)/locust -f loadtest/locust/locustfile.py --headless \
	  -u $(USERS) -r $(USERS) -t $(DURATION) --stop-timeout 60 --only-summary

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
