"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 1b8c25e and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: reference queries from a short generic probe read after the context instead of a second reading of
the context. The repeat pass's machinery reads PROBE (tokenized by the embedded model's tokenizer) through each
layer right after that layer's prefill (streamed: one full layer held at a time, no extra peak), records its
queries as the "repeat" source (max-pooled, weight repeat_weight), and crops them away again. Its cost on a GPU
would be a forward of a few dozen tokens against the context: about the window source's.
Run with --press-option compresskv.reference=[window,novelty,repeat] (or [window,repeat]).
"""

import os
import sys

import kvcompress.repeat_hooks as rh
from kvcompress.cli import main as cli_main
from kvcompress.ruler.harness import load_tokenizer

PROBES = {
    "facts": "\nQuestion: Which facts, names and numbers does the text above state? List them all.\nAnswer:",
    "summary": "\nSummarize the text above in detail.\nSummary:",
    "repeat": "\nRepeat the previous context exactly.\nRepeat:",
}
PROBE = PROBES[os.environ.get("PROBE", "facts")]
_ids = {}


def _embedded_chunks(self, pieces):
    decoder, input_ids = self._call
    if "ids" not in _ids:
        _ids["ids"] = load_tokenizer(None).encode(PROBE, add_special_tokens=False, return_tensors="pt")
    ids = _ids["ids"].to(input_ids.device).expand(input_ids.shape[0], -1)
    import torch

    with torch.no_grad():
        return [decoder.embed_tokens(ids)]


rh.RepeatPassHooks._embedded_chunks = _embedded_chunks
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
