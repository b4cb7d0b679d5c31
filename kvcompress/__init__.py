"""kvcompress: weighted-coreset KV-cache compression (CompressKV, WildCat) for transformers and kvpress."""

from kvcompress.attention import weighted_attention
from kvcompress.nystrom import compress_kv, lambert_w0, rpnys, temperature

__all__ = ["compress_kv", "lambert_w0", "rpnys", "temperature", "weighted_attention"]
__version__ = "0.1.0"
