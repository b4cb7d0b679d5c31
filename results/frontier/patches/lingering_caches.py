"""Tensor bytes still alive, with no explicit collection, after each of 8 dropped default prefills (tiny Qwen2, 4
layers, 2,000 tokens, float32, CPU). From the repository root: ``PYTHONPATH=. python
results/frontier/patches/lingering_caches.py LABEL``. The forty-first session ran it with 18d56a2's
``kvcompress/cache.py`` and ``static_layers.py`` ("old": keys named their layer strongly) and with 06f6fdb's ("new");
output in ``results/frontier/lingering_caches_cpu.txt``."""

import gc
import sys

import torch

from eval.speed.e2e import prefill
from kvcompress import CompressKVPress
from tests.tiny_models import tiny_model


def alive_mib() -> float:
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total / 2**20


torch.manual_seed(0)
model = tiny_model("qwen2", dtype=torch.float32, num_hidden_layers=4)
ids = torch.randint(0, 200, (1, 2000))
alive = []
with torch.no_grad():
    for _ in range(8):
        prefill(model, CompressKVPress(compression_ratio=0.75, seed=0), ids)  # the cache is dropped at once
        alive.append(round(alive_mib(), 2))
gc.collect()
print(sys.argv[1], "MiB alive after each prefill:", alive, "after a collection:", round(alive_mib(), 2))
