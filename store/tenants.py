"""Per-tenant byte accounting, quotas and fair-share eviction inside one write transaction.

Without this, one tenant that floods the store evicts everyone else (the budget is one LRU). A namespace row
carries its tenant's label (``NamespaceInfo.tenant_id``, store format 1.1; rows without one are the *default*
tenant) and ``Index`` keeps one counter row per labelled tenant in ``meta`` (``tenant/<label>``: the sums over
its namespaces; the default tenant's share is what the store-wide totals leave). ``verify`` checks these rows
against the namespace rows and ``gc`` rebuilds them (``expected_tenants``), as for every other counter.

Rules, applied after a put added its entry (``enforce``):

1. Quota: a tenant over ``TenantPolicy.quota(max_bytes)`` evicts its own least recently used entries until it
   is within it; if it cannot (pinned entries, or the new checkpoint alone is larger), the put is refused.
2. Budget: while the store is over ``max_bytes``, the tenant most over its fair share (``max_bytes`` / active
   tenants, equal shares: the one holding most bytes) loses its least recently used entry. A tenant within
   its fair share loses nothing while another is over. With one tenant this is the store's plain LRU, and a
   store with no tenant label at all (format 1.0) takes exactly the old path (``Index.evict_to``).

Cost: a put that must evict or check a quota reads one counter row per tenant holding bytes, then walks the
LRU rows for victims, resuming each tenant's walk where it stopped (each row read at most once per tenant and
put; a namespace row read once per namespace met). A put within budget and without a quota reads nothing
more than before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

from .errors import CorruptIndex, InvalidInput, StoreFullError
from .index import Index
from .values import (
    TENANT_KEY_PREFIX,
    TENANT_MINOR,
    Entry,
    NamespaceInfo,
    Totals,
    decode_typed,
    is_tenant_key,
    pack,
    tenant_key,
)

__all__ = ["DEFAULT_TENANT", "TenantPolicy", "TenantUsage", "usage", "enforce", "fair_victim_tenant",
           "expected_tenants", "tenant_problems", "rebuild_tenants"]

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
    """Bytes and entries per tenant label (``DEFAULT_TENANT`` for unlabelled namespaces), and the tenant of
    each namespace met (read lazily from its row, in the same transaction)."""

    index: Index
    bytes: dict[bytes, int] = field(default_factory=dict)
    entries: dict[bytes, int] = field(default_factory=dict)
    tenant_of: dict[bytes, bytes] = field(default_factory=dict)   # namespace key -> tenant label

    def tenant(self, ns: bytes) -> bytes:
        tid = self.tenant_of.get(ns)
        if tid is None:
            try:
                info = self.index.namespace(ns)
            except CorruptIndex:  # counted as the default tenant's until gc rebuilds it
                info = None
            tid = self.tenant_of[ns] = (info.tenant_id if info is not None else None) or DEFAULT_TENANT
        return tid


def usage(index: Index) -> TenantUsage:
    """Per-tenant bytes and entries from the tenant counter rows (one read per tenant)."""
    table = index.tenant_table()
    return TenantUsage(index, {t: v.bytes for t, v in table.items()}, {t: v.entries for t, v in table.items()})


def expected_tenants(nsinfo: dict[bytes, NamespaceInfo]) -> dict[bytes, Totals]:
    """The counter rows invariant 6 demands: per labelled tenant, the sums over its namespace rows' counters
    (tenants holding nothing have no row)."""
    out: dict[bytes, Totals] = {}
    for info in nsinfo.values():
        if info.tenant_id is not None and (info.bytes or info.entries):
            t = out.setdefault(info.tenant_id, Totals())
            t.bytes += info.bytes
            t.entries += info.entries
    return {tid: t for tid, t in out.items() if t.bytes or t.entries}


def _stored_tenants(txn, dbs) -> dict[bytes, Totals | None]:
    """The tenant counter rows as stored (None: a damaged value)."""
    out: dict[bytes, Totals | None] = {}
    cursor = txn.cursor(db=dbs["meta"])
    more = cursor.set_range(TENANT_KEY_PREFIX)
    while more and bytes(cursor.key()).startswith(TENANT_KEY_PREFIX):
        key = bytes(cursor.key())
        try:
            out[key[len(TENANT_KEY_PREFIX):]] = (decode_typed("meta", cursor.value(), key)
                                                 if is_tenant_key(key) else None)
        except CorruptIndex:
            out[key[len(TENANT_KEY_PREFIX):]] = None
        more = cursor.next()
    return out


def tenant_problems(txn, dbs, nsinfo: dict[bytes, NamespaceInfo]) -> list[str]:
    """Tenant counter rows that disagree with the namespace rows (``verify``; ``gc`` rebuilds them). An older
    spec-cache (format 1.0) writing a 1.1 store updates the namespace rows but not these."""
    stored, expected = _stored_tenants(txn, dbs), expected_tenants(nsinfo)
    return [f"tenant {tid.hex()[:16]}: counters say {_say(stored.get(tid))}, its namespaces hold "
            f"{_say(expected.get(tid))} (run 'spec-cache gc')"
            for tid in sorted(stored.keys() | expected.keys()) if stored.get(tid) != expected.get(tid)]


def _say(t: Totals | None) -> str:
    return "nothing" if t is None else f"{t.entries} entries / {t.bytes} bytes"


def rebuild_tenants(txn, dbs, nsinfo: dict[bytes, NamespaceInfo]) -> int:
    """Write the tenant counter rows ``expected_tenants`` demands, delete the others (``gc``); returns the
    rows changed."""
    stored, expected = _stored_tenants(txn, dbs), expected_tenants(nsinfo)
    changed = 0
    for tid in stored.keys() - expected.keys():
        txn.delete(tenant_key(tid), db=dbs["meta"])
        changed += 1
    for tid, totals in expected.items():
        if stored.get(tid) != totals:
            txn.put(tenant_key(tid), pack(totals), db=dbs["meta"])
            changed += 1
    return changed


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
        self.use.bytes[tid] = self.use.bytes.get(tid, 0) - freed
        self.use.entries[tid] = self.use.entries.get(tid, 0) - 1
        return True


def enforce(index: Index, ns_key: bytes, new_entry: bytes, *, max_bytes: int | None, policy: TenantPolicy,
            new_bytes: int, exclude: Collection[bytes] = ()) -> int:
    """After a put of ``new_entry`` under ``ns_key``: the writer's quota, then the budget by fair share (see the
    module docstring). Returns the entries evicted; raises ``StoreFullError`` when the writer cannot get
    within its quota or the store within ``max_bytes`` (the caller's transaction is then aborted). ``exclude``:
    entries never evicted here, as pinned ones (``Store.leases``)."""
    quota = policy.quota(max_bytes)
    labelled = index.format_minor() >= TENANT_MINOR
    if quota is None and not labelled:  # no tenant labels, no quota: the store's plain LRU, as before
        if max_bytes is None:
            return 0
        evicted = index.evict_to(max_bytes, {new_entry, *exclude})
        _check_budget(index, max_bytes, new_bytes)
        return evicted
    if quota is None and (max_bytes is None or index.totals().bytes <= max_bytes):
        return 0  # within budget and no quota to check: nothing to read
    use = usage(index)
    victims = _Victims(index, use, {new_entry, *exclude})
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
