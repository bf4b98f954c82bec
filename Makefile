# `make demo` and `make test` do all the set-up: they create .venv and install the full dependency
# set when it is missing or stale (requirements.txt or pyproject.toml changed), then run.
VENV    := .venv
STAMP   := $(VENV)/.installed
PYTHON  := $(VENV)/bin/python
CACHE   := $(CURDIR)/.cache

# Nothing phones home, nothing is downloaded at run time, and every cache stays inside the project.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true
export DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore::FutureWarning
export TORCH_EXTENSIONS_DIR=$(CACHE)/torch_extensions VLLM_CACHE_ROOT=$(CACHE)/vllm HF_HOME=$(CACHE)/hf

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml scripts/install.sh
	@bash scripts/install.sh

demo: $(STAMP)
	$(VENV)/bin/palimpsest demo

test: $(STAMP)
	$(PYTHON) -m pytest tests

test-fast: $(STAMP)
	$(PYTHON) -m pytest tests -m "not slow"

bench: $(STAMP)
	$(PYTHON) benchmarks/plan_compile.py

clean:
	rm -rf .palimpsest .pytest_cache .cache
