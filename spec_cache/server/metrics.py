"""``/metrics``: Prometheus text from a registry of this server's own (never the process-global one).

Counters: requests (by endpoint and status), prompt tokens, cached prompt tokens, generated tokens. Gauges
(read when scraped): prompt-cache hit ratio (cached / prompt tokens since start), queue depth, active rows,
memory-tier bytes and entries, checkpoints not yet durable in LMDB, write-behind bytes pending. Histograms: time
to first token (from the request's arrival to its first generated token) and per-token latency (the time
between token deliveries divided by the tokens delivered).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics", "CONTENT_TYPE_LATEST"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metrics; ``render()`` is the scrape body. Thread-safe (prometheus-client's own locks)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("spec_cache_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("spec_cache_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=registry)
        self.cached_tokens = Counter("spec_cache_cached_prompt_tokens",
                                     "prompt tokens restored from the cache instead of prefilled", registry=registry)
        self.generated_tokens = Counter("spec_cache_generated_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram("spec_cache_time_to_first_token_seconds", "request arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=registry)
        self.token_latency = Histogram("spec_cache_token_latency_seconds", "seconds per generated token after the "
                                       "first", buckets=_TOKEN_BUCKETS, registry=registry)
        self._gauges: list[Gauge] = []
        ratio = Gauge("spec_cache_prompt_cache_hit_ratio", "cached prompt tokens / prompt tokens since start",
                      registry=registry)
        ratio.set_function(self._hit_ratio)

    def _hit_ratio(self) -> float:
        total = self.prompt_tokens._value.get()
        return 0.0 if total == 0 else self.cached_tokens._value.get() / total

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is ``read()`` at scrape time."""
        gauge = Gauge(name, documentation, registry=self.registry)
        gauge.set_function(read)
        self._gauges.append(gauge)

    def render(self) -> bytes:
        return generate_latest(self.registry)
