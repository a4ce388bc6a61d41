"""Per-tenant byte accounting inside one write transaction: who holds how many bytes, and the counter rows.

Without tenants, one tenant that floods the store evicts everyone else (the budget is one LRU). A namespace row
carries its tenant's label (``NamespaceInfo.tenant_id``, store format 1.1; rows without one are the *default*
tenant) and ``Index`` keeps one counter row per labelled tenant in ``meta`` (``tenant/<label>``: the sums over
its namespaces; the default tenant's share is what the store-wide totals leave). ``verify`` checks these rows
against the namespace rows and ``gc`` rebuilds them (``expected_tenants``), as for every other counter.

The rules that act on these counts (quotas, fair-share eviction under the budget) are ``eviction.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CorruptIndex
from .index import Index
from .values import (
    TENANT_KEY_PREFIX,
    NamespaceInfo,
    Totals,
    decode_typed,
    is_tenant_key,
    pack,
    tenant_key,
)

__all__ = ["DEFAULT_TENANT", "TenantUsage", "usage", "expected_tenants", "tenant_problems", "rebuild_tenants"]

DEFAULT_TENANT = b""  # the tenant of namespaces without a label (every namespace of a 1.0 store)


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
