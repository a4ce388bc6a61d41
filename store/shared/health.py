"""The shared tier's health: counters, the last error, and a back-off breaker.

After a failure (connection refused, timeout, an error reply) the tier is ``down`` and nobody talks to it until
the back-off has passed (0.5 s, doubling to 30 s by default); lookups meanwhile are misses that cost nothing and
publishes are dropped. The first request after the back-off probes the server: success makes the tier ``up``.
"""

from __future__ import annotations

import threading
import time

COUNTERS = (
    "lookups", "hits", "misses", "skipped", "timeouts", "errors", "corrupt", "vanished", "bytes_fetched",
    "unauthenticated", "over_budget", "prefetches", "prefetch_hits", "prefetch_used",
    "chunks_local", "bytes_local", "migrating",
    "promoted", "promote_failed", "promote_dropped",
    "queued", "published", "publish_failed", "publish_retried", "bytes_published", "chunks_uploaded",
    "chunks_present", "dropped_full", "dropped_down", "dropped_gone", "dropped_close",
)


class Health:
    """Thread-safe counters and breaker state of one ``SharedTier``."""

    def __init__(self, backoff_s: float, backoff_max_s: float):
        self._lock = threading.Lock()
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.counts = {name: 0 for name in COUNTERS}
        self.state = "unknown"
        self.failures = 0          # consecutive
        self.retry_at = 0.0        # monotonic time before which the tier is not asked
        self.last_error: str | None = None
        self.last_error_ns: int | None = None
        self.last_ok_ns: int | None = None
        self.lookup_seconds: list[float] = []  # the last few lookup latencies (hits and misses)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def available(self) -> bool:
        """Whether a request may be sent now (the breaker is closed or its back-off has passed)."""
        with self._lock:
            return self.state != "down" or time.monotonic() >= self.retry_at

    def ok(self) -> None:
        with self._lock:
            self.state = "up"
            self.failures = 0
            self.last_ok_ns = time.time_ns()

    def fail(self, error: BaseException | str, *, timeout: bool = False) -> None:
        with self._lock:
            self.failures += 1
            self.counts["timeouts" if timeout else "errors"] += 1
            self.state = "down"
            wait = min(self.backoff_max_s, self.backoff_s * 2 ** (self.failures - 1))
            self.retry_at = time.monotonic() + wait
            text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.last_error = " ".join(text.split())[:300]
            self.last_error_ns = time.time_ns()

    def timed(self, seconds: float) -> None:
        with self._lock:
            self.lookup_seconds.append(seconds)
            if len(self.lookup_seconds) > 256:
                del self.lookup_seconds[:128]

    def snapshot(self) -> dict:
        with self._lock:
            lat = sorted(self.lookup_seconds)
            retry_in = max(0.0, self.retry_at - time.monotonic()) if self.state == "down" else 0.0
            return {"state": self.state, "consecutive_failures": self.failures, "retry_in_s": round(retry_in, 3),
                    "last_error": self.last_error, "last_error_ns": self.last_error_ns, "last_ok_ns": self.last_ok_ns,
                    "lookup_p50_ms": round(lat[len(lat) // 2] * 1e3, 3) if lat else None,
                    **self.counts}
