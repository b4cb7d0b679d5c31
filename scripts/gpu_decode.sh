#!/usr/bin/env bash
# GPU checks and numbers of the static compressed cache (docs/BENCHMARKS.md, "Decode steps per cache"), one call
# of the lent GPU machine each (each well under 10 minutes). From the repository root, with .gpu-wheels carried
# (kvpress 0.5.5 + transformers 5.2.0 wheels; how to fetch them: docs/BENCHMARKS.md, "Commands on a GPU machine"):
#
#   bash scripts/gpu_decode.sh tests            # the Triton kernel tests compiled on CUDA + the CUDA-graph decode test
#   bash scripts/gpu_decode.sh 32768 1          # the decode section at one context and batch size (8192|32768, 1|8)
#   bash scripts/gpu_decode.sh tiles            # the weighted attention's tiles A/B (spill-free against the default)
#
# Logs and JSON go to $OUT (the device tool's output folder), else results/speed/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/speed}
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu-wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true
if [ "${1:-}" = tests ]; then
    # The pipeline tests need the embedded model (not on the GPU machine): deselected.
    $PY -m pytest -q tests/test_kernel_weighted_decode.py tests/test_kernel_weighted_prefill.py \
        tests/test_static_cache.py -k "not pipeline" 2>&1 | tee "$OUT/gpu_tests.log"
    exit "${PIPESTATUS[0]}"
fi
if [ "${1:-}" = tiles ]; then
    # The launchers' own tiles (the "triton" row; 16x64x4 decode, 128x64x8 a chunk, at head dim 128 in bf16) against
    # the ones that compile without register spills on sm_90 (docs/BENCHMARKS.md, "Every kernel compiled").
    $PY -m eval.bench_weighted_prefill --contexts 32768 --new-tokens 1 16 128 512 --backends triton \
        --tiles 16x64x8 16x32x8 32x32x8 64x16x8 64x64x8 --repeats 30 --output "$OUT/tiles.json" \
        2>&1 | tee "$OUT/tiles.log"
    exit "${PIPESTATUS[0]}"
fi
context=${1:-32768}
batch=${2:-1}
$PY -m eval.speed --only decode --decode-contexts "$context" --decode-batch-sizes "$batch" \
    --output "$OUT/decode_${context}_b${batch}.json" 2>&1 | tee "$OUT/decode_${context}_b${batch}.log"
