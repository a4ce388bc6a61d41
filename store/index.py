"""Bookkeeping of the prefix index inside one write transaction: nodes, entries, LRU rows, counters.

Nodes (one per chain key) hold ``{ns, parent, depth, refs, tails, bytes, complete, minr, broken}``: ``refs``
counts child nodes plus entries hanging off the node, ``tails`` maps a tail length to how many entries hang
off it with that tail (so a lookup only hashes tails that exist). A node whose ``refs`` drops to zero is
deleted with its chunk record, and the drop cascades to its parent: a stored prefix never loses its chunks,
and no chunk outlives the last entry that needs it.
"""

from __future__ import annotations

import struct
import time

import blake3
import msgpack

from .errors import CorruptIndex
from .keys import lru_key
from .values import TOTALS_KEY, decode, unpack

__all__ = ["Index", "TOTALS_KEY", "decode", "draft_key", "now_ns", "pack", "unpack"]


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def draft_key(entry: bytes, drafter_namespace: str) -> bytes:
    return entry + blake3.blake3(drafter_namespace.encode()).digest()[:16]


class Index:
    """Helpers bound to one transaction and the environment's sub-databases."""

    def __init__(self, txn, dbs):
        self.txn = txn
        self.dbs = dbs

    # --- generic accessors -------------------------------------------------------------------------
    def get(self, db: str, key: bytes):
        """The decoded value under ``key`` (None if absent); a damaged value raises ``CorruptIndex``."""
        return decode(db, self.txn.get(key, db=self.dbs[db]), key)

    def put(self, db: str, key: bytes, value) -> None:
        self.txn.put(key, value if isinstance(value, (bytes, memoryview)) else pack(value), db=self.dbs[db])

    def delete(self, db: str, key: bytes) -> None:
        self.txn.delete(key, db=self.dbs[db])

    def raw(self, db: str, key: bytes):
        return self.txn.get(key, db=self.dbs[db])

    # --- totals and namespace counters -------------------------------------------------------------
    def totals(self) -> dict:
        return self.get("meta", TOTALS_KEY) or {"bytes": 0, "entries": 0}

    def add_totals(self, d_bytes: int, d_entries: int) -> None:
        t = self.totals()
        t["bytes"] += d_bytes
        t["entries"] += d_entries
        self.put("meta", TOTALS_KEY, t)

    def nsinfo(self, ns: bytes) -> dict | None:
        return self.get("nsinfo", ns)

    def add_ns(self, ns: bytes, *, d_bytes=0, d_entries=0, hits=0, misses=0, last_use=None) -> None:
        info = self.nsinfo(ns)
        if info is None:
            return
        info["bytes"] += d_bytes
        info["entries"] += d_entries
        info["hits"] += hits
        info["misses"] += misses
        if last_use is not None:
            info["last_use"] = max(info.get("last_use") or 0, last_use)
        self.put("nsinfo", ns, info)

    # --- nodes -------------------------------------------------------------------------------------
    def release_node(self, key: bytes) -> int:
        """Drop one reference to node ``key``; delete it (and cascade) at zero. Returns bytes freed."""
        freed = 0
        while key is not None:
            node = self.get("nodes", key)
            if node is None:
                return freed
            node["refs"] -= 1
            if node["refs"] > 0:
                self.put("nodes", key, node)
                return freed
            self.delete("nodes", key)
            if node["depth"] > 0:
                self.delete("chunks", key)
                freed += node["bytes"]
            else:
                self._forget_signature(node["ns"], node.get("sig", b""))
            key = node["parent"]
        return freed

    def _forget_signature(self, ns: bytes, sig: bytes) -> None:
        info = self.nsinfo(ns)
        if info is not None and sig in info["sigs"]:
            info["sigs"].remove(sig)
            self.put("nsinfo", ns, info)

    # --- entries -----------------------------------------------------------------------------------
    def delete_entry(self, key: bytes, entry: dict | None = None) -> int:
        """Remove an entry with its records, LRU row and node references; returns bytes freed."""
        entry = entry or self.get("entries", key)
        if entry is None:
            return 0
        freed = entry["bytes"]
        self.delete("edata", key)
        for dns in entry["drafters"]:
            self.delete("drafts", draft_key(key, dns))
        self.delete("lru", lru_key(entry["last_use"], key))
        self.delete("entries", key)
        node = self.get("nodes", entry["node"])
        if node is not None:
            tail = str(entry["tail"])
            node["tails"][tail] = node["tails"].get(tail, 1) - 1
            if node["tails"][tail] <= 0:
                del node["tails"][tail]
            self.put("nodes", entry["node"], node)
        chunk_bytes = self.release_node(entry["node"])
        freed_all = freed + chunk_bytes
        self.add_ns(entry["ns"], d_bytes=-freed_all, d_entries=-1)
        self.add_totals(-freed_all, -1)
        return freed_all

    def drop_drafter(self, key: bytes, entry: dict, drafter_namespace: str) -> int:
        nbytes = entry["drafters"].pop(drafter_namespace, None)
        if nbytes is None:
            return 0
        self.delete("drafts", draft_key(key, drafter_namespace))
        entry["bytes"] -= nbytes
        self.put("entries", key, entry)
        self.add_ns(entry["ns"], d_bytes=-nbytes)
        self.add_totals(-nbytes, 0)
        return nbytes

    def touch(self, key: bytes, when: int) -> None:
        entry = self.get("entries", key)
        if entry is None or entry["last_use"] >= when:
            return
        self.delete("lru", lru_key(entry["last_use"], key))
        entry["last_use"] = when
        self.put("lru", lru_key(when, key), b"")
        self.put("entries", key, entry)

    def lru_victims(self, exclude: set[bytes]):
        """Entry keys, least recently used first, skipping pinned ones and ``exclude``."""
        cursor = self.txn.cursor(db=self.dbs["lru"])
        for raw_key, _ in cursor:
            key = bytes(raw_key)[8:]
            if key in exclude:
                continue
            try:
                entry = self.get("entries", key)
            except CorruptIndex:  # a damaged entry is gc's to remove; evict around it
                continue
            if entry is None or entry.get("pinned"):
                continue
            yield key, entry

    def evict_to(self, max_bytes: int, exclude: set[bytes]) -> int:
        """Evict LRU entries until total bytes <= max_bytes; returns the number evicted."""
        evicted = 0
        while self.totals()["bytes"] > max_bytes:
            victim = next(self.lru_victims(exclude), None)
            if victim is None:
                break
            self.delete_entry(*victim)
            evicted += 1
        return evicted


def now_ns() -> int:
    return time.time_ns()


def u32(n: int) -> bytes:
    return struct.pack("<I", n)
