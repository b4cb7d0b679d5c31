# The calibration scan of docs/BENCHMARKS.md, "The worst continuation context": the default's priors switched off in
# one layer at a time (every other layer, starting at $1; run with 0 and with 1 in parallel), niah-s on 4 contexts.
# From the repository root: bash results/frontier/diagnosis/no_priors_by_layer_scan.sh 0
# The two outputs (_0, _1), sorted by layer, are no_priors_by_layer_niahs_seed0_4.txt.
cd "$(dirname "$0")/../../.."
export WINPOOL=max
for L in $(seq $1 2 29); do
  PLAIN=$L ${PYTHON:-python} results/frontier/patches/priors_by_layer.py eval --benchmark ruler --length 1024 --limit 4 --tasks niah_single --methods compresskv --ratio 0.25 --threads 1 --seed 0 --output-dir results/frontier/diagnosis/scan/l$L > /dev/null 2>&1
  echo "layer $L: $(sed -n 5p results/frontier/diagnosis/scan/l$L/results.md)" >> results/frontier/diagnosis/no_priors_by_layer_niahs_seed0_4_$1.txt
done
