"""Prefixes fetched from the shared tier ahead of a restore, on another thread than the one that restores them.

The server's scheduler owns the engine on one thread: a shared-tier lookup there (round trips and transfers, up
to the lookup budget) would stall every stream in the batch. So its prefetch pool calls
``SpecCache.prefetch_shared`` before a job is admitted: the lookup runs on a pool thread and the verified result
(host arrays, no MLX) waits in a ``Handoff``; the scheduler's own ``restore``, run inside
``SpecCache.shared_via_prefetch()``, takes it from there and never asks the network itself. Held results are
capped in bytes and expire, so a job cancelled meanwhile leaves nothing behind for long. Tenants share the cap
(``store.background.TenantShares``, as the shared tier's publish queue): a tenant within its share has the oldest
held prefixes of the tenant holding the most dropped instead of its own (issue 37, tenth attacker pass: before,
A's prefetches pushed B's held prefix out and B's request went back to Redis or prefilled).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from spec_cache.store import TenantShares

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
    tenant: bytes = b""  # whose share of the cap it counts against (``SpecCache.tenant_of``)


class Handoff:
    """Thread-safe holder of prefetched ``Incoming`` prefixes, at most ``cap_bytes`` of them."""

    def __init__(self, cap_bytes: int, hold_s: float = HOLD_S):
        self.cap_bytes = cap_bytes
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._held: list[_Held] = []
        self._shares = TenantShares()  # each tenant's bytes held (under ``_lock``)

    def put(self, ns_key: bytes, drafter: str | None, tokens: np.ndarray, got, tenant: bytes = b"") -> bool:
        """Hold ``got`` (a prefix of ``len(tokens)`` tokens) for ``tenant``; False if it alone is over the cap, or
        if it does not fit and ``tenant``, over its share, has nothing more of its own to let go.

        When it does not fit: a tenant within its share of the cap (cap / tenants holding something, itself
        included) has the oldest held prefixes of the tenant holding the most (over its share) dropped; otherwise
        its own oldest go (one tenant alone: the oldest go, as always)."""
        nbytes = got.nbytes
        if nbytes > self.cap_bytes:
            return False
        with self._lock:
            self._expire()
            if self._used() + nbytes > self.cap_bytes:
                fits, _ = self._shares.make_room(tenant, nbytes, self.cap_bytes, self._used, self._drop_oldest)
                while not fits and self._used() + nbytes > self.cap_bytes:
                    freed = self._drop_oldest(tenant)
                    if freed is None:
                        return False  # over its share with nothing of its own left: it pays, never another
                    self._shares.remove(tenant, freed)
            self._held.append(_Held(ns_key, drafter, np.array(tokens, copy=True), got,
                                    time.monotonic() + self.hold_s, tenant))
            self._shares.add(tenant, nbytes)
        return True

    def _used(self) -> int:
        return sum(h.got.nbytes for h in self._held)

    def _drop_oldest(self, tenant: bytes) -> int | None:
        """Let ``tenant``'s oldest held prefix go (under ``_lock``; ``TenantShares.make_room`` counts what a
        victim lets go itself): its bytes, or None when it holds nothing."""
        for i, held in enumerate(self._held):
            if held.tenant == tenant:
                del self._held[i]
                return held.got.nbytes
        return None

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
            for held in mine:
                self._shares.remove(held.tenant, held.got.nbytes)
            return None if best is None else best.got

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._held)

    def _expire(self) -> None:
        now = time.monotonic()
        for held in self._held:
            if held.until <= now:
                self._shares.remove(held.tenant, held.got.nbytes)
        self._held = [h for h in self._held if h.until > now]
