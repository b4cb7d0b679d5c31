#!/usr/bin/env bash
# Set-up, lint, then the whole test suite (slow real-model tests included) in TEST_WORKERS pytest-xdist workers
# (default 2, the CI machines' cores; each worker runs torch on 1 thread, tests/conftest.py; 0: one process), then
# scripts/test_compat.sh (a subset under transformers 4.57; SKIP_COMPAT=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" "$@"
# The oldest transformers supported (4.57): the tests of the code that meets its cache and attention classes.
[ "${SKIP_COMPAT:-0}" = 1 ] || bash scripts/test_compat.sh
