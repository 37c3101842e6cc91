#!/usr/bin/env bash
# The demo, from a fresh clone: set up, then run `tracetrain demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tracetrain demo "$@"
