"""Speed of CompressKV: copy bandwidth, kernel rooflines, and end-to-end prefill/decode on a random-weight model.

Sections (``--only`` picks a subset; every timing is a median over repeats after warm-ups):

* ``bandwidth``: a large device-to-device copy; bytes moved (read + write) / time. This is the
  denominator of every roofline fraction below.
* ``kernels``: achieved bytes/s over the copy bandwidth for ``compress_kv`` (bins = rank / 12 at
  the kept fraction; bytes = K and V read once + K_S, V_S, w written) and for ``weighted_attention``
  decode (one query per head, GQA; bytes = K, V, w read once + q and out), per ``backend``. A stock
  ``scaled_dot_product_attention`` on the same K, V is timed beside it for reference.
* ``e2e``: a random-weight model built from a config (default: Qwen2.5-7B-Instruct's shape; no
  weights are downloaded). Prefill time with no press, kvpress SnapKVPress and CompressKVPress; decode
  tokens/s and peak memory for the full cache (sdpa, flash_attention_2 when flash_attn imports) and
  the compressed caches; and the attention part of a decode step alone: one layer's attention call on
  each cache (the model's attention function, and the raw kernels).
* ``prefill``: the prefill of every press setting (no press, SnapKV, uniform, the paper's, the default, the
  window source, the prefill's own queries non-causal and causal, a quarter repeat pass) broken down into
  forward, repeat forward, attention mass, selection, fit and peak memory (``eval/speed/prefill.py``).
* ``decode`` (``eval/speed/decode.py``): ms per decode step, tokens/s and peak memory per cache variant: the
  full cache eager (sdpa) and static + ``torch.compile``; an unweighted static cache of the kept size, compiled
  (the floor for a compressed cache); SnapKV eager; CompressKV eager and compiled over a
  ``StaticWeightedCache``; at each of ``decode_contexts`` x ``decode_batch_sizes``. One layer's attention call
  is timed from Python and replayed in a CUDA graph.

On CUDA the timings use CUDA events; kernel timings zero an L2-sized buffer before each sample so that
no cache stays warm between calls. On CPU (``--device cpu --smoke``) the same code paths run at tiny
sizes with ``time.perf_counter``: a smoke test, not a performance measurement.

Run from the repository root: ``python -m eval.speed`` (defaults in ``configs/speed.yaml``). Modules: ``config``
(settings, flags), ``clock`` (timing, backends), ``kernels`` (bandwidth and kernel rooflines), ``e2e`` (the
random-weight model), ``prefill`` (the prefill breakdown), ``decode`` (compiled and eager decode steps), ``report``
(goals, tables, environment), ``cli`` (the run).
"""

from eval.speed.cli import main, run
from eval.speed.config import Config, build_parser, resolve_config, resolve_device

__all__ = ["Config", "build_parser", "main", "resolve_config", "resolve_device", "run"]
