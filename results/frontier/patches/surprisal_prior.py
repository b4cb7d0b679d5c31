"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 69c399c and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: a third query-free prior, the context's own surprisal: position t scores -log p(x_t | x_<t) under the
model (the self-information that Selective Context prunes by; Li et al., "Compressing Context to Enhance Inference
Efficiency of Large Language Models", arXiv 2310.06201), the same score in every layer and head. The tokens the
model could not predict are the facts a later question names (a needle's key words and its digits), where the
novelty prior finds the digits but not always their key. Shares of the middle rows: SNOV novelty, SSUR surprisal,
SIND induction (defaults 0.5 / 0.25 / 0.0: surprisal in induction's place), the window the rest; surprisal reserves
first. Here the surprisal comes from a separate forward of the whole model before the prefill (a quality measure
only: in the library it would be the prefill's own logits, an LM-head GEMM over the context, and compression would
wait for the last layer)."""
import os
import sys
from contextlib import contextmanager

import torch
from _pilot import run

import kvcompress.methods as methods
import kvcompress.presses as pr

SHARES = {"surprisal": float(os.environ.get("SSUR", "0.25")), "novelty": float(os.environ.get("SNOV", "0.5")),
          "induction": float(os.environ.get("SIND", "0.0"))}
Press = pr.CompressKVPress
call, before_forward, forward_hook, record_reference = (
    Press.__call__, Press._before_forward, Press.forward_hook, Press.record_reference)


@contextmanager
def patched_call(self, model):
    self.__dict__["_lm"], self.__dict__["_busy"], self.__dict__["_surprisal"] = model, False, None
    with call(self, model):
        yield


def patched_before_forward(self, decoder, args, kwargs):
    if self.__dict__.get("_busy"):
        return
    before_forward(self, decoder, args, kwargs)
    ids = self._call[1]
    if self._repeating or ids is None or ids.shape[1] < 2 or self.plan(ids.shape[1]) is None:
        return
    self.__dict__["_busy"] = True
    try:
        with torch.no_grad():
            logits = self.__dict__["_lm"](input_ids=ids, use_cache=False).logits.float()
        picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        self.__dict__["_surprisal"] = torch.cat([torch.zeros_like(picked[:, :1]), -picked], dim=1)  # [b, n]
    finally:
        self.__dict__["_busy"] = False


def patched_forward_hook(self, module, input, kwargs, output):
    return output if self.__dict__.get("_busy") else forward_hook(self, module, input, kwargs, output)


def patched_record_reference(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    surprisal = self.__dict__.get("_surprisal")
    if surprisal is not None and surprisal.shape[-1] == keys.shape[-2] and surprisal.shape[0] == keys.shape[0]:
        reference.mass["surprisal"] = surprisal[:, None, :].expand(-1, keys.shape[1], -1).to(keys.device)
    return reference


def patched_reserved_rows(self, rows):
    counts, left = {}, rows
    for source in methods.PRIORS:
        counts[source] = min(round(SHARES[source] * rows), left)
        left -= counts[source]
    return counts


methods.PRIORS = ("surprisal", "novelty", "induction")
Press.__call__ = patched_call
Press._before_forward = patched_before_forward
Press.forward_hook = patched_forward_hook
Press.record_reference = patched_record_reference
Press._reserved_rows = patched_reserved_rows

sys.exit(run(sys.argv[1:]))
