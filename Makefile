# `make demo` and `make test` do all the set-up: they create .venv and install the full dependency
# set when it is missing or stale (requirements.txt or pyproject.toml changed), then run.
VENV    := .venv
STAMP   := $(VENV)/.installed
PYTHON  := $(VENV)/bin/python
CACHE   := $(CURDIR)/.cache

# Nothing phones home, nothing is downloaded at run time, and every cache stays inside the project.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0
export MLFLOW_DISABLE_TELEMETRY=true
export DO_NOT_TRACK=true
export DS_ACCELERATOR=cpu
export PYTHONWARNINGS=ignore::FutureWarning
export TORCH_EXTENSIONS_DIR=$(CACHE)/torch_extensions
export VLLM_CACHE_ROOT=$(CACHE)/vllm
export HF_HOME=$(CACHE)/hf
export PALIMPSEST_CACHE=$(CACHE)/palimpsest
# Ray keeps its sockets and logs here (a short path: Unix sockets allow ~107 characters).
export RAY_TMPDIR=/tmp/palimpsest-ray
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0

.PHONY: install demo test test-fast bench bench-serve load serve replay clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml scripts/install.sh
	@bash scripts/install.sh

demo: $(STAMP)
	$(VENV)/bin/palimpsest demo

# The PostgreSQL tier runs against a throwaway local server (scripts/postgres.sh), started here unless
# $$PALIMPSEST_TEST_POSTGRES already names one, and stopped afterwards.
test: $(STAMP)
	bash scripts/postgres.sh run -- $(PYTHON) -m pytest tests

test-fast: $(STAMP)
	bash scripts/postgres.sh run -- $(PYTHON) -m pytest tests -m "not slow"

bench: $(STAMP)
	$(PYTHON) benchmarks/plan_compile.py
	$(PYTHON) benchmarks/replay_dev.py
	$(PYTHON) benchmarks/masking_baselines.py

# Serving figures: latency breakdown over 200+ turns, 8 concurrent sessions, prefix-cache hit rate (~25 min).
bench-serve: $(STAMP)
	$(PYTHON) benchmarks/serve_latency.py

# A bounded load test on 127.0.0.1 (override: make load SESSIONS=16 LOAD_SECONDS=300).
SESSIONS ?= 8
LOAD_SECONDS ?= 120
load: $(STAMP)
	$(PYTHON) benchmarks/load_test.py --sessions $(SESSIONS) --seconds $(LOAD_SECONDS)

# The composed app on 127.0.0.1:8000 until Ctrl-C.
serve: $(STAMP)
	$(VENV)/bin/palimpsest serve --config configs/serve/local.yaml

# Every policy on the dev trajectories at 16K, with the report (plots) in out/replay-dev-16k.
replay: $(STAMP)
	$(VENV)/bin/palimpsest replay --data ../shared/data/trajectories/dev.jsonl \
		--policy full,last2,window,rolling_summary,pace,pace_task_first,ace,pace_plus,observation_masking,clear_tool_uses \
		--budget 16000 \
		--policy-config configs/replay/reference.yaml --out out/replay-dev-16k
	$(VENV)/bin/palimpsest report out/replay-dev-16k

clean:
	rm -rf .palimpsest .pytest_cache .cache
