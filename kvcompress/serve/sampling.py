"""Choosing each next token (greedy, temperature, top-p), cutting the streamed text at stop strings, and a token's
bytes (what the logprobs report)."""

from __future__ import annotations

import functools
import re

import torch

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for one raw byte


class TokenBytes:
    """``token_bytes(token_id)``: the token's own bytes, OpenAI's logprobs ``bytes`` (a token that ends inside a
    UTF-8 character has its piece of it, where its decoded text is U+FFFD). Byte-level BPE tokenizers (GPT-2,
    Llama 3, Qwen, SmolLM; found by a probe text whose tokens map back to its UTF-8) map each character back to its
    byte; SentencePiece's ``<0xHH>`` tokens are that byte; any other token is its decoded text's UTF-8."""

    PROBE = "Hi there,\n\tcafé 日本語 🎉!"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the tokenizer is a byte-level BPE (asked on the first token: an engine may never report bytes)."""
        return self._byte_level(self.tokenizer.encode(self.PROBE, add_special_tokens=False)) == self.PROBE.encode()

    @functools.cached_property
    def _alphabet(self) -> dict[str, int]:
        """Byte-level BPE's alphabet (GPT-2's, as transformers builds it): character -> byte."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        return {char: byte for byte, char in bytes_to_unicode().items()}

    def _byte_level(self, ids: list[int]) -> bytes | None:
        out, alphabet = bytearray(), self._alphabet
        for piece in self.tokenizer.convert_ids_to_tokens(ids):
            for char in piece or "":
                byte = alphabet.get(char)
                if byte is None:
                    return None
                out.append(byte)
        return bytes(out)

    def __call__(self, token_id: int) -> bytes:
        if self.byte_level:
            raw = self._byte_level([token_id])
            if raw is not None:
                return raw
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode("utf-8", "surrogatepass")


class StopText:
    """Where a growing text may be sent: before any stop string, holding back a tail that could start one
    (and an unfinished UTF-8 character)."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.stopped = False

    def cut(self, text: str) -> tuple[int, bool]:
        safe = len(text)
        while safe > 0 and text[safe - 1] == "\ufffd":  # an unfinished UTF-8 character: not text yet
            safe -= 1
        text = text[:safe]
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return min(hits), True
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return safe, False


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) restricted to the top-p mass."""
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits.double().cpu()
    probs = torch.softmax((scaled - scaled.max()) / temperature, dim=-1)  # float64, max first: any temperature > 0
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # the smallest set whose mass reaches top_p
        keep[0] = True  # the likeliest token always (a top_p below every rounding keeps it alone)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
