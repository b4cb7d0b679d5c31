"""Host time of the eager attention call, this checkout against another commit, in one process (docs/BENCHMARKS.md,
"The clip range folded inside the kernel"): ``python results/frontier/patches/decode_host_ab.py --base REV
[--fold | --grow] [--rounds 21]``.

The other commit's ``kvcompress/`` is extracted with ``git archive`` into a temporary directory and renamed
``kvbase`` (imports, the attention function's registered name and the custom op's namespace), so both versions run
side by side. Each builds what ``decode_host_probe.py`` builds: a tiny Llama (256 wide, 8 query / 2 KV heads of 32)
compressed from 1,024 tokens by the default press at 25% kept, one new row appended; then layer 0's attention
function is called for one query over the same rows through the Triton launcher (forced on CPU) with both
kernels' launches replaced by no-ops. Rounds of 500 calls alternate between the two versions; the paired ratio
(this checkout over the other) is what the machine's drift does not move. ``--fold``: before each call the layer's
clip range is set one row back, so each call folds a row in, as a real decode step's first call per layer does.
``--grow``: the calls of a round run over 500 caches one row longer each (views of one cache that 500 rows more were
appended to, each tagged as the layer's), each folding its last row in: a real decode step's call, whose row count and
causal offset are new every step (the launch plan's cache misses), where the other modes repeat one shape.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launcher takes CPU tensors
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tests.tiny_models import tiny_model  # noqa: E402


class _Skipped:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def extract_as_kvbase(rev: str, into: Path) -> None:
    """``kvcompress/`` at ``rev`` as the package ``kvbase`` under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kvcompress"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "kvcompress").rename(into / "kvbase")
    for path in (into / "kvbase").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bkvcompress\b(?=[.\s])", "kvbase", text)
        text = text.replace('ATTENTION_NAME = "kvcompress"', 'ATTENTION_NAME = "kvbase"')
        text = text.replace('"kvcompress::', '"kvbase::')
        path.write_text(text)


def calls(package: str):
    """(plain call, folding call, launches-skipped context) over a freshly compressed tiny model."""
    root = importlib.import_module(package)
    hf = importlib.import_module(f"{package}.hf_attention")
    attention = importlib.import_module(f"{package}.attention")
    decode = importlib.import_module(f"{package}.kernels.weighted_decode")
    torch.manual_seed(0)
    model = tiny_model("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    ids = torch.randint(1, 256, (1, 1024), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad(), root.CompressKVPress(compression_ratio=0.75)(model):
        model.model(input_ids=ids, past_key_values=cache)
    gen = torch.Generator().manual_seed(1)
    layer = cache.layers[0]
    keys, values = layer.update(torch.randn(1, 2, 1, 32, generator=gen), torch.randn(1, 2, 1, 32, generator=gen))
    module, query = model.model.layers[0].self_attn, torch.randn(1, 8, 1, 32, generator=gen)

    def through_the_launcher(queries, keys, values, weights, *, scaling, v_min=None, v_max=None, causal_offset=None,
                             key_mask=None, **fold):  # fmt: skip
        kernel = attention._triton_kernel(queries, keys, values, weights, v_min, v_max, required=False)
        return kernel(queries, keys, values, weights, scaling=scaling, v_min=v_min, v_max=v_max,
                      causal_offset=causal_offset, key_mask=key_mask, check=False, **fold)  # fmt: skip

    hf.weighted_attention_unchecked = through_the_launcher
    skipped = mock.patch.multiple(decode, _weighted_split_kernel=_Skipped(), _weighted_decode_reduce_kernel=_Skipped())
    low, high, covered = layer._range
    grown_keys, grown_values = layer.update(torch.randn(1, 2, 500, 32, generator=gen),
                                            torch.randn(1, 2, 500, 32, generator=gen))  # fmt: skip
    rows = keys.shape[2]
    views = []
    for extra in range(500):  # one row longer each: a decode step's new shape
        k, v = grown_keys[:, :, : rows + extra], grown_values[:, :, : rows + extra]
        root.cache.tag_layer(k, layer)
        views.append((k, v))
    grown = iter(())

    def growing():
        nonlocal grown
        view = next(grown, None)
        if view is None:
            grown = iter(views)
            view = next(grown)
        layer._range = (low, high, view[0].shape[2] - 1)
        return hf.kvcompress_attention(module, query, *view, None, scaling=None)

    def call():
        return hf.kvcompress_attention(module, query, keys, values, None, scaling=None)

    def folding():
        layer._range = (low, high, covered - 1)
        return call()

    return call, folding, growing, skipped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against (e.g. HEAD~1)")
    p.add_argument("--fold", action="store_true", help="each call folds one new row into the clip range")
    p.add_argument("--grow", action="store_true", help="each call over a cache one row longer, folding that row")
    p.add_argument("--rounds", type=int, default=21)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        extract_as_kvbase(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        versions = {name: calls(package) for name, package in (("this", "kvcompress"), ("base", "kvbase"))}
        timings = {name: [] for name in versions}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, (call, folding, growing, skipped) in versions.items():
                run = growing if args.grow else folding if args.fold else call
                with skipped:
                    start = time.perf_counter()
                    for _ in range(500):
                        run()
                    timings[name].append((time.perf_counter() - start) / 500 * 1e6)
    ratios = [a / b for a, b in zip(timings["this"][1:], timings["base"][1:], strict=True)]
    label = "a cache one row longer each call" if args.grow else "folding a row" if args.fold else "no row to fold"
    print(f"{label}: this {statistics.median(timings['this'][1:]):.1f} us, {args.base} "
          f"{statistics.median(timings['base'][1:]):.1f} us a call (medians of {args.rounds} rounds of 500); paired "
          f"ratio median {statistics.median(ratios):.3f} [min {min(ratios):.3f}, max {max(ratios):.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
