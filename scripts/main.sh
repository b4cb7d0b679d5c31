#!/usr/bin/env bash
# The main job on its embedded default (offline): set-up, then the approximation-error benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m eval.approx_error "$@"
