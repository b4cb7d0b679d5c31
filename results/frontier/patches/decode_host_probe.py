"""Host cost of the eager weighted attention call on CPU, its Triton launches stubbed (docs/BENCHMARKS.md, "Where the
eager call's host time goes"): ``python results/frontier/patches/decode_host_probe.py [--profile]``.

A tiny Llama (256 wide, 8 query / 2 KV heads of 32) compresses 1,024 tokens with the default press at 25% kept; layer
0's attention function is then called 500 times, 7 times over, for one new query over the same rows, through the
Triton launcher (forced on CPU) with both kernels' launches replaced by no-ops: what remains is Python and the
dispatcher. ``--profile`` adds a cProfile of 2,000 calls (the functions' own time).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launcher takes CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvcompress.hf_attention as hf_attention  # noqa: E402
from eval.speed.decode import _weighted_kernels_skipped  # noqa: E402
from kvcompress import CompressKVPress  # noqa: E402
from kvcompress import attention as attention_module  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


def through_the_launcher(queries, keys, values, weights, *, scaling, v_min=None, v_max=None, causal_offset=None,
                         key_mask=None, fold_from=None):  # fmt: skip
    """``weighted_attention_unchecked``'s CUDA branch, taken on CPU."""
    kernel = attention_module._triton_kernel(queries, keys, values, weights, v_min, v_max, required=False)
    return kernel(queries, keys, values, weights, scaling=scaling, v_min=v_min, v_max=v_max,
                  causal_offset=causal_offset, key_mask=key_mask, check=False, fold_from=fold_from)  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    ids = torch.randint(1, 256, (1, 1024), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress(compression_ratio=0.75)(model):
        model.model(input_ids=ids, past_key_values=cache)
    keys, values = cache.layers[0].update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    module, query = model.model.layers[0].self_attn, torch.randn(1, 8, 1, 32)
    hf_attention.weighted_attention_unchecked = through_the_launcher

    def call():
        return hf_attention.kvcompress_attention(module, query, keys, values, None, scaling=None)

    with _weighted_kernels_skipped():
        for _ in range(50):
            call()
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(500):
                call()
            rounds.append((time.perf_counter() - start) / 500 * 1e6)
        print(f"us per call: median {statistics.median(rounds):.1f}, rounds {[round(x, 1) for x in rounds]}")
        if "--profile" in sys.argv:
            profile = cProfile.Profile()
            profile.runcall(lambda: [call() for _ in range(2000)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
