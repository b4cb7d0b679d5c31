#!/usr/bin/env bash
# Set-up, lint, then the whole test suite (slow real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
