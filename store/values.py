"""What each index value must look like, checked on every decode.

Index values (nodes, entries, namespace info, totals) are small msgpack maps without a checksum of their own;
a damaged one must become a typed ``CorruptIndex`` (a miss, removed by ``gc``), never a ``KeyError`` from deep
inside a lookup nor a wrong answer. These checks are shape checks: every field present with its type and
range, so the code that reads a value can index it freely. Cost: about a microsecond per value.
"""

from __future__ import annotations

import msgpack

from .errors import CorruptIndex

TOTALS_KEY = b"totals"


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
    """Decode and shape-check a value of sub-database ``db``; raises ``CorruptIndex``."""
    value = unpack(raw, db, key)
    if value is None:
        return None
    check = _CHECKS.get(db)
    if db == "meta" and key != TOTALS_KEY:
        check = None
    if check is not None and not check(value):
        raise CorruptIndex(f"{db} value{_at(key)} is malformed; the store is damaged: run 'spec-cache gc'",
                           db, key)
    return value


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
            and type(v.get("sigs")) is list and all(type(s) is bytes for s in v["sigs"]))


def totals_ok(v) -> bool:
    return type(v) is dict and _int(v.get("bytes")) and _int(v.get("entries"))


_CHECKS = {"nodes": node_ok, "entries": entry_ok, "nsinfo": nsinfo_ok, "meta": totals_ok}
