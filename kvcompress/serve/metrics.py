"""Prometheus metrics of the server (one registry per server, so tests can run several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "kvcompress"


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens (context + question)", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "generated tokens", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for the model worker", registry=r)
        self.running = Gauge(f"{PREFIX}_requests_running", "sessions in the decode batch", registry=r)
        self.resident = Gauge(f"{PREFIX}_resident_bytes", "bytes resident under --cache-memory by kind: stored "
                              "(compressed contexts) or active (the decode batch, reserved rows included)", ["kind"],
                              registry=r)
        self.cache_bytes = Gauge(f"{PREFIX}_cache_resident_bytes", "tensor bytes of the resident compressed contexts",
                                 registry=r)
        self.cache_full_bytes = Gauge(f"{PREFIX}_cache_uncompressed_bytes",
                                      "bytes the resident contexts would take uncompressed", registry=r)
        self.cache_sessions = Gauge(f"{PREFIX}_cache_sessions", "resident compressed contexts", registry=r)
        self.cache_evictions = Gauge(f"{PREFIX}_cache_evictions", "contexts evicted from the store so far", registry=r)
        self.context_hits = Counter(f"{PREFIX}_context_reuse_hits", "requests served from a stored context",
                                    ["kind"], registry=r)  # kind: exact (same context) or prefix (a later turn)
        self.context_misses = Counter(f"{PREFIX}_context_reuse_misses", "requests whose context was prefilled",
                                      registry=r)
        self.prefills = Counter(f"{PREFIX}_prefills", "context prefills (under the press unless kept whole)",
                                registry=r)
        self.short_contexts = Counter(f"{PREFIX}_short_contexts", "contexts prefilled and stored whole, shorter than "
                                      "--compress-min-tokens", registry=r)
        self.question_chunks = Counter(f"{PREFIX}_question_chunks", "question prefill calls (a question longer than "
                                       "--prefill-chunk takes several, one between two decode steps)", registry=r)
        self.context_chunks = Counter(f"{PREFIX}_context_chunks", "calls of contexts read in chunks (a new context "
                                      "longer than --prefill-chunk, under a press that can, takes several, one "
                                      "between two decode steps)", registry=r)
        self.compress_rounds = Counter(f"{PREFIX}_context_compress_rounds", "rounds in which a context read in chunks "
                                       "had its next layers compressed (and a repeat pass run through them), after "
                                       "its last chunk", registry=r)
        self.shared_prefills = Counter(f"{PREFIX}_shared_question_prefills", "choices (n > 1) that took another "
                                       "choice's question prefill instead of their own", registry=r)
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
        self.prefill_seconds = Histogram(f"{PREFIX}_prefill_seconds", "context prefill + compression time",
                                         buckets=buckets, registry=r)
        self.question_seconds = Histogram(f"{PREFIX}_question_prefill_seconds", "question prefill time (first token)",
                                          buckets=buckets, registry=r)
        self.decode_seconds = Histogram(f"{PREFIX}_decode_seconds", "decode time per request", buckets=buckets,
                                        registry=r)
        self.queue_seconds = Histogram(f"{PREFIX}_queue_seconds", "time from arrival to admission",
                                       buckets=buckets, registry=r)
        self.ttft_seconds = Histogram(f"{PREFIX}_time_to_first_token_seconds", "time from arrival to the first token",
                                      buckets=buckets, registry=r)
        fine = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.inter_token_seconds = Histogram(f"{PREFIX}_inter_token_seconds", "time between two tokens of a session",
                                             buckets=fine, registry=r)
        self.step_seconds = Histogram(f"{PREFIX}_decode_step_seconds", "one decode step of the whole batch",
                                      buckets=fine, registry=r)
        self.batch_size = Histogram(f"{PREFIX}_batch_size", "sessions decoded per step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.steps_between_prefills = Histogram(
            f"{PREFIX}_decode_steps_between_prefills",
            "decode steps of the batch since the previous context prefill, at each context prefill that runs while "
            "sessions decode (bounded below by --decode-per-prefill)",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.tokens_per_second = Gauge(f"{PREFIX}_decode_tokens_per_second", "tokens per second of the last step",
                                       registry=r)
        self.uncompressed = Counter(f"{PREFIX}_press_fallbacks", "contexts the press could not compress (kept whole)",
                                    registry=r)
        self.cancelled = Counter(f"{PREFIX}_cancelled", "generations cancelled by a client disconnect", registry=r)

    def set_store(self, stats: dict[str, int]) -> None:
        self.cache_bytes.set(stats["bytes"])
        self.cache_full_bytes.set(stats["full_bytes"])
        self.cache_sessions.set(stats["sessions"])
        self.cache_evictions.set(stats["evictions"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
