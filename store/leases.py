"""Leases: entries the byte budget must not evict for a while, held by this process only.

Why not the entry's persisted ``pinned`` flag: that pin outlives every process and needs someone to take it off;
a lease (``serve``'s ``/v1/cache/pin``, with a TTL) ends by itself when its time passes, when it is released, or
when the process ends, so a crashed server never leaves entries pinned for ever. Eviction on put
(``eviction.enforce``) and the full-map fallback (``Store._evict_for_space``) pass ``held()`` as their exclude set;
``spec-cache evict`` (another process, an operator's explicit order) does not see leases.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Leases"]


class Leases:
    """Entry key -> end of its lease (``time.monotonic()``). Thread-safe; expired leases drop on read."""

    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def hold(self, key: bytes, until: float) -> None:
        """Hold ``key`` until ``until`` (a later ``hold`` of the same key replaces the end)."""
        with self._lock:
            self._until[bytes(key)] = float(until)

    def release(self, key: bytes) -> None:
        with self._lock:
            self._until.pop(bytes(key), None)

    def held(self) -> set[bytes]:
        """The keys whose lease has not ended."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._until.items() if t <= now]:
                del self._until[key]
            return set(self._until)
