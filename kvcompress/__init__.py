"""kvcompress: weighted-coreset KV-cache compression (CompressKV, WildCat) for transformers and kvpress."""

from kvcompress.attention import weighted_attention
from kvcompress.bin_temperature import temperature
from kvcompress.lambert import lambert_w0
from kvcompress.nystrom import compress_kv, rpnys

__all__ = [
    "CompressKVPress",
    "StaticWeightedCache",
    "UniformPress",
    "compress_kv",
    "lambert_w0",
    "prefill_in_chunks",
    "rpnys",
    "temperature",
    "use_weighted_attention",
    "weighted_attention",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The presses import kvpress and transformers; the tensor API does not need them.
    if name == "CompressKVPress":
        from kvcompress import presses

        return presses.CompressKVPress
    if name == "UniformPress":
        from kvcompress import uniform_press

        return uniform_press.UniformPress
    if name == "StaticWeightedCache":
        from kvcompress import static_cache

        return static_cache.StaticWeightedCache
    if name == "prefill_in_chunks":
        from kvcompress import context_chunks

        return context_chunks.prefill_in_chunks
    if name == "use_weighted_attention":
        from kvcompress import hf_attention

        return hf_attention.use_weighted_attention
    raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")
