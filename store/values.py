"""The index's values, typed: ``Node``, ``Entry``, ``NamespaceInfo``, ``Totals``, and what each must look like.

On disk every index value is a small msgpack map with short keys and no checksum of its own (the format is
fixed: a store written by any 1.x version opens and serves). In code it is a slots dataclass: ``from_dict``
and ``to_dict`` are the only places that know the short keys, and ``to_dict`` writes them in the order the
store always wrote them, so a record packs to exactly the bytes it had (``tests/store/test_store.py`` holds golden
bytes). Fields a newer minor version may add are kept in ``extra`` and written back unchanged.

A damaged value must become a typed ``CorruptIndex`` (a miss, removed by ``gc``), never a ``KeyError`` from
deep inside a lookup nor a wrong answer: ``decode`` shape-checks every field (present, right type, in range)
before a record is built. Cost: about a microsecond per value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from .errors import CorruptIndex

__all__ = ["Node", "Entry", "NamespaceInfo", "Totals", "TOTALS_KEY", "TENANT_MINOR", "TENANT_ID_BYTES", "tenant_key",
           "pack", "unpack", "decode", "node_ok", "entry_ok", "nsinfo_ok", "totals_ok"]

TOTALS_KEY = b"totals"  # key of the store-wide ``Totals`` in the ``meta`` sub-database
TENANT_MINOR = 1  # store format 1.1: namespace rows may carry a tenant label (``tid``); 1.0 stores have none
TENANT_ID_BYTES = 16  # a tenant label: blake3 derive-key of the tenant (``keys.tenant_id``)
TENANT_KEY_PREFIX = b"tenant/"  # meta: ``Totals`` of one labelled tenant under ``tenant/`` + its 16-byte label


def tenant_key(tenant_id: bytes) -> bytes:
    """Key of a labelled tenant's ``Totals`` in ``meta`` (format 1.1; the default tenant has no row)."""
    return TENANT_KEY_PREFIX + tenant_id


def is_tenant_key(key) -> bool:
    return key is not None and len(key) == len(TENANT_KEY_PREFIX) + TENANT_ID_BYTES \
        and bytes(key).startswith(TENANT_KEY_PREFIX)


def pack(obj) -> bytes:
    """msgpack-encode an index value (a typed record or a plain dict) the way the store always has."""
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    return msgpack.packb(obj, use_bin_type=True)


@dataclass(slots=True)
class Node:
    """One node of a chain: a namespace's root (depth 0, one per layer signature) or a full chunk of tokens.

    On disk: ``{ns, parent, depth, refs, tails, bytes, complete, minr, sig[, broken]}``.
    """

    namespace: bytes           # ns: the 32-byte namespace key the chain belongs to
    parent: bytes | None       # parent: key of the node one chunk shorter; None for a root
    depth: int                 # depth: full chunks from the root (0 = the root, which holds no record)
    refs: int                  # refs: child nodes plus entries hanging off this node (0 = the node goes)
    tails: dict[str, int]      # tails: tail length (decimal string) -> entries hanging off with that tail
    chunk_bytes: int           # bytes: size of this node's chunk record (0 for a root)
    complete: bool             # complete: every checkpoint through this chunk had all layers chunked
    minimum_reusable: int      # minr: the largest minimum-reusable offset of the checkpoints through it
    signature: bytes = b""     # sig: a root's layer signature (b"" for chunk nodes)
    broken: bool = False       # broken: its chunk record was found corrupt and dropped; gc removes the subtree
    extra: dict = field(default_factory=dict)  # fields of a newer minor format, written back as they were

    @classmethod
    def from_dict(cls, v: dict) -> "Node":
        extra = {k: x for k, x in v.items() if k not in _NODE_KEYS} if len(v) > len(_NODE_KEYS) - 1 else {}
        return cls(v["ns"], v["parent"], v["depth"], v["refs"], v["tails"], v["bytes"], v["complete"], v["minr"],
                   v.get("sig", b""), v.get("broken", False), extra)

    def to_dict(self) -> dict:
        d = {"ns": self.namespace, "parent": self.parent, "depth": self.depth, "refs": self.refs,
             "tails": self.tails, "bytes": self.chunk_bytes, "complete": self.complete,
             "minr": self.minimum_reusable, "sig": self.signature}
        if self.broken:
            d["broken"] = True
        d.update(self.extra)
        return d

    def tail_lengths(self) -> list[int]:
        """Tail lengths of the entries hanging off this node, longest first."""
        return sorted((int(t) for t in self.tails), reverse=True)


_NODE_KEYS = frozenset(("ns", "parent", "depth", "refs", "tails", "bytes", "complete", "minr", "sig", "broken"))


@dataclass(slots=True)
class Entry:
    """An exact-boundary checkpoint: ``length`` tokens, hanging off the node of its last full chunk.

    On disk: ``{ns, len, node, tail, last_use, created, pinned, bytes, drafters, minr}``.
    """

    namespace: bytes           # ns: the 32-byte namespace key
    length: int                # len: tokens the checkpoint covers (>= 1)
    node: bytes                # node: key of the node it hangs off (its last full chunk, or the root)
    tail: int                  # tail: tokens past that node, held in the entry record (length - depth * chunk)
    last_use: int              # last_use: ns since the epoch of the last put or hit (the LRU row's key)
    created: int               # created: ns since the epoch of the put that first wrote it
    pinned: bool               # pinned: never evicted by the byte budget
    entry_bytes: int           # bytes: entry record plus drafter records (chunks are counted on their nodes)
    drafters: dict[str, int]   # drafters: drafter namespace -> size of its drafter record
    minimum_reusable: int      # minr: shortest prefix of it a restore may use (<= length)
    extra: dict = field(default_factory=dict)  # fields of a newer minor format, written back as they were

    @classmethod
    def from_dict(cls, v: dict) -> "Entry":
        extra = {k: x for k, x in v.items() if k not in _ENTRY_KEYS} if len(v) > len(_ENTRY_KEYS) else {}
        return cls(v["ns"], v["len"], v["node"], v["tail"], v["last_use"], v["created"], v["pinned"], v["bytes"],
                   v["drafters"], v["minr"], extra)

    def to_dict(self) -> dict:
        d = {"ns": self.namespace, "len": self.length, "node": self.node, "tail": self.tail,
             "last_use": self.last_use, "created": self.created, "pinned": self.pinned, "bytes": self.entry_bytes,
             "drafters": self.drafters, "minr": self.minimum_reusable}
        d.update(self.extra)
        return d


_ENTRY_KEYS = frozenset(("ns", "len", "node", "tail", "last_use", "created", "pinned", "bytes", "drafters",
                         "minr"))


@dataclass(slots=True)
class NamespaceInfo:
    """What a namespace key stands for, its counters and the layer signatures its chains start from.

    On disk: ``{target, prefix, tenant, created, entries, bytes, hits, misses, last_use, sigs[, tid][, rebuilt]}``.
    ``tid`` (format 1.1, ``TENANT_MINOR``): the tenant label, 16 bytes (``keys.tenant_id`` of the tenant, never
    the tenant string itself); absent = the default tenant (every namespace of a 1.0 store).
    """

    target: str                # target: the target identity the key was made from
    prefix_namespace: str      # prefix: the prefix namespace (method, adapters, options)
    tenant: bool               # tenant: the key was salted with a tenant
    created: int               # created: ns since the epoch of the registration
    entries: int               # entries: entries of this namespace
    bytes: int                 # bytes: their entry records, drafter records and chunk records
    hits: int                  # hits: lookups served (batched: flushed every 64 or every second)
    misses: int                # misses: lookups not served
    last_use: int | None       # last_use: ns since the epoch of the last hit or put; None before the first
    signatures: list[bytes]    # sigs: layer signatures of the chains (one root node each); lookups walk these
    rebuilt: bool = False      # rebuilt: gc rebuilt a damaged row; the next register_namespace fills it in again
    tenant_id: bytes | None = None  # tid: the tenant label (16 bytes) quotas count bytes by; None = default tenant
    extra: dict = field(default_factory=dict)  # fields of a newer minor format, written back as they were

    @classmethod
    def from_dict(cls, v: dict) -> "NamespaceInfo":
        extra = {k: x for k, x in v.items() if k not in _NSINFO_KEYS} if len(v) > _NSINFO_REQUIRED else {}
        return cls(v["target"], v["prefix"], v["tenant"], v["created"], v["entries"], v["bytes"], v["hits"],
                   v["misses"], v.get("last_use"), v["sigs"], bool(v.get("rebuilt", False)), v.get("tid"), extra)

    def to_dict(self) -> dict:
        d = {"target": self.target, "prefix": self.prefix_namespace, "tenant": self.tenant, "created": self.created,
             "entries": self.entries, "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
             "last_use": self.last_use, "sigs": self.signatures}
        if self.tenant_id is not None:
            d["tid"] = self.tenant_id
        if self.rebuilt:
            d["rebuilt"] = True
        d.update(self.extra)
        return d


_NSINFO_KEYS = frozenset(("target", "prefix", "tenant", "created", "entries", "bytes", "hits", "misses",
                          "last_use", "sigs", "rebuilt", "tid"))
_NSINFO_REQUIRED = 10  # keys every namespace row has (``rebuilt`` and ``tid`` are optional)


@dataclass(slots=True)
class Totals:
    """Store-wide counters under ``TOTALS_KEY`` in ``meta``: what the byte budget is checked against. The same
    shape, under ``tenant_key(label)``, counts one labelled tenant's namespaces (format 1.1)."""

    bytes: int = 0             # bytes: every stored record (chunks, entries, drafter parts)
    entries: int = 0           # entries: entries in the store

    @classmethod
    def from_dict(cls, v: dict) -> "Totals":
        return cls(v["bytes"], v["entries"])

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "entries": self.entries}


# --- decoding and shape checks ----------------------------------------------------------------------

def unpack(raw, db: str | None = None, key: bytes | None = None):
    """msgpack-decode an index value (None stays None); undecodable bytes raise ``CorruptIndex``."""
    if raw is None:
        return None
    try:
        return msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises ValueError, ExtraData, UnicodeDecodeError, TypeError...
        raise CorruptIndex(f"{db or 'index'} value{_at(key)} is not valid msgpack ({type(exc).__name__}); "
                           f"the store is damaged: run 'spec-cache gc'", db, key) from None


def decode(db: str, raw, key: bytes | None = None):
    """Decode and shape-check a value of sub-database ``db`` as a plain dict; raises ``CorruptIndex``."""
    value = unpack(raw, db, key)
    if value is None:
        return None
    check = _CHECKS.get(db)
    if db == "meta" and key != TOTALS_KEY and not is_tenant_key(key):
        check = None
    if check is not None and not check(value):
        raise CorruptIndex(f"{db} value{_at(key)} is malformed; the store is damaged: run 'spec-cache gc'",
                           db, key)
    return value


def decode_typed(db: str, raw, key: bytes | None = None):
    """Decode, shape-check and type a value of ``nodes``/``entries``/``nsinfo``/``meta`` totals (None if absent)."""
    value = decode(db, raw, key)
    return None if value is None else _TYPES[db].from_dict(value)


def _at(key) -> str:
    return f" under {bytes(key).hex()[:16]}" if key is not None else ""


def _int(x) -> bool:
    return type(x) is int


def _nonneg(x) -> bool:
    return type(x) is int and x >= 0


def _key32(x) -> bool:
    return type(x) is bytes and len(x) == 32


def _counts(d) -> bool:
    return type(d) is dict and all(type(k) is str and _nonneg(v) for k, v in d.items())


def _tails(d) -> bool:
    return _counts(d) and all(k.isascii() and k.isdigit() for k in d)


def node_ok(v) -> bool:
    return (type(v) is dict and _key32(v.get("ns")) and _nonneg(v.get("depth")) and _int(v.get("refs"))
            and (v.get("parent") is None if v["depth"] == 0 else _key32(v.get("parent")))
            and _tails(v.get("tails")) and _nonneg(v.get("bytes")) and type(v.get("complete")) is bool
            and _nonneg(v.get("minr")) and type(v.get("sig", b"")) is bytes
            and type(v.get("broken", False)) is bool)


def entry_ok(v) -> bool:
    return (type(v) is dict and _key32(v.get("ns")) and _nonneg(v.get("len")) and v["len"] >= 1
            and _key32(v.get("node")) and _nonneg(v.get("tail")) and v["tail"] <= v["len"]
            and _int(v.get("last_use")) and _int(v.get("created")) and type(v.get("pinned")) is bool
            and _nonneg(v.get("bytes")) and _counts(v.get("drafters")) and _nonneg(v.get("minr"))
            and v["minr"] <= v["len"])


def nsinfo_ok(v) -> bool:
    return (type(v) is dict and type(v.get("target")) is str and type(v.get("prefix")) is str
            and type(v.get("tenant")) is bool and _int(v.get("created")) and _int(v.get("entries"))
            and _int(v.get("bytes")) and _int(v.get("hits")) and _int(v.get("misses"))
            and (v.get("last_use") is None or _int(v.get("last_use")))
            and type(v.get("sigs")) is list and all(type(s) is bytes for s in v["sigs"])
            and (v.get("tid") is None or (type(v["tid"]) is bytes and len(v["tid"]) == TENANT_ID_BYTES)))


def totals_ok(v) -> bool:
    return type(v) is dict and _int(v.get("bytes")) and _int(v.get("entries"))


_CHECKS = {"nodes": node_ok, "entries": entry_ok, "nsinfo": nsinfo_ok, "meta": totals_ok}
_TYPES = {"nodes": Node, "entries": Entry, "nsinfo": NamespaceInfo, "meta": Totals}
