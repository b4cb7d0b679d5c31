"""The compressed-context store: one resident cache per (context tokens, model, press settings), LRU by bytes.

A stored cache is never changed by an answer: :func:`answer_view` hands out a cache whose layer objects are
shallow copies sharing the stored tensors; every row an answer appends goes through ``torch.cat`` into new
tensors owned by the copy, so the stored tensors and layer objects stay as they were (copy on write).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvcompress.cache import WeightedLayer, cache_bytes

# --turn-reuse: the share of a new context a stored earlier turn must cover to serve it (1.0: none can, a stored
# context is a proper prefix)
TURN_REUSE = {"prefix": 0.5, "exact": 1.0}
# --compress-min-tokens' default: a context shorter than this is stored whole. A system prompt or a short chat history
# saves a few hundred rows at most compressed, and loses what it says (a 53-token chat compressed at 25% kept forgot
# the number it asked the model to remember; a 28-token system prompt's persona was dropped)
COMPRESS_MIN_TOKENS = 256


def check_compress_min_tokens(value: int) -> int:
    """``value`` if it is a valid ``--compress-min-tokens`` (an integer >= 0), else a one-line ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"--compress-min-tokens: must be an integer >= 0, got {value!r}")
    return value

StoreKey = tuple[tuple[int, ...], str, str]  # (context token ids, model name, press settings)


def full_cache_bytes(cache: DynamicCache, tokens: int) -> int:
    """Bytes the same context would take uncompressed: ``tokens`` rows of keys and values in every layer."""
    total = 0
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4:
            row = keys.shape[1] * keys.shape[3] * keys.element_size()
            row += values.shape[1] * values.shape[3] * values.element_size()
            total += keys.shape[0] * row * tokens
    return total


def answer_view(cache: DynamicCache) -> DynamicCache:
    """A cache for one answer over ``cache``: same tensors, own layer objects (appends never reach the original)."""
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in view.layers:
        if isinstance(layer, WeightedLayer):
            layer.keys = layer.keys[...]  # a fresh view, so the tag names this layer object and not the stored one
            layer.values = layer.values[...]
    return view


@dataclass
class Entry:
    key: StoreKey
    cache: DynamicCache
    tokens: int  # context tokens the cache stands for
    nbytes: int  # real tensor bytes held
    full_nbytes: int  # what the uncompressed cache of the context would take


class ContextStore:
    """LRU store of compressed context caches within ``capacity`` bytes (thread-safe).

    ``put`` evicts the least recently used entries until the new one fits; an entry larger than the whole
    budget is not kept (the request that made it still gets its answer).
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"cache_memory: must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[StoreKey, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, key: StoreKey) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def __contains__(self, key: StoreKey) -> bool:
        """Whether ``key`` is stored (without marking it used)."""
        with self._lock:
            return key in self._entries

    def longest_prefix(self, tokens: tuple[int, ...], model: str, press: str, min_tokens: int) -> Entry | None:
        """The stored entry of this model and press whose context is the longest proper prefix of ``tokens``
        with at least ``min_tokens`` tokens (marked as used), or None."""
        with self._lock:
            best = None
            for key, entry in self._entries.items():
                ids, key_model, key_press = key
                if key_model != model or key_press != press or not (min_tokens <= len(ids) < len(tokens)):
                    continue
                if tokens[: len(ids)] == ids and (best is None or len(ids) > best.tokens):
                    best = entry
            if best is not None:
                self._entries.move_to_end(best.key)
            return best

    def put(self, key: StoreKey, cache: DynamicCache, tokens: int) -> Entry | None:
        """Store ``cache`` (which the caller must not change afterwards); returns the entry, None if too big."""
        entry = Entry(key, cache, tokens, cache_bytes(cache), full_cache_bytes(cache, tokens))
        with self._lock:
            old = self._entries.pop(key, None)
            if entry.nbytes > self.capacity:
                if old is not None:
                    self.evictions += 1
                return None
            while self._entries and self.resident_bytes_locked() + entry.nbytes > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1
            self._entries[key] = entry
            return entry

    def evict_to(self, limit: int, keep: StoreKey | None = None) -> int:
        """Evict least recently used entries (never ``keep``) until at most ``limit`` bytes are resident; returns
        the resident bytes (which stay above ``limit`` when only ``keep`` is left)."""
        with self._lock:
            for key in list(self._entries):
                if self.resident_bytes_locked() <= limit:
                    break
                if key != keep:
                    del self._entries[key]
                    self.evictions += 1
            return self.resident_bytes_locked()

    def resident_bytes(self) -> int:
        with self._lock:
            return self.resident_bytes_locked()

    def resident_bytes_locked(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def stats(self) -> dict[str, int]:
        """sessions, resident bytes, uncompressed bytes of the same contexts, evictions."""
        with self._lock:
            entries = list(self._entries.values())
            return {
                "sessions": len(entries),
                "bytes": sum(e.nbytes for e in entries),
                "full_bytes": sum(e.full_nbytes for e in entries),
                "evictions": self.evictions,
            }

    def keys(self) -> list[StoreKey]:
        with self._lock:
            return list(self._entries)


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes (``ValueError`` naming ``--cache-memory``)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not 0 <= value * units.get(unit, 1) < 2**63:  # NaN and 1e400 (inf) fail too
        raise ValueError(f"--cache-memory: expected a size such as 2GiB, 512MiB or 1000000 (bytes), got {text!r}")
    return int(value * units[unit])
