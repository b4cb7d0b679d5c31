#!/usr/bin/env bash
# Every GPU number still open, in one call of the lent GPU machine, most wanted first, under one deadline (a session
# gets about 15 minutes of device time and 10 minutes a call; a step that would pass the deadline is cut short or
# skipped, and the steps done still come back). From the repository root, with .gpu-wheels carried (kvpress 0.5.5
# and transformers 5.2 wheels; docs/BENCHMARKS.md, "Commands on a GPU machine"):
#
#   OUT=$OUT/g DEADLINE_S=540 bash scripts/gpu_session.sh
#
# STEPS="prefill_32768 kernel_tests ..." runs only the steps named (default: the ones below but lse_prefill); steps
# run in the order below, whatever STEPS's order. The seventeenth session ran all but prefill_8192, bench_fit and
# speed_kernels, with 4 decode layers; the eighteenth changed the fit and its second kernel (block_sums), so the
# compiled kernel tests come first; the nineteenth gave the default's fit its window rows from the prefill; the
# twentieth added default_overlap and balanced_overlap (the selection and fit on a side stream) and the fused merge;
# the twenty-first the decode kernels' cached launch, and moved the decode steps up: in one 540 s call the kernel
# tests, the 32k breakdown and the decode steps decide every switch that waits for a GPU (overlap_compression,
# FUSED_MERGE, CACHED_LAUNCH) before the deadline cuts the rest. The thirty-fifth added the `calibrated` setting to the
# 32k breakdown: a layer kept whole and a widened one, as a calibrated model's default runs (never run on a GPU); the
# forty-first added `default_nofit` to the breakdowns (the default without its fit: what the fit adds end to end).
# SETTINGS_32K / SETTINGS_64K / SETTINGS_8K change the breakdowns' settings (eval/speed/prefill.py's names);
# E2E_REPEATS_32K the 32k breakdown's repeats (default 2).
#
# Steps, by name:
#   kernel_tests    every Triton kernel's tests compiled on CUDA (and the CUDA-graph decode against eager)
#   lse_prefill     which kernel sdpa picks for a 32k causal prefill and each fused operator's time and error
#                   with its log-sum-exp (`python -m eval.probe_flash_lse --context 0`; the induction prior's path)
#   prefill_32768   the prefill breakdown at 32k, every setting of README's table that has one, and `calibrated`
#                   (the default with the embedded model's calibrated layers at the same depths; issue 20's goals:
#                   the default <= 1.3x no press, the "thorough" point <= 2.2x, peak <= SnapKV's + 5%, the fit <= 5%)
#   decode_32768_b1 / decode_32768_b8   decode steps and one layer's attention call at 32k (its host time also
#                   without the Triton launches, with the merge fused into one launch, with the cached launch and
#                   with both; DECODE_LAYERS of the model's 28 layers, default 4: inductor compiles three graphs per
#                   batch size; DECODE_CONTEXTS and DECODE_BATCHES, default "32768" and "1 8", set which
#                   decode_CONTEXT_bBATCH steps run)
#   decode_batch    the server's decode step, 8 sessions (16k rows and seven of 2k), each batch row bounded by its
#                   causal offset against the shared mask it ran with before the twenty-fifth session, and the
#                   compiled step (`--compile-decode` cudagraphs and inductor, CUDA graphs; since the twenty-sixth
#                   session; `eval.probe_decode_batch`, DECODE_LAYERS layers)
#   overlap         a 4-layer 32k prefill profiled: how much of the side streams' work (overlap_compression's)
#                   ran while the main stream was busy too (`eval.probe_overlap`)
#   bench_fit_known the default's fit as it runs now: its window rows' log-sum-exp and outputs handed over by the
#                   prefill (`--known-rows`: one kernel, not two), with its top CUDA operators
#   bench_fit       the fit alone per layer, both paths, with the fused path's top CUDA operators (the 5% goal),
#                   and its two kernels alone with other tiles (`--kernel-tiles`: TFLOP/s, agreement)
#   prefill_65536   the prefill breakdown at 64k (the default, balanced(): peak and cost where the quadratic parts grow)
#   prefill_chunks  the server's worker when an 8k-token question arrives while 8 sessions of 4k decode: the longest
#                   gap between two decode steps and the question's first token, per --prefill-chunk (0, 2048, 512,
#                   128; `eval.probe_prefill_chunks`, DECODE_LAYERS layers; since the forty-fifth session)
#   context_chunks  the same when an 8k-token new context arrives, read under the default press in --prefill-chunk
#                   pieces and compressed after the last (`--arrives context`; since the forty-sixth session), a
#                   few layers a round (since the forty-seventh)
#   context_chunks_balanced  the same under balanced(), its repeat pass one layer after another in those rounds
#   decode_nocudnn  decode_32768_b1 with sdpa kept off cuDNN (`--no-cudnn-sdpa`): whether the stock eager steps'
#                   37-40 ms (4 layers, the seventeenth session) are cuDNN building a plan per new key length
#   speed_kernels   copy bandwidth, compress_kv's and the weighted decode's rooflines (`--only kernels`)
#   weighted_prefill  the multi-token weighted attention's backends (Triton, PyTorch, FlexAttention)
#   prefill_8192    the breakdown at 8k (where the host's launches weigh most)
#   tiles           the weighted attention's tiles against the spill-free ones
#   syncs           the host-device syncs of one prefill per setting
#   lse_chunk, attention_tests   the repeat chunk's split attention: the operators' probe and its tests compiled
#   repeat_attention  one repeat chunk's attention masked, lower-right and split (`eval.bench_repeat_attention`)
# (This script replaced scripts/gpu_decode.sh and scripts/gpu_prefill_cost.sh, which earlier sections of
# docs/BENCHMARKS.md name: their runs are the steps above.)
# Logs and JSON go to $OUT, packed into $OUT.tgz after every step (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/speed/gpu_session}
DEADLINE_S=${DEADLINE_S:-540}
DECODE_LAYERS=${DECODE_LAYERS:-4}
DECODE_CONTEXTS=${DECODE_CONTEXTS:-32768}
DECODE_BATCHES=${DECODE_BATCHES:-1 8}
SETTINGS_32K=${SETTINGS_32K:-none snapkv default default_nofit calibrated default_overlap balanced balanced_overlap balanced_eighth thorough kvzip window_sum}
SETTINGS_64K=${SETTINGS_64K:-none snapkv default default_overlap balanced none_chunks default_chunks}
SETTINGS_8K=${SETTINGS_8K:-none snapkv default default_nofit balanced balanced_eighth thorough}
decode_steps=$(for c in $DECODE_CONTEXTS; do for b in $DECODE_BATCHES; do printf 'decode_%s_b%s ' "$c" "$b"; done; done)
STEPS=${STEPS:-kernel_tests prefill_32768 $decode_steps decode_batch overlap bench_fit_known bench_fit prefill_65536 prefill_chunks \
context_chunks context_chunks_balanced decode_nocudnn speed_kernels weighted_prefill prefill_8192 tiles syncs lse_chunk attention_tests repeat_attention}
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu-wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PYTHON:-python3}

pack() { tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }

# step NAME CAP_S COMMAND...: runs COMMAND under min(CAP_S, time left), its output in $OUT/NAME.log.
step() {
    local name=$1 cap=$2 left
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    left=$((DEADLINE_S - SECONDS - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 20 ]; then
        echo "== $name: skipped (${left}s left)"
        return
    fi
    local tic=$SECONDS
    timeout --kill-after=5 "$cap" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - tic)) s (limit $cap s)"
    pack
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton, transformers, kvpress; print(torch.__version__, triton.__version__, \
transformers.__version__, kvpress.__version__ if hasattr(kvpress, '__version__') else 'kvpress')"
    git log -1 --format="commit %h %s" 2>/dev/null || true
    # The device may keep an earlier call's git metadata: the library's sources identify the tree that ran.
    echo "kvcompress sources sha1 $(cat kvcompress/*.py kvcompress/*/*.py | sha1sum | cut -c1-12)"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

step kernel_tests 170 $PY -m pytest -v -n 8 -p no:cacheprovider tests/test_kernel_attention_mass.py \
    tests/test_kernel_fit_products.py tests/test_kernel_weighted_decode.py tests/test_kernel_weighted_prefill.py \
    tests/test_selection_fitting.py tests/test_repeat_attention.py tests/test_static_cache.py \
    tests/test_compression_stream.py tests/test_cached_launch.py tests/test_kernel_rpnys.py \
    tests/test_repeat_pass.py::test_parked_layers_wait_in_host_memory_and_keep_the_cache \
    tests/test_serve_batch.py::test_decode_batch_on_a_gpu_equals_each_session_alone \
    tests/test_serve_batch.py::test_compiled_steps_with_cuda_graphs_run_in_a_worker_thread -k "not pipeline"
grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" "$OUT/kernel_tests.log" 2>/dev/null | tail -15

step lse_prefill 40 $PY -m eval.probe_flash_lse --context 0 --chunk 32768 --output "$OUT/lse_prefill.json"
cat "$OUT/lse_prefill.log" 2>/dev/null

# shellcheck disable=SC2086  # the settings are words
step prefill_32768 240 $PY -m eval.speed --only prefill --breakdown-lengths 32768 --e2e-repeats "${E2E_REPEATS_32K:-2}" \
    --breakdown-settings $SETTINGS_32K --output "$OUT/prefill_32768.json"
grep -A14 "breakdown per setting" "$OUT/prefill_32768.log" 2>/dev/null
grep -A4 "attention mass of one layer" "$OUT/prefill_32768.log" 2>/dev/null

for context in $DECODE_CONTEXTS; do
    for batch in $DECODE_BATCHES; do
        step "decode_${context}_b$batch" 110 $PY -m eval.speed --only decode --decode-contexts "$context" \
            --decode-batch-sizes "$batch" --model-layers "$DECODE_LAYERS" --output "$OUT/decode_${context}_b$batch.json"
        grep -A30 "greedy decode step" "$OUT/decode_${context}_b$batch.log" 2>/dev/null
    done
done

step decode_batch 200 $PY -m eval.probe_decode_batch --layers "$DECODE_LAYERS" --output "$OUT/decode_batch.json"
tail -40 "$OUT/decode_batch.log" 2>/dev/null

step overlap 90 $PY -m eval.probe_overlap --output "$OUT/overlap.json"
tail -16 "$OUT/overlap.log" 2>/dev/null

step bench_fit_known 60 $PY -m eval.bench_fit --contexts 32768 --queries 64 --backends triton --known-rows --profile \
    --output "$OUT/bench_fit_known.json"
head -3 "$OUT/bench_fit_known.log" 2>/dev/null

step bench_fit 150 $PY -m eval.bench_fit --contexts 32768 --queries 320 64 --backends torch triton --profile \
    --kernel-tiles --output "$OUT/bench_fit.json"
head -5 "$OUT/bench_fit.log" 2>/dev/null
grep -A14 "TFLOP/s" "$OUT/bench_fit.log" 2>/dev/null

# shellcheck disable=SC2086
step prefill_65536 200 $PY -m eval.speed --only prefill --breakdown-lengths 65536 --e2e-repeats 1 \
    --breakdown-settings $SETTINGS_64K --output "$OUT/prefill_65536.json"
grep -A10 "breakdown per setting" "$OUT/prefill_65536.log" 2>/dev/null

step prefill_chunks 90 $PY -m eval.probe_prefill_chunks --layers "$DECODE_LAYERS" --output "$OUT/prefill_chunks.json"
tail -45 "$OUT/prefill_chunks.log" 2>/dev/null

step context_chunks 90 $PY -m eval.probe_prefill_chunks --layers "$DECODE_LAYERS" --arrives context \
    --output "$OUT/context_chunks.json"
tail -45 "$OUT/context_chunks.log" 2>/dev/null

step context_chunks_balanced 90 $PY -m eval.probe_prefill_chunks --layers "$DECODE_LAYERS" --arrives context \
    --press balanced --chunks 0 512 --output "$OUT/context_chunks_balanced.json"
tail -30 "$OUT/context_chunks_balanced.log" 2>/dev/null

step decode_nocudnn 110 $PY -m eval.speed --only decode --decode-contexts 32768 --decode-batch-sizes 1 \
    --model-layers "$DECODE_LAYERS" --no-cudnn-sdpa --output "$OUT/decode_nocudnn.json"
grep -A9 "greedy decode step" "$OUT/decode_nocudnn.log" 2>/dev/null

step speed_kernels 120 $PY -m eval.speed --only kernels --output "$OUT/speed_kernels.json"
grep -B2 -A40 "bandwidth:" "$OUT/speed_kernels.log" 2>/dev/null | tail -45

step weighted_prefill 80 $PY -m eval.bench_weighted_prefill --contexts 8192 32768 --new-tokens 64 512 \
    --repeats 20 --output "$OUT/weighted_prefill.json"
tail -14 "$OUT/weighted_prefill.log" 2>/dev/null

# shellcheck disable=SC2086
step prefill_8192 90 $PY -m eval.speed --only prefill --breakdown-lengths 8192 --e2e-repeats 3 \
    --breakdown-settings $SETTINGS_8K --output "$OUT/prefill_8192.json"
grep -A10 "breakdown per setting" "$OUT/prefill_8192.log" 2>/dev/null

step tiles 70 $PY -m eval.bench_weighted_prefill --contexts 32768 --new-tokens 1 16 128 512 --backends triton \
    --tiles 16x64x8 16x32x8 32x32x8 64x16x8 64x64x8 --repeats 20 --output "$OUT/tiles.json"
tail -24 "$OUT/tiles.log" 2>/dev/null

step syncs 45 $PY -m eval.probe_syncs --output "$OUT/syncs.json"
grep -v "^ " "$OUT/syncs.log" 2>/dev/null | tail -12

step lse_chunk 40 $PY -m eval.probe_flash_lse --output "$OUT/lse_chunk.json"
cat "$OUT/lse_chunk.log" 2>/dev/null
step repeat_attention 60 $PY -m eval.bench_repeat_attention --output "$OUT/repeat_attention.json"
cat "$OUT/repeat_attention.log" 2>/dev/null
step attention_tests 60 $PY -m pytest -q -p no:cacheprovider tests/test_repeat_attention.py
tail -3 "$OUT/attention_tests.log" 2>/dev/null
echo "done in $SECONDS s"
