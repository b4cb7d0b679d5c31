"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit cce5ea8 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: truncated repeat pass. Layers <= LSTAR get their own repeat mass; deeper layers get a shared
position prior (max over heads of layers <= LSTAR, normalised per layer) as their 'repeat' mass."""
import os
import sys

import torch

import kvcompress.reference as ref
import kvcompress.weighted_press as wp
from kvcompress.cli import main as cli_main

LSTAR = int(os.environ.get("LSTAR", "7"))
MODE = os.environ.get("PRIOR", "max")

class _Stop(Exception):
    pass

orig_hook = wp.WeightedSubsetPress.forward_hook
def forward_hook(self, module, input, kwargs, output):
    out = orig_hook(self, module, input, kwargs, output)
    if self._repeating and module.layer_idx >= LSTAR:
        raise _Stop()
    return out
wp.WeightedSubsetPress.forward_hook = forward_hook

def repeat_context(decoder, input_ids, cache, chunk_size, snapshot):
    n = input_ids.shape[1]
    with torch.no_grad():
        for start in range(0, n, chunk_size):
            try:
                decoder(input_ids=input_ids[:, start : start + chunk_size], past_key_values=cache, use_cache=True)
            except _Stop:
                pass
            for layer_idx in range(len(cache.layers)):
                ref.restore_layer(cache, layer_idx, snapshot)
wp.repeat_context = repeat_context

orig_compress = wp.WeightedSubsetPress._compress_layer
def _compress_layer(self, cache, state):
    idx = state["module"].layer_idx
    if idx > LSTAR:
        shared = self._shared  # [b, n]
        r = state["references"][0]
        heads = cache.layers[idx].keys.shape[1]
        r.mass["repeat"] = shared[:, None, :].expand(-1, heads, -1).clone()
    return orig_compress(self, cache, state)
wp.WeightedSubsetPress._compress_layer = _compress_layer

orig_after = wp.WeightedSubsetPress._after_prefill
def _after_prefill(self, decoder, args, kwargs, output):
    if self._repeating or not self._pending:
        return orig_after(self, decoder, args, kwargs, output)
    pending = self._pending
    # wrap compress: compute shared prior after repeat but before compression
    orig = self._compress_layer
    def compress(cache, state, _done=None):
        if _done is None:
            _done = [False]
        if not _done[0]:
            parts = []
            for i, st in pending.items():
                if i <= LSTAR and "repeat" in st["references"][0].mass:
                    m = st["references"][0].mass["repeat"]
                    m = m / m.sum(-1, keepdim=True).clamp_min(1e-30) if MODE == "sumnorm" else m
                    parts.append(m.amax(1))
            self._shared = torch.stack(parts).amax(0)
            _done[0] = True
        return orig(cache, state)
    self._compress_layer = compress
    try:
        return orig_after(self, decoder, args, kwargs, output)
    finally:
        del self._compress_layer
wp.WeightedSubsetPress._after_prefill = _after_prefill

if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")  # run from the repository root
    from eval.fidelity import main as fid
    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
