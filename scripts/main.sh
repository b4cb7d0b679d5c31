#!/usr/bin/env bash
# The main job on its embedded default (offline): set-up, then the LongBench-style evaluation of
# SmolLM2-135M-Instruct on the offline suite (kvcompress/longbench/offline_default.yaml; = `kvcompress eval`),
# written to results/longbench/ in the repository root. Flags pass through,
# e.g. `bash scripts/main.sh --limit 6` or `bash scripts/main.sh --model Qwen2.5-7B-Instruct`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python eval/longbench.py "$@"
