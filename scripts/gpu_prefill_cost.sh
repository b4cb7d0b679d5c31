#!/usr/bin/env bash
# The prefill-cost numbers of a CUDA machine (kvpress 0.5.5 and transformers 5.2 importable): the attention-mass
# kernel's, the fit's fused kernels' and the repeat pass's lower-right attention tests compiled (and balanced()'s
# layers parked in host memory, the side stream's copies), the fit alone per
# layer on both its paths with the fused path's top CUDA operators (`python -m eval.bench_fit --backends torch
# triton --profile`, 8k and 32k, 64 and 320 queries), one repeat chunk's
# attention masked and lower-right (`python -m eval.bench_repeat_attention`), then `python -m eval.speed --only
# prefill` (breakdown per setting + one layer's mass) one context length per call, so that each stays within a few
# minutes. Outputs under $OUT (default results/speed/prefill_cost/). Usage: bash scripts/gpu_prefill_cost.sh
# [LENGTH ...] (default 8192 32768 65536); SETTINGS="none snapkv default ..." times only those settings, E2E_REPEATS=N
# that many prefills per row (default 3), FIT_AFTER_FIRST=1 runs eval.bench_fit after the first length instead of
# before it (when device time is short, the first length's breakdown comes first), BUNDLE=1 packs $OUT into
# $OUT.tgz after every step (the device tool returns a limited number of files; a call cut off by its time limit
# still returns the steps done). It also counts the host-device syncs of
# one short prefill per setting (`python -m eval.probe_syncs`) and whether torch's private flash operators can hand
# a repeat chunk's log-sum-exp to the mass (`python -m eval.probe_flash_lse`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/speed/prefill_cost}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
checkpoint() {
    if [ "${BUNDLE:-0}" = 1 ]; then tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; fi
}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$PYTHON" -m pytest tests/test_kernel_attention_mass.py tests/test_kernel_fit_products.py tests/test_selection_fitting.py \
    tests/test_repeat_attention.py tests/test_repeat_pass.py::test_parked_layers_wait_in_host_memory_and_keep_the_cache -q \
    -p no:cacheprovider > "$OUT/kernel_tests.txt" 2>&1
tail -1 "$OUT/kernel_tests.txt"
checkpoint
"$PYTHON" -m eval.probe_flash_lse --output "$OUT/flash_lse.json" > "$OUT/flash_lse.log" 2>&1
echo "probe_flash_lse: exit $?"
cat "$OUT/flash_lse.log"
checkpoint
"$PYTHON" -m eval.probe_syncs --output "$OUT/syncs.json" > "$OUT/syncs.log" 2>&1
echo "probe_syncs: exit $?"
grep -v "^ " "$OUT/syncs.log"
checkpoint
run_bench_fit() {
    "$PYTHON" -m eval.bench_fit --backends torch triton --profile --output "$OUT/bench_fit.json" > "$OUT/bench_fit.log" 2>&1
    echo "bench_fit: exit $?"
    head -10 "$OUT/bench_fit.log"
    checkpoint
}
[ "${FIT_AFTER_FIRST:-0}" = 1 ] || run_bench_fit
"$PYTHON" -m eval.bench_repeat_attention --output "$OUT/bench_repeat_attention.json" > "$OUT/bench_repeat_attention.log" 2>&1
echo "bench_repeat_attention: exit $?"
cat "$OUT/bench_repeat_attention.log"
checkpoint
extra=()
[ -n "${SETTINGS:-}" ] && extra+=(--breakdown-settings $SETTINGS)
[ -n "${E2E_REPEATS:-}" ] && extra+=(--e2e-repeats "$E2E_REPEATS")
for n in "${@:-8192 32768 65536}"; do
    for length in $n; do
        "$PYTHON" -m eval.speed --only prefill --breakdown-lengths "$length" "${extra[@]}" \
            --output "$OUT/prefill_$length.json" > "$OUT/prefill_$length.log" 2>&1
        echo "n=$length: exit $?"
        grep -A20 "breakdown per setting" "$OUT/prefill_$length.log"
        checkpoint
        if [ "${FIT_AFTER_FIRST:-0}" = 1 ]; then run_bench_fit; FIT_AFTER_FIRST=done; fi
    done
done
if [ "${BUNDLE:-0}" = 1 ]; then
    checkpoint && rm -rf "$OUT" && echo "packed $OUT.tgz"
fi
