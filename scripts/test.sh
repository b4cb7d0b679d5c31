#!/usr/bin/env bash
# Set-up, lint, then the whole test suite (slow real-model tests included) in TEST_WORKERS pytest-xdist workers
# (default 2, the CI machines' cores; each worker runs torch on 1 thread, tests/conftest.py; 0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" "$@"
