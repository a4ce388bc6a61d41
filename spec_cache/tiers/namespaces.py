"""The namespaces a ``SpecCache`` has registered in this process: a bounded table, least recently used first.

Why bounded: every distinct ``cache_salt`` (or API key) is a namespace, and a table that kept each one for good grew
without bound under one tenant's stream of fresh salts, in this process and in LMDB (issue 37, sixth attacker
pass). The table keeps at most ``limit`` namespaces; past it, ``SpecCache`` forgets the least recently used ones
that hold nothing in the memory tier or the write queue, and drops their LMDB row when that row holds nothing
either (``Store.forget_empty_namespaces``). A namespace is registered again, at the cost of one LMDB commit, the
next time a request names it.

Kept for good: a namespace registered without a tenant (one per target, drafter, adapters and KV options: set by
configuration, never by a request) and a ``Generator``'s own namespace (``keep=True``), which it saves under without
naming it again.

Held while in use: a caller that will save under a namespace later (the server's scheduler, for each job from the
moment it takes the job until the job ends) holds it (``hold``, counted: several jobs may share one namespace) and
lets go when done (``release``); a held namespace is never offered for forgetting, so its registration and LMDB row
are there when the checkpoint comes, however many namespaces others name meanwhile (issue 37, seventh pass: a job
lost its first checkpoint to ``2 * limit`` fresh names of other tenants during its prefill). Held ones are bounded
by their holders (the scheduler's rows and queue), so the table holds at most ``limit`` plus those.

A request that named its namespace and writes its checkpoint only after ``limit`` other namespaces came and went,
without holding it, still finds its registration: the last ``limit`` forgotten ones are kept in a second table of
the same bound, from which ``recall`` puts one back. So the tables hold at most ``2 * limit`` small tuples beyond
the held ones, whatever the traffic.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

from spec_cache.errors import InvalidRequest

MAX_NAMESPACES = 1024  # namespaces kept registered in one process (and beyond which empty LMDB rows are dropped)


@dataclass(frozen=True)
class Registration:
    """What ``SpecCache.namespace`` registered a key as (what ``Store.register_namespace`` was told)."""

    target: str           # the target identity
    prefix: str           # the prefix namespace (method, adapters, KV options)
    tenant: bool          # the key was salted with a tenant
    label: bytes | None   # the tenant label its bytes count against (None: the default tenant)
    keep: bool = False    # never forgotten (see the module doc)


class NamespaceTable:
    """Registrations by namespace key, least recently used first, bounded by ``limit`` (and as many forgotten)."""

    def __init__(self, limit: int = MAX_NAMESPACES):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequest(f"max_namespaces must be an int >= 1, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._live: OrderedDict[bytes, Registration] = OrderedDict()
        self._forgotten: OrderedDict[bytes, Registration] = OrderedDict()
        self._kept: dict[bytes, Registration] = {}
        self._holds: Counter[bytes] = Counter()  # key -> its holders (``hold``): never forgotten while held

    def __len__(self) -> int:
        return len(self._live) + len(self._kept)

    def __contains__(self, key: bytes) -> bool:
        return key in self._live or key in self._kept

    def get(self, key: bytes) -> Registration | None:
        """The registration of ``key``, now the most recently used; None if it is not (or no longer) here."""
        with self._lock:
            reg = self._kept.get(key)
            if reg is None:
                reg = self._live.get(key)
                if reg is not None:
                    self._live.move_to_end(key)
            return reg

    def peek(self, key: bytes) -> Registration | None:
        """The registration of ``key`` without touching its place (live, kept or forgotten); None if none."""
        with self._lock:
            return self._kept.get(key) or self._live.get(key) or self._forgotten.get(key)

    def add(self, key: bytes, reg: Registration) -> None:
        """Register ``key``; a key once kept stays kept (``reg.keep`` or an earlier registration's)."""
        with self._lock:
            self._forgotten.pop(key, None)
            if reg.keep or key in self._kept:
                self._live.pop(key, None)
                self._kept[key] = self._kept.get(key) or reg
                return
            self._live[key] = reg
            self._live.move_to_end(key)

    def recall(self, key: bytes) -> Registration | None:
        """A forgotten registration of ``key`` (taken out of the forgotten table), or None."""
        with self._lock:
            return self._forgotten.pop(key, None)

    def hold(self, key: bytes) -> None:
        """One more holder of ``key`` (registered or about to be): not forgotten until every holder released it."""
        with self._lock:
            self._holds[key] += 1

    def release(self, key: bytes) -> None:
        """One holder of ``key`` fewer (a key not held: nothing); with none left it may be forgotten again."""
        with self._lock:
            if self._holds[key] <= 1:
                self._holds.pop(key, None)
            else:
                self._holds[key] -= 1

    def held(self, key: bytes) -> bool:
        with self._lock:
            return key in self._holds

    def holds(self) -> dict[bytes, int]:
        """The held keys and their holders (a copy)."""
        with self._lock:
            return dict(self._holds)

    def over_limit(self, slack: int = 0) -> list[bytes]:
        """The least recently used keys beyond ``limit`` (and ``slack`` more, so that forgetting is batched)."""
        with self._lock:
            n = len(self._live) - self.limit
            if n <= 0:
                return []
            return [key for key, _ in zip(self._live, range(n + slack))]

    def forget(self, keys) -> None:
        """Move ``keys`` to the forgotten table (its oldest go when it passes ``limit``)."""
        with self._lock:
            for key in keys:
                reg = self._live.pop(key, None)
                if reg is not None:
                    self._forgotten[key] = reg
            while len(self._forgotten) > self.limit:
                self._forgotten.popitem(last=False)

    def touch(self, key: bytes) -> None:
        """Make ``key`` the most recently used (a key found busy is passed over by the next forgetting)."""
        with self._lock:
            if key in self._live:
                self._live.move_to_end(key)

    def values(self) -> list[Registration]:
        with self._lock:
            return list(self._kept.values()) + list(self._live.values())
