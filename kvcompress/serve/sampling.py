"""Choosing each next token (greedy, temperature, top-p) and cutting the streamed text at stop strings."""

from __future__ import annotations

import torch


class StopText:
    """Where a growing text may be sent: before any stop string, holding back a tail that could start one
    (and an unfinished UTF-8 character)."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.stopped = False

    def cut(self, text: str) -> tuple[int, bool]:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return min(hits), True
        safe = len(text)
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
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
