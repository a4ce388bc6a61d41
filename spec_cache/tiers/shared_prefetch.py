"""Prefixes fetched from the shared tier ahead of a restore, on another thread than the one that restores them.

The server's scheduler owns the engine on one thread: a shared-tier lookup there (round trips and transfers, up
to the lookup budget) would stall every stream in the batch. So its prefetch pool calls
``SpecCache.prefetch_shared`` before a job is admitted: the lookup runs on a pool thread and the verified result
(host arrays, no MLX) waits in a ``Handoff``; the scheduler's own ``restore``, run inside
``SpecCache.shared_via_prefetch()``, takes it from there and never asks the network itself. Held results are
capped in bytes and expire, so a job cancelled meanwhile leaves nothing behind for long.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

#: how long a prefetched prefix waits for the restore that asked for it
HOLD_S = 60.0


@dataclass(frozen=True)
class HeldHit:
    """A held prefix as a candidate for the restore's ``usable`` rule (the fields every tier's candidates have)."""

    length: int
    has_drafter: bool
    minimum_reusable: int


@dataclass
class _Held:
    ns_key: bytes
    drafter: str | None
    tokens: np.ndarray  # the packed prefix it holds
    got: Any            # store.shared.Incoming
    until: float


class Handoff:
    """Thread-safe holder of prefetched ``Incoming`` prefixes, at most ``cap_bytes`` of them."""

    def __init__(self, cap_bytes: int, hold_s: float = HOLD_S):
        self.cap_bytes = cap_bytes
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._held: list[_Held] = []

    def put(self, ns_key: bytes, drafter: str | None, tokens: np.ndarray, got) -> bool:
        """Hold ``got`` (a prefix of ``len(tokens)`` tokens); False if it alone is over the cap (oldest go first)."""
        if got.nbytes > self.cap_bytes:
            return False
        with self._lock:
            self._expire()
            self._held.append(_Held(ns_key, drafter, np.array(tokens, copy=True), got,
                                    time.monotonic() + self.hold_s))
            while sum(h.got.nbytes for h in self._held) > self.cap_bytes:
                self._held.pop(0)
        return True

    def take(self, ns_key: bytes, drafter: str | None, packed: np.ndarray,
             accept: Callable[[HeldHit], bool]):
        """The longest held prefix of ``packed`` under ``ns_key``/``drafter`` that ``accept`` takes, or None. Every
        held prefix of ``packed`` leaves (this restore was the one they were fetched for: one a faster tier
        already covered is of no more use)."""
        with self._lock:
            self._expire()
            best, mine = None, []
            for held in self._held:
                n = len(held.tokens)
                if (held.ns_key != ns_key or held.drafter != drafter or n > len(packed)
                        or not np.array_equal(held.tokens, packed[:n])):
                    continue
                mine.append(held)
                hit = HeldHit(n, held.got.attachment is not None, held.got.minimum_reusable)
                if (best is None or n > len(best.tokens)) and accept(hit):
                    best = held
            self._held = [h for h in self._held if not any(h is m for m in mine)]
            return None if best is None else best.got

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._held)

    def _expire(self) -> None:
        now = time.monotonic()
        self._held = [h for h in self._held if h.until > now]
