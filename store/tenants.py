"""Per-tenant byte accounting, quotas and fair-share eviction inside one write transaction.

Without this, one tenant that floods the store evicts everyone else (the budget is one LRU). A namespace row
carries its tenant's label (``NamespaceInfo.tenant_id``, store format 1.1; rows without one are the *default*
tenant), so a tenant's bytes are the sum over its namespaces' byte counters: no counter of its own, nothing a
1.0 writer could leave stale, nothing ``gc`` must rebuild.

Rules, applied after a put added its entry (``enforce``):

1. Quota: a tenant over ``TenantPolicy.quota(max_bytes)`` evicts its own least recently used entries until it
   is within it; if it cannot (pinned entries, or the new checkpoint alone is larger), the put is refused.
2. Budget: while the store is over ``max_bytes``, the tenant most over its fair share (``max_bytes`` / active
   tenants, equal shares: the one holding most bytes) loses its least recently used entry. A tenant within
   its fair share loses nothing while another is over. With one tenant this is the store's plain LRU, and a
   store with no tenant label at all (format 1.0) takes exactly the old path (``Index.evict_to``).

Cost: one read of every namespace row per put that must evict or check a quota (~2 µs a row); victims are
found by walking the LRU rows from where the last search for that tenant stopped (each row read at most
once per tenant and put).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CorruptIndex, InvalidInput, StoreFullError
from .index import Index
from .values import TENANT_MINOR, Entry, decode_typed

__all__ = ["DEFAULT_TENANT", "TenantPolicy", "TenantUsage", "usage", "enforce", "fair_victim_tenant"]

DEFAULT_TENANT = b""  # the tenant of namespaces without a label (every namespace of a 1.0 store)


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


@dataclass
class TenantUsage:
    """Bytes and entries per tenant label, and each namespace's tenant (read in one transaction)."""

    bytes: dict[bytes, int] = field(default_factory=dict)
    entries: dict[bytes, int] = field(default_factory=dict)
    namespaces: dict[bytes, int] = field(default_factory=dict)
    tenant_of: dict[bytes, bytes] = field(default_factory=dict)   # namespace key -> tenant label

    def tenant(self, ns: bytes) -> bytes:
        return self.tenant_of.get(ns, DEFAULT_TENANT)


def usage(index: Index) -> TenantUsage:
    """Per-tenant bytes from the namespace rows (a damaged row counts its namespace as the default tenant's,
    with no bytes: ``gc`` rebuilds it)."""
    out = TenantUsage()
    for raw_key, raw in index.txn.cursor(db=index.dbs["nsinfo"]):
        ns = bytes(raw_key)
        try:
            info = decode_typed("nsinfo", raw, ns)
        except CorruptIndex:
            continue
        tid = info.tenant_id or DEFAULT_TENANT
        out.tenant_of[ns] = tid
        out.bytes[tid] = out.bytes.get(tid, 0) + info.bytes
        out.entries[tid] = out.entries.get(tid, 0) + info.entries
        out.namespaces[tid] = out.namespaces.get(tid, 0) + 1
    return out


def fair_victim_tenant(tenant_bytes: dict[bytes, int], exhausted: set[bytes]) -> bytes | None:
    """The tenant most over its fair share (equal shares: most bytes; ties by label), skipping ``exhausted``."""
    live = [(b, t) for t, b in tenant_bytes.items() if b > 0 and t not in exhausted]
    return max(live)[1] if live else None


class _Victims:
    """Least recently used evictable entries of one tenant at a time, resuming each tenant's walk of the LRU
    rows where it stopped (rows only go away during an eviction, so nothing is skipped)."""

    def __init__(self, index: Index, use: TenantUsage, exclude: set[bytes]):
        self.index, self.use, self.exclude = index, use, exclude
        self.resume: dict[bytes, bytes] = {}

    def next(self, tid: bytes) -> tuple[bytes, Entry] | None:
        cursor = self.index.txn.cursor(db=self.index.dbs["lru"])
        start = self.resume.get(tid)
        more = cursor.set_range(start) if start is not None else cursor.first()
        while more:
            row = bytes(cursor.key())
            key = row[8:]
            if key not in self.exclude:
                try:
                    entry = self.index.entry(key)
                except CorruptIndex:  # a damaged entry is gc's to remove; evict around it
                    entry = None
                if entry is not None and not entry.pinned and self.use.tenant(entry.namespace) == tid:
                    self.resume[tid] = row
                    return key, entry
            more = cursor.next()
        self.resume[tid] = b"\xff" * 41  # past every row
        return None

    def evict(self, tid: bytes) -> bool:
        """Remove ``tid``'s least recently used evictable entry; False if it has none."""
        victim = self.next(tid)
        if victim is None:
            return False
        key, entry = victim
        freed = self.index.remove_entry(key, entry)
        self.use.bytes[tid] -= freed
        self.use.entries[tid] -= 1
        return True


def enforce(index: Index, ns_key: bytes, new_entry: bytes, *, max_bytes: int | None, policy: TenantPolicy,
            new_bytes: int) -> int:
    """After a put of ``new_entry`` under ``ns_key``: the writer's quota, then the budget by fair share (see the
    module docstring). Returns the entries evicted; raises ``StoreFullError`` when the writer cannot get
    within its quota or the store within ``max_bytes`` (the caller's transaction is then aborted)."""
    quota = policy.quota(max_bytes)
    labelled = index.format_minor() >= TENANT_MINOR
    if quota is None and not labelled:  # no tenant labels, no quota: the store's plain LRU, as before
        if max_bytes is None:
            return 0
        evicted = index.evict_to(max_bytes, {new_entry})
        _check_budget(index, max_bytes, new_bytes)
        return evicted
    use = usage(index)
    victims = _Victims(index, use, {new_entry})
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
