"""Eviction policy: which entry leaves first, and which never leaves, for every path that removes entries.

The policy is written here once; the mechanics are not: removing an entry with its records, counters and LRU row
is ``Index.remove_entry``'s, and every caller owns its transaction. Who asks what:

======================  ==========================================  =============================================
path                    order                                       protected (never chosen)
======================  ==========================================  =============================================
a put (``enforce``,     the writer's tenant over its quota loses    pinned entries, the entry just put, entries
``Store._commit``)      its own LRU entries; then, over             this process leases (``Store.leases``); a
                        ``max_bytes``, the tenant most over its     damaged entry is skipped (``gc`` removes it)
                        fair share loses its LRU entry
full map or disk        least recently used first, one per          as a put
(``Store._evict_for_    transaction
space``)
``maintenance.evict``   ``to_size``: least recently used first;     pinned entries, except under ``everything``,
(an operator's order)   filters: every entry they select            ``namespace`` or ``drafter`` (an explicit
                                                                    order); leases are not seen (another process)
continuation records    least recently *written* first, while over  nothing
(``continuations.py``)  ``max_records`` or ``max_bytes``
======================  ==========================================  =============================================

Rules of the budget (a put; after ``Index.add_entry`` in the put's transaction):

1. A checkpoint alone over ``max_bytes`` is refused before anything is written (``check_alone``).
2. Quota: a tenant over ``TenantPolicy.quota(max_bytes)`` evicts its own least recently used entries until it
   is within it; if it cannot (pinned entries, or the new checkpoint alone is larger), the put is refused.
3. Budget: while the store is over ``max_bytes``, the tenant most over its fair share (``max_bytes`` / active
   tenants, equal shares: the one holding most bytes) loses its least recently used entry. A tenant within
   its fair share loses nothing while another is over. With one tenant this is the store's plain LRU, and a
   store with no tenant label at all (format 1.0) takes exactly the plain path (``evict_lru_to``).
4. What pinned entries (and leases) hold past the budget makes the put refused (``StoreFullError``): the caller
   aborts the transaction, so the store is unchanged.

The memory tier (``spec_cache.tiers.memory_tier``) applies the same quota and fair-share rules to what it holds,
through this module's ``TenantPolicy`` and ``fair_victim_tenant`` (plus its own: entries not yet in LMDB are never
evicted).

Cost: a put that must evict or check a quota reads one counter row per tenant holding bytes, then walks the
LRU rows for victims, resuming each tenant's walk where it stopped (each row read at most once per tenant and
put; a namespace row read once per namespace met). A put within budget and without a quota reads nothing
more than the totals row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterator

from .errors import CorruptIndex, InvalidInput, StoreFullError
from .index import Index
from .tenants import TenantUsage, usage
from .values import TENANT_MINOR, Entry

__all__ = ["TenantPolicy", "evictable", "lru_victims", "evict_lru", "evict_lru_to", "fair_victim_tenant",
           "TenantVictims", "enforce", "check_alone", "operator_selection", "over_bounds"]

#: an LRU row past every real one (8 bytes of time + a 32-byte key): a walk that reached the end resumes here
_PAST_EVERY_ROW = b"\xff" * 41


@dataclass(frozen=True)
class TenantPolicy:
    """Per-tenant quota: ``quota_bytes`` (absolute) and/or ``share`` (a fraction of ``max_bytes``); the smaller
    one holds. Neither: no quota (fair-share eviction under ``max_bytes`` still applies)."""

    quota_bytes: int | None = None
    share: float | None = None

    @classmethod
    def of(cls, quota_bytes=None, share=None, max_bytes: int | None = None) -> "TenantPolicy":
        """Checked options; ``InvalidInput`` naming the bad one."""
        if quota_bytes is not None and (isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int)
                                        or quota_bytes <= 0):
            raise InvalidInput("tenant_quota_bytes must be a positive int or None")
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise InvalidInput("tenant_share must be a number in (0, 1] or None")
            if max_bytes is None:
                raise InvalidInput("tenant_share is a fraction of max_bytes: give max_bytes too")
        return cls(quota_bytes, None if share is None else float(share))

    def quota(self, max_bytes: int | None) -> int | None:
        """Bytes one tenant may hold (None: no quota)."""
        limits = [q for q in (self.quota_bytes,
                              int(max_bytes * self.share) if self.share is not None and max_bytes else None)
                  if q is not None]
        return min(limits) if limits else None

    @property
    def active(self) -> bool:
        return self.quota_bytes is not None or self.share is not None


def evictable(index: Index, key: bytes, exclude: Collection[bytes]) -> Entry | None:
    """Entry ``key`` if the budget may evict it, else None: not in ``exclude`` (the entry just put, leases), not
    pinned, and readable (a damaged entry is gc's to remove; eviction goes around it)."""
    if key in exclude:
        return None
    try:
        entry = index.entry(key)
    except CorruptIndex:
        return None
    return None if entry is None or entry.pinned else entry


def lru_victims(index: Index, exclude: Collection[bytes] = (), *,
                start: bytes | None = None) -> Iterator[tuple[bytes, bytes, Entry]]:
    """Evictable entries (``evictable``), least recently used first, from LRU row ``start`` on: (LRU row, key,
    entry)."""
    for row, key in index.lru_rows(start):
        entry = evictable(index, key, exclude)
        if entry is not None:
            yield row, key, entry


def evict_lru(index: Index, exclude: Collection[bytes] = ()) -> bool:
    """Remove the least recently used evictable entry; False if there is none."""
    victim = next(lru_victims(index, exclude), None)
    if victim is None:
        return False
    index.remove_entry(victim[1], victim[2])
    return True


def evict_lru_to(index: Index, max_bytes: int, exclude: Collection[bytes]) -> int:
    """Evict least recently used entries until the store holds at most ``max_bytes``; returns how many."""
    evicted = 0
    while index.totals().bytes > max_bytes and evict_lru(index, exclude):
        evicted += 1
    return evicted


def fair_victim_tenant(tenant_bytes: dict[bytes, int], exhausted: set[bytes]) -> bytes | None:
    """The tenant most over its fair share (equal shares: most bytes; ties by label), skipping ``exhausted``."""
    live = [(b, t) for t, b in tenant_bytes.items() if b > 0 and t not in exhausted]
    return max(live)[1] if live else None


class TenantVictims:
    """Least recently used evictable entries of one tenant at a time, resuming each tenant's walk of the LRU
    rows where it stopped (rows only go away during an eviction, so nothing is skipped)."""

    def __init__(self, index: Index, use: TenantUsage, exclude: set[bytes]):
        self.index, self.use, self.exclude = index, use, exclude
        self.resume: dict[bytes, bytes] = {}

    def next(self, tid: bytes) -> tuple[bytes, Entry] | None:
        for row, key, entry in lru_victims(self.index, self.exclude, start=self.resume.get(tid)):
            if self.use.tenant(entry.namespace) == tid:
                self.resume[tid] = row
                return key, entry
        self.resume[tid] = _PAST_EVERY_ROW
        return None

    def evict(self, tid: bytes) -> bool:
        """Remove ``tid``'s least recently used evictable entry; False if it has none."""
        victim = self.next(tid)
        if victim is None:
            return False
        key, entry = victim
        freed = self.index.remove_entry(key, entry)
        self.use.bytes[tid] = self.use.bytes.get(tid, 0) - freed
        self.use.entries[tid] = self.use.entries.get(tid, 0) - 1
        return True


def check_alone(nbytes: int, max_bytes: int | None, what: str = "") -> None:
    """Rule 1: ``StoreFullError`` if a checkpoint of ``nbytes`` alone exceeds ``max_bytes``."""
    if max_bytes is not None and nbytes > max_bytes:
        raise StoreFullError(f"checkpoint of {nbytes} bytes{what} exceeds the store's max_bytes {max_bytes}")


def enforce(index: Index, ns_key: bytes, new_entry: bytes, *, max_bytes: int | None, policy: TenantPolicy,
            new_bytes: int, exclude: Collection[bytes] = ()) -> int:
    """After a put of ``new_entry`` under ``ns_key``: the writer's quota, then the budget by fair share (rules
    2-4 above). Returns the entries evicted; raises ``StoreFullError`` when the writer cannot get within its
    quota or the store within ``max_bytes`` (the caller's transaction is then aborted). ``exclude``: entries
    never evicted here, as pinned ones (``Store.leases``)."""
    quota = policy.quota(max_bytes)
    labelled = index.format_minor() >= TENANT_MINOR
    if quota is None and not labelled:  # no tenant labels, no quota: the store's plain LRU
        if max_bytes is None:
            return 0
        evicted = evict_lru_to(index, max_bytes, {new_entry, *exclude})
        _check_budget(index, max_bytes, new_bytes)
        return evicted
    if quota is None and (max_bytes is None or index.totals().bytes <= max_bytes):
        return 0  # within budget and no quota to check: nothing to read
    use = usage(index)
    victims = TenantVictims(index, use, {new_entry, *exclude})
    evicted = 0
    if quota is not None:
        tid = use.tenant(ns_key)
        while use.bytes.get(tid, 0) > quota and victims.evict(tid):
            evicted += 1
        if use.bytes.get(tid, 0) > quota:
            raise StoreFullError(
                f"checkpoint of {new_bytes} bytes does not fit within its tenant's quota of {quota} bytes "
                f"(the tenant's other entries are pinned or it alone is larger)")
    if max_bytes is not None:
        exhausted: set[bytes] = set()
        while index.totals().bytes > max_bytes:
            tid = fair_victim_tenant(use.bytes, exhausted)
            if tid is None:
                break
            if victims.evict(tid):
                evicted += 1
            else:
                exhausted.add(tid)
        _check_budget(index, max_bytes, new_bytes)
    return evicted


def _check_budget(index: Index, max_bytes: int, new_bytes: int) -> None:
    if index.totals().bytes > max_bytes:  # pinned entries hold the rest: refuse, change nothing
        raise StoreFullError(f"checkpoint of {new_bytes} bytes does not fit next to the pinned entries within "
                             f"the store's max_bytes {max_bytes}")


def operator_selection(*, namespace: bytes | None, drafter: str | None,
                       cutoff_ns: int | None) -> Callable[[Entry], bool]:
    """``maintenance.evict``'s filters as one predicate: an entry of ``namespace``, holding ``drafter``'s part,
    not used since ``cutoff_ns`` (pinned entries never match the age filter). Each filter given must match."""
    def selected(e: Entry) -> bool:
        return ((namespace is None or e.namespace == namespace)
                and (cutoff_ns is None or not (e.pinned or e.last_use >= cutoff_ns))
                and (drafter is None or drafter in e.drafters))
    return selected


def over_bounds(records: int, nbytes: int, *, max_records: int, max_bytes: int) -> bool:
    """The continuation table's bound: more than ``max_records`` records or ``max_bytes`` of them (its least
    recently written record goes next)."""
    return records > max_records or nbytes > max_bytes
