"""Continuation records: what a generation emitted so far, so that the same request resumes after a crash.

Why: a checkpoint holds the KV state of ``prompt + generated[:-1]``, but nothing maps a *request* to the tokens
it generated. A continuation record does: under a key over everything that determines the tokens, it keeps the
generated ids up to the newest checkpoint (``finished`` once the row ended). A retried request replays them and
its row continues from that checkpoint (``spec_cache.tiers.continuations``). The seed's ``generationCheckpointKey`` /
``ContinuationPersistence`` do the same.

Key (32 bytes; golden vector in tests/golden/continuations.json)::

    key = blake3("spec-cache/continuation/v1\\0" || ns_key(32) || u32 len(params) || params
                 || u64 len(prompt) || u32le prompt tokens)
    params = canonical JSON (sorted keys, no spaces) of {"eos": [sorted EOS ids] or null (EOS ignored),
             "sampling": "greedy" or {"seed": int, "temperature": float, "top_p": float}}
    (and "processors": {...} when a request has logits processors: they change greedy tokens too)

``ns_key`` is the prefix namespace key: target identity, drafter namespace, adapters, KV options and tenant, so a
record never crosses tenants or models. Greedy ignores seed and top_p (the engine does).

Record (value, version 1; all little-endian)::

    magic "SCCN" | u16 major=1 | u16 minor=0 | u32 flags (bit 0: finished) | key(32) | ns_key(32)
    | u64 written_ns | u32 prompt_tokens | u32 n | n x u32 tokens | blake3 of everything before (32)

Rows, in the store's ``memo`` sub-database (older code never reads them; no new sub-database, so the store
format stays 1.x): ``b"\\0cont\\0" + key`` -> record, and ``b"\\0cont-lru\\0" + u64be(written_ns) + key`` ->
u32 record bytes, and ``b"\0cont-sum\0"`` -> u64 records, u64 bytes (their sum, so a put reads one row, not every
LRU row). A record with a newer major version is skipped (a miss), never decoded.

Tenant rows (table minor 1; older code neither writes nor reads them): per record ``b"\0cont-tlru\0" + tenant(16) +
u64be(written_ns) + key`` -> u32 record bytes, and per tenant ``b"\0cont-tsum\0" + tenant(16)`` -> u64 records, u64
bytes. ``tenant`` is the store's tenant label of the record's namespace (``NamespaceInfo.tenant_id``; 16 zero bytes
for the default tenant and for namespaces not registered). A record written by older code has no tenant row until
``gc`` rebuilds them (``verify`` does not count that as a problem: it only loses the record its fair share).

Bounds: at most ``max_records`` records and ``max_bytes`` of them; a put over a bound evicts, in its own
transaction, the least recently written record of the tenant holding the largest part of a bound
(``max(records / max_records, bytes / max_bytes)``; ties by label), never the record just written, so one
tenant's requests evict its own records before another tenant's (as the prefix entries and the memory tier share
``max_bytes``); the least recently written record of any tenant only when no tenant row is left to choose by.
``verify`` checks every record (checksum, structure, the key it sits under, its
LRU row); ``gc`` drops corrupt records, records of namespaces no longer registered, and stray LRU rows.

Why one file: the record codec, its four row kinds (record, LRU, tenant LRU, sums) and the checks that ``verify``
and ``gc`` run over them are one on-disk table; a put, an eviction, the check and the rebuild must agree on every
row's layout, and keeping them side by side is what keeps them agreeing.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import dataclass
from typing import Sequence

import blake3

from .errors import CorruptRecord, InvalidInput, StoreError
from .eviction import over_bounds
from .index import Index
from .keys import KEY_BYTES, pack_tokens
from .values import TENANT_ID_BYTES

log = logging.getLogger("spec_cache.store")

KEY_DOMAIN = b"spec-cache/continuation/v1\x00"
CHECKSUM_DOMAIN = b"spec-cache/continuation-record/v1\x00"
MAGIC = b"SCCN"
MAJOR, MINOR = 1, 0
FINISHED = 1
_HEADER = struct.Struct("<4sHHI32s32sQII")
RECORD_PREFIX = b"\x00cont\x00"
LRU_PREFIX = b"\x00cont-lru\x00"
SUM_KEY = b"\x00cont-sum\x00"  # u64 records | u64 bytes: what the LRU rows add up to (a put reads one row)
TENANT_LRU_PREFIX = b"\x00cont-tlru\x00"  # + tenant(16) + u64be written_ns + key -> u32 record bytes
TENANT_SUM_PREFIX = b"\x00cont-tsum\x00"  # + tenant(16) -> u64 records | u64 bytes of that tenant's LRU rows
DEFAULT_TENANT_ROW = bytes(TENANT_ID_BYTES)  # the default tenant's (and an unregistered namespace's) label in rows
_SUM = struct.Struct("<QQ")
DB = "memo"
#: defaults: records kept, and their bytes
MAX_RECORDS = 4096
MAX_BYTES = 64 << 20


class NewerRecord(StoreError):
    """A continuation record of a newer major version: not ours to read (a miss, not damage)."""


def continuation_params(*, temperature: float, top_p: float, seed: int | None, eos_ids: Sequence[int] | None,
                        top_k: int = 0, min_p: float = 0.0, processors: dict | None = None) -> bytes:
    """The canonical parameter bytes of the key (module doc). ``eos_ids`` None: the request ignores EOS.
    ``top_k`` / ``min_p`` enter a sampled request's bytes only when set (> 0), so every key made before they
    existed stays what it was. ``processors`` (a JSON-able mapping: the request's logits processors, greedy or not)
    enters only when non-empty, likewise."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise InvalidInput(f"temperature must be a number >= 0, got {temperature!r}")
    if temperature == 0:
        sampling: object = "greedy"
    else:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidInput("a sampled continuation needs an explicit int seed")
        sampling = {"seed": int(seed), "temperature": float(temperature), "top_p": float(top_p)}
        if top_k:
            sampling["top_k"] = int(top_k)
        if min_p:
            sampling["min_p"] = float(min_p)
    eos = None if eos_ids is None else sorted({int(t) for t in eos_ids})
    params: dict = {"eos": eos, "sampling": sampling}
    if processors:
        params["processors"] = processors
    return json.dumps(params, sort_keys=True, separators=(",", ":")).encode("ascii")


def continuation_key(ns_key: bytes, prompt: Sequence[int], params: bytes) -> bytes:
    """The 32-byte key of a request (module doc)."""
    if len(ns_key) != KEY_BYTES:
        raise InvalidInput("namespace key must be 32 bytes")
    packed = pack_tokens(prompt)
    h = blake3.blake3(KEY_DOMAIN)
    h.update(bytes(ns_key))
    h.update(struct.pack("<I", len(params)))
    h.update(params)
    h.update(struct.pack("<Q", len(packed)))
    h.update(packed.tobytes())
    return h.digest()


@dataclass(frozen=True)
class Continuation:
    """A request's generated tokens so far (``finished``: the row ended there: length, EOS or stop)."""

    key: bytes
    ns_key: bytes
    prompt_tokens: int
    tokens: tuple[int, ...]
    finished: bool = False
    written_ns: int = 0


def encode_continuation(rec: Continuation) -> bytes:
    if len(rec.key) != KEY_BYTES or len(rec.ns_key) != KEY_BYTES:
        raise InvalidInput("continuation keys must be 32 bytes")
    body = _HEADER.pack(MAGIC, MAJOR, MINOR, FINISHED if rec.finished else 0, rec.key, rec.ns_key,
                        int(rec.written_ns), int(rec.prompt_tokens), len(rec.tokens))
    body += pack_tokens(list(rec.tokens)).tobytes()
    return body + blake3.blake3(CHECKSUM_DOMAIN + body).digest()


def decode_continuation(raw, key: bytes | None = None) -> Continuation:
    """Decode (and check) a record; ``CorruptRecord`` on any defect, ``NewerRecord`` for a newer major."""
    raw = bytes(raw)
    where = "" if key is None else f" {key.hex()[:16]}"
    if len(raw) < _HEADER.size + 32 or raw[:4] != MAGIC:
        raise CorruptRecord(f"continuation record{where}: not a continuation record", key)
    magic, major, minor, flags, rkey, ns_key, written, prompt_tokens, n = _HEADER.unpack_from(raw)
    if major > MAJOR:
        raise NewerRecord(f"continuation record{where}: version {major}.{minor} is newer than this code reads")
    if major != MAJOR:
        raise CorruptRecord(f"continuation record{where}: unknown version {major}.{minor}", key)
    if len(raw) != _HEADER.size + 4 * n + 32:
        raise CorruptRecord(f"continuation record{where}: {len(raw)} bytes, {n} tokens need "
                            f"{_HEADER.size + 4 * n + 32}", key)
    if blake3.blake3(CHECKSUM_DOMAIN + raw[:-32]).digest() != raw[-32:]:
        raise CorruptRecord(f"continuation record{where}: checksum mismatch", key)
    if flags & ~FINISHED:
        raise CorruptRecord(f"continuation record{where}: unknown flags {flags:#x}", key)
    if key is not None and rkey != key:
        raise CorruptRecord(f"continuation record{where}: stored under another key", key)
    tokens = struct.unpack_from(f"<{n}I", raw, _HEADER.size)
    return Continuation(rkey, ns_key, prompt_tokens, tuple(tokens), bool(flags & FINISHED), written)


def _record_row(key: bytes) -> bytes:
    return RECORD_PREFIX + key


def _lru_row(written_ns: int, key: bytes) -> bytes:
    return LRU_PREFIX + struct.pack(">Q", written_ns) + key


def _tenant_lru_row(tenant: bytes, written_ns: int, key: bytes) -> bytes:
    return TENANT_LRU_PREFIX + tenant + struct.pack(">Q", written_ns) + key


def _tenant_sum_row(tenant: bytes) -> bytes:
    return TENANT_SUM_PREFIX + tenant


def _label(tenant_id: bytes | None) -> bytes:
    """A namespace's tenant label as the tenant rows spell it (module doc)."""
    return bytes(tenant_id) if tenant_id and len(tenant_id) == TENANT_ID_BYTES else DEFAULT_TENANT_ROW


def _tenant_sums(txn, db) -> dict[bytes, list[int]]:
    """{tenant: [records, bytes]} from the tenant sum rows (damaged rows read as empty)."""
    out = {}
    for row, value in _rows(txn, db, TENANT_SUM_PREFIX):
        tenant = row[len(TENANT_SUM_PREFIX):]
        if len(tenant) == TENANT_ID_BYTES:
            out[tenant] = list(_SUM.unpack(bytes(value))) if len(value) == _SUM.size else [0, 0]
    return out


def _add_tenant(txn, db, sums: dict, tenant: bytes, d_records: int, d_bytes: int) -> None:
    """Move ``tenant``'s sum row by the deltas (a tenant at zero loses its row)."""
    have = sums.setdefault(tenant, [0, 0])
    have[0], have[1] = max(0, have[0] + d_records), max(0, have[1] + d_bytes)
    if have[0] == 0:
        txn.delete(_tenant_sum_row(tenant), db=db)
        sums.pop(tenant)
    else:
        txn.put(_tenant_sum_row(tenant), _SUM.pack(*have), db=db)


def _size(value) -> int:
    return struct.unpack("<I", bytes(value))[0] if len(value) == 4 else 0


def _sum(txn, db) -> tuple[int, int]:
    """(records, bytes) from the sum row; recounted from the LRU rows when it is missing or damaged."""
    raw = txn.get(SUM_KEY, db=db)
    if raw is not None and len(raw) == _SUM.size:
        return _SUM.unpack(bytes(raw))
    sizes = [_size(v) for _, v in _rows(txn, db, LRU_PREFIX)]
    return len(sizes), sum(sizes)


def _rows(txn, db, prefix: bytes):
    """(row key, value) of every row starting with ``prefix``, in key order."""
    cursor = txn.cursor(db=db)
    more = cursor.set_range(prefix)
    while more:
        row = bytes(cursor.key())
        if not row.startswith(prefix):
            return
        yield row, bytes(cursor.value())  # a copy: a buffer into the page goes stale once a row is deleted
        more = cursor.next()


class ContinuationTable:
    """Continuation records of one ``Store`` (module doc). Thread-safe as the store is."""

    def __init__(self, store, *, max_records: int = MAX_RECORDS, max_bytes: int = MAX_BYTES):
        if max_records < 1 or max_bytes < 1:
            raise InvalidInput("max_records and max_bytes must be >= 1")
        self.store = store
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._tenants: dict[bytes, bytes] = {}  # namespace key -> tenant label (a namespace's label never changes)

    @property
    def _db(self):
        return self.store.env.dbs[DB]

    def get(self, key: bytes) -> Continuation | None:
        """The record under ``key``, or None (absent, newer version, corrupt: a corrupt one is dropped, logged)."""
        with self.store.reading() as txn:
            raw = txn.get(_record_row(key), db=self._db)
            raw = None if raw is None else bytes(raw)
        if raw is None:
            return None
        try:
            return decode_continuation(raw, key)
        except NewerRecord as exc:
            log.info("spec-cache: %s; treated as a miss", exc)
            return None
        except CorruptRecord as exc:
            log.warning("spec-cache: dropping %s; treated as a miss", exc)
            self.drop(key)
            return None

    def put(self, rec: Continuation) -> int:
        """Write ``rec`` (replacing the record under its key) and evict the least recently written records past
        the bounds, in one transaction; returns how many were evicted. A record that does not lengthen the stored
        one (fewer tokens, or as many and not newly finished) is not written (a late write never goes back)."""
        if self.store.env.readonly:
            return 0
        with self.store._lock:
            return self.store.env.write(lambda txn: self.write_in(txn, rec))

    def write_in(self, txn, rec: Continuation) -> int:
        """``put``'s rows inside ``txn``, a write transaction of this store (the checkpoint's own, as its rider:
        ``Store.put(rider=...)``, so the record and the state it names share one commit)."""
        rec = Continuation(rec.key, rec.ns_key, rec.prompt_tokens, tuple(int(t) for t in rec.tokens), rec.finished,
                           rec.written_ns or time.time_ns())
        value = encode_continuation(rec)
        if len(value) > self.max_bytes:
            raise InvalidInput(f"continuation record of {len(value)} bytes exceeds max_bytes {self.max_bytes}")

        db = self._db
        tenant = self._tenant(txn, rec.ns_key)
        sums = _tenant_sums(txn, db)
        old = txn.get(_record_row(rec.key), db=db)
        count, total = _sum(txn, db)
        if old is not None:
            try:
                prev = decode_continuation(old, rec.key)
            except StoreError:
                prev = None
            if prev is not None and (len(prev.tokens), prev.finished) >= (len(rec.tokens), rec.finished):
                return 0
            if prev is not None and txn.delete(_lru_row(prev.written_ns, rec.key), db=db):
                count, total = count - 1, total - len(old)
            if prev is not None and txn.delete(_tenant_lru_row(tenant, prev.written_ns, rec.key), db=db):
                _add_tenant(txn, db, sums, tenant, -1, -len(old))
        txn.put(_record_row(rec.key), value, db=db)
        txn.put(_lru_row(rec.written_ns, rec.key), struct.pack("<I", len(value)), db=db)
        txn.put(_tenant_lru_row(tenant, rec.written_ns, rec.key), struct.pack("<I", len(value)), db=db)
        _add_tenant(txn, db, sums, tenant, 1, len(value))
        return self._evict(txn, db, count + 1, total + len(value), sums, rec.key)

    def _tenant(self, txn, ns_key: bytes) -> bytes:
        """The tenant label (as rows spell it) of namespace ``ns_key``, read in ``txn`` once per namespace."""
        tenant = self._tenants.get(ns_key)
        if tenant is None:
            try:
                info = Index(txn, self.store.env.dbs).namespace(ns_key)
            except StoreError:  # a damaged namespace row: the default tenant's until gc rebuilds it
                info = None
            tenant = _label(None if info is None else info.tenant_id)
            if info is not None:
                if len(self._tenants) >= 4096:
                    self._tenants.clear()
                self._tenants[ns_key] = tenant
        return tenant

    def _evict(self, txn, db, count: int, total: int, sums: dict, keep: bytes) -> int:
        """While over a bound, drop the least recently written record of the tenant holding the largest part of
        a bound (never ``keep``, the record just written); write the new sums."""
        evicted, exhausted = 0, set()
        while over_bounds(count, total, max_records=self.max_records, max_bytes=self.max_bytes):
            victim = self._tenant_victim(txn, db, sums, exhausted, keep)
            if victim is None:  # no tenant row to choose by (records of older code): plain LRU
                victim = next(((row[-KEY_BYTES:], _size(v)) for row, v in _rows(txn, db, LRU_PREFIX)
                               if row[-KEY_BYTES:] != keep), None)
            if victim is None:
                break
            key, size = victim
            freed = self._remove(txn, db, key, sums)
            count, total, evicted = count - 1, total - (freed if freed is not None else size), evicted + 1
        txn.put(SUM_KEY, _SUM.pack(max(0, count), max(0, total)), db=db)
        return evicted

    def _tenant_victim(self, txn, db, sums: dict, exhausted: set, keep: bytes) -> tuple[bytes, int] | None:
        """(key, bytes) of the oldest record of the tenant with the largest part of a bound, or None."""
        while True:
            live = [(max(n / self.max_records, b / self.max_bytes), t) for t, (n, b) in sums.items()
                    if n > 0 and t not in exhausted]
            if not live:
                return None
            tenant = max(live)[1]
            for row, value in _rows(txn, db, TENANT_LRU_PREFIX + tenant):
                key = row[-KEY_BYTES:]
                if key == keep:
                    continue
                if txn.get(_record_row(key), db=db) is None:  # a row older code left behind: tidy it
                    txn.delete(row, db=db)
                    _add_tenant(txn, db, sums, tenant, -1, -_size(value))
                    continue
                return key, _size(value)
            exhausted.add(tenant)

    def _remove(self, txn, db, key: bytes, sums: dict) -> int | None:
        """Delete the record under ``key`` with its LRU and tenant rows; the record's bytes (None: it was gone).
        The rows are found from the record (its time and namespace); a record that does not decode has its rows
        looked for by key."""
        raw = txn.get(_record_row(key), db=db)
        raw = None if raw is None else bytes(raw)
        try:
            rec = None if raw is None else decode_continuation(raw, key)
        except StoreError:
            rec = None
        if rec is not None and txn.delete(_lru_row(rec.written_ns, key), db=db):
            tenant = self._tenant(txn, rec.ns_key)
            row = _tenant_lru_row(tenant, rec.written_ns, key)
            value = txn.get(row, db=db)
            if value is not None:
                size = _size(value)  # read before the delete: the value may be a buffer into the page
                txn.delete(row, db=db)
                _add_tenant(txn, db, sums, tenant, -1, -size)
        else:
            for prefix in (LRU_PREFIX, TENANT_LRU_PREFIX):
                for row, value in list(_rows(txn, db, prefix)):
                    if row.endswith(key):
                        txn.delete(row, db=db)
                        if prefix == TENANT_LRU_PREFIX:
                            _add_tenant(txn, db, sums, row[len(prefix):len(prefix) + TENANT_ID_BYTES], -1,
                                        -_size(value))
        if raw is None:
            return None
        txn.delete(_record_row(key), db=db)
        return len(raw)

    def drop(self, key: bytes) -> bool:
        """Remove the record under ``key`` (and its LRU row); False if there was none or the store is read-only."""
        if self.store.env.readonly:
            return False

        def fn(txn) -> bool:
            db = self._db
            count, total = _sum(txn, db)
            for row, value in list(_rows(txn, db, LRU_PREFIX)):
                if row.endswith(key):
                    count, total = count - 1, total - _size(value)
            found = self._remove(txn, db, key, _tenant_sums(txn, db)) is not None
            txn.put(SUM_KEY, _SUM.pack(max(0, count), max(0, total)), db=db)
            return found
        try:
            with self.store._lock:
                return self.store.env.write(fn, making_room=True)
        except StoreError as exc:
            log.warning("spec-cache: continuation record %s not dropped: %s", key.hex()[:16], exc)
            return False

    def records(self) -> list[Continuation]:
        """Every readable record (corrupt and newer ones left out), least recently written first."""
        out = []
        with self.store.reading() as txn:
            for row, raw in _rows(txn, self._db, RECORD_PREFIX):
                try:
                    out.append(decode_continuation(raw, row[len(RECORD_PREFIX):]))
                except StoreError:
                    continue
        return sorted(out, key=lambda r: r.written_ns)


@dataclass
class ContinuationCheck:
    """What ``check`` found: records read, readable ones, corrupt ones (``{"key", "error"}``), newer-version
    ones, and bookkeeping problems (LRU rows that disagree with the records)."""

    records: int = 0
    ok: int = 0
    newer: int = 0
    corrupt: list | None = None
    problems: list | None = None


def check(txn, dbs) -> ContinuationCheck:
    """Every continuation record and LRU row checked (``verify``); changes nothing."""
    found = ContinuationCheck(corrupt=[], problems=[])
    db = dbs[DB]
    expected, owners = {}, {}
    for row, raw in _rows(txn, db, RECORD_PREFIX):
        key = row[len(RECORD_PREFIX):]
        found.records += 1
        try:
            rec = decode_continuation(raw, key if len(key) == KEY_BYTES else None)
        except NewerRecord:
            found.newer += 1
            continue
        except CorruptRecord as exc:
            found.corrupt.append({"db": "continuations", "what": "continuation record", "key": key.hex(),
                                  "error": str(exc)})
            continue
        found.ok += 1
        expected[_lru_row(rec.written_ns, key)] = len(bytes(raw))
        owners[_lru_row(rec.written_ns, key)] = rec.ns_key
    lru = {row: bytes(v) for row, v in _rows(txn, db, LRU_PREFIX)}
    corrupt_keys = {bytes.fromhex(c["key"]) for c in found.corrupt}
    for row, value in lru.items():
        if row not in expected and row[-KEY_BYTES:] not in corrupt_keys:
            found.problems.append(f"continuation LRU row {row[-KEY_BYTES:].hex()[:16]} without its record")
        elif row in expected and value != struct.pack("<I", expected[row]):
            found.problems.append(f"continuation LRU row {row[-KEY_BYTES:].hex()[:16]}: wrong size")
    missing = len(expected.keys() - lru.keys())
    if missing:
        found.problems.append(f"{missing} continuation records without their LRU row")
    raw = txn.get(SUM_KEY, db=db)
    want = (len(lru), sum(_size(v) for v in lru.values()))
    if raw is None and lru or raw is not None and (len(raw) != _SUM.size or _SUM.unpack(bytes(raw)) != want):
        found.problems.append(f"continuation sum row disagrees with the LRU rows ({want[0]} records, {want[1]} bytes)")
    _check_tenant_rows(txn, dbs, db, expected, owners, corrupt_keys, found.problems)
    return found


def namespaces_with_records(txn, dbs) -> set[bytes]:
    """The namespace keys some continuation record names (read from the record's fixed header, no checksum: a
    damaged record still holds its namespace back). ``Store.forget_empty_namespaces`` keeps those rows."""
    found = set()
    start = len(MAGIC) + 8 + KEY_BYTES  # magic | u16 major | u16 minor | u32 flags | key
    for _, raw in _rows(txn, dbs[DB], RECORD_PREFIX):
        if len(raw) >= start + KEY_BYTES:
            found.add(raw[start:start + KEY_BYTES])
    return found


def _ns_tenants(txn, dbs):
    """A function: namespace key -> its tenant label as rows spell it (memoised; damaged rows: the default)."""
    index, seen = Index(txn, dbs), {}

    def tenant_of(ns: bytes) -> bytes:
        if ns not in seen:
            try:
                info = index.namespace(ns)
            except StoreError:
                info = None
            seen[ns] = _label(None if info is None else info.tenant_id)
        return seen[ns]
    return tenant_of


def _check_tenant_rows(txn, dbs, db, expected: dict, owners: dict, corrupt_keys: set, problems: list) -> None:
    """Each tenant row names a record under its tenant with its size; each tenant sum row adds its rows up.
    (A record without a tenant row is older code's: not a problem, module doc.)"""
    tenant_of = _ns_tenants(txn, dbs)
    sums: dict[bytes, list[int]] = {}
    for row, value in _rows(txn, db, TENANT_LRU_PREFIX):
        body = row[len(TENANT_LRU_PREFIX):]
        tenant, key = body[:TENANT_ID_BYTES], body[-KEY_BYTES:]
        if len(body) != TENANT_ID_BYTES + 8 + KEY_BYTES:
            problems.append("continuation tenant row of the wrong length")
            continue
        have = sums.setdefault(tenant, [0, 0])
        have[0], have[1] = have[0] + 1, have[1] + _size(value)
        lru = _lru_row(struct.unpack(">Q", body[TENANT_ID_BYTES:TENANT_ID_BYTES + 8])[0], key)
        if key in corrupt_keys:
            continue
        if lru not in expected:
            problems.append(f"continuation tenant row {key.hex()[:16]} without its record")
        elif tenant_of(owners[lru]) != tenant or bytes(value) != struct.pack("<I", expected[lru]):
            problems.append(f"continuation tenant row {key.hex()[:16]}: wrong tenant or size")
    stored = {t: tuple(v) for t, v in _tenant_sums(txn, db).items()}
    if stored != {t: tuple(v) for t, v in sums.items()}:
        problems.append("continuation tenant sum rows disagree with the tenant rows")


def rebuild(txn, dbs, namespaces) -> tuple[int, int]:
    """``gc``'s part: drop corrupt records and records whose namespace is not in ``namespaces`` (a set of
    namespace keys), then rewrite the LRU, tenant and sum rows from the records left (a record of older code gets
    its tenant row here); returns (corrupt, orphaned) removed."""
    db = dbs[DB]
    keep: dict[bytes, int] = {}
    tenant_keep: dict[bytes, int] = {}
    tenant_of = _ns_tenants(txn, dbs)
    doomed, corrupt = [], 0
    for row, raw in _rows(txn, db, RECORD_PREFIX):
        key = row[len(RECORD_PREFIX):]
        try:
            rec = decode_continuation(raw, key if len(key) == KEY_BYTES else None)
        except NewerRecord:
            continue  # not ours to judge
        except CorruptRecord:
            doomed.append(row)
            corrupt += 1
            continue
        if rec.ns_key not in namespaces:
            doomed.append(row)
            continue
        keep[_lru_row(rec.written_ns, key)] = len(bytes(raw))
        tenant_keep[_tenant_lru_row(tenant_of(rec.ns_key), rec.written_ns, key)] = len(bytes(raw))
    for row in doomed:
        txn.delete(row, db=db)
    for prefix, rows in ((LRU_PREFIX, keep), (TENANT_LRU_PREFIX, tenant_keep)):
        for row, value in list(_rows(txn, db, prefix)):
            if rows.get(row) is None or bytes(value) != struct.pack("<I", rows[row]):
                txn.delete(row, db=db)
        for row, size in rows.items():
            txn.put(row, struct.pack("<I", size), db=db)
    if keep or txn.get(SUM_KEY, db=db) is not None:
        txn.put(SUM_KEY, _SUM.pack(len(keep), sum(keep.values())), db=db)
    for row, _ in list(_rows(txn, db, TENANT_SUM_PREFIX)):
        txn.delete(row, db=db)
    sums: dict[bytes, list[int]] = {}
    for row, size in tenant_keep.items():
        have = sums.setdefault(row[len(TENANT_LRU_PREFIX):len(TENANT_LRU_PREFIX) + TENANT_ID_BYTES], [0, 0])
        have[0], have[1] = have[0] + 1, have[1] + size
    for tenant, (n, b) in sums.items():
        txn.put(_tenant_sum_row(tenant), _SUM.pack(n, b), db=db)
    return corrupt, len(doomed) - corrupt
