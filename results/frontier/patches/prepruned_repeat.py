"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit e08e655 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the repeat pass over a pre-pruned cache. Right after the prefill each waiting layer is cut (plain
eviction) to its sink, its window and the FACTOR x middle-budget middle rows with the best scores of the sources the
prefill recorded (window + novelty for balanced(): the default's own choice at FACTOR times its budget); the repeat
pass then attends to, and scores, only those rows, and the final selection and fit choose among them. The repeated
tokens keep the positions they have over the full cache. What a streamed implementation would gain: the full cache
is never held (each layer cut right after its prefill), the repeat chunks' attention and mass run over FACTOR x the
budget instead of the context.
"""

import os
import sys

import torch

import kvcompress.repeat_hooks as rh
from kvcompress.cli import main as cli_main
from kvcompress.hf_attention import new_tokens_see_all_cached
from kvcompress.methods import mixed_scores
from kvcompress.reference import restore_layer
from kvcompress.selection import top_rows

FACTOR = float(os.environ.get("FACTOR", "2"))
_context_tokens = [0]


def prune(press, cache, layer_idx, state):
    plan, reference = state["plans"][0], state["references"][0]
    layer = cache.layers[layer_idx]
    n = layer.keys.shape[-2]
    start, end = plan.sink, n - plan.window
    middle = min(end - start, int(FACTOR * plan.middle))
    if middle >= end - start:
        return
    scores = mixed_scores(
        reference, start, end, {}, {"window": press.pool_kernel}, reserved=round(press.novelty_share * middle)
    )
    kept = top_rows(scores, middle) + start
    b, h = kept.shape[:2]
    head = torch.arange(start, device=kept.device).expand(b, h, -1)
    tail = torch.arange(end, n, device=kept.device).expand(b, h, -1)
    index = torch.cat([head, kept, tail], dim=-1)
    gather = lambda x: x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
    layer.keys, layer.values = gather(layer.keys), gather(layer.values)
    reference.mass = {source: mass.gather(-1, index) for source, mass in reference.mass.items()}
    kept_tokens = index.shape[-1]
    assert all(int(p.min()) >= n - plan.window for p in reference.positions), "fit queries outside the window"
    reference.positions = [p - n + kept_tokens for p in reference.positions]


orig_after_prefill = rh.RepeatPassHooks._after_prefill


def _after_prefill(self, decoder, args, kwargs, output):
    if not self._repeating and self._pending:
        cache = kwargs.get("past_key_values") or getattr(output, "past_key_values", None)
        if next(iter(self._pending.values()))["rows"] is None:
            ids = self._call[1]
            references = [state["references"][0] for state in self._pending.values()]
            pieces = self.repeat_positions(ids.shape[1], ids.device, references)  # from the unpruned novelty
            self.repeat_positions = lambda n, device, references: pieces
            for layer_idx, state in self._pending.items():
                prune(self, cache, layer_idx, state)
        _context_tokens[0] = self._call[1].shape[1]
    try:
        return orig_after_prefill(self, decoder, args, kwargs, output)
    finally:
        vars(self).pop("repeat_positions", None)


def repeat_context(decoder, input_ids, cache, chunk_size, snapshot):
    """rh.repeat_context with the positions the repeated tokens have over the full cache."""
    n, offset = input_ids.shape[1], _context_tokens[0]
    with torch.no_grad(), new_tokens_see_all_cached():
        for start in range(0, n, chunk_size):
            ids = input_ids[:, start : start + chunk_size]
            positions = torch.arange(offset + start, offset + start + ids.shape[1], device=ids.device)
            decoder(
                input_ids=ids, past_key_values=cache, use_cache=True, cache_position=positions,
                position_ids=positions[None],
            )  # fmt: skip
            for layer_idx in range(len(cache.layers)):
                restore_layer(cache, layer_idx, snapshot)


rh.RepeatPassHooks._after_prefill = _after_prefill
rh.repeat_context = repeat_context
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
