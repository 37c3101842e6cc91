#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tracetrain tests bench examples
.venv/bin/mypy tracetrain bench
.venv/bin/lint-imports  # layers: docs/architecture.md, decision 10
# The suite writes a few GB of checkpoints under the temp dir at its peak: say so up front when space is short.
tmp="${TMPDIR:-/tmp}"
free_kb=$(df -Pk "$tmp" | awk 'NR==2 {print $4}')
if [ "$free_kb" -lt $((4 * 1024 * 1024)) ]; then
    echo "warning: only $((free_kb / 1024)) MiB free in $tmp; the suite needs about 4 GiB there" >&2
fi
# Two workers, a module each at a time (--dist loadfile): a module's shared servers stay in one worker,
# and tests that wait on processes (vLLM starting, agents under a kill) overlap with the other's work.
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider -n 2 --dist loadfile "$@"
