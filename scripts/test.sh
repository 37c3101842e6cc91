#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tracetrain tests bench examples
.venv/bin/mypy tracetrain
.venv/bin/lint-imports  # layers: DESIGN.md decision 10
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider "$@"
