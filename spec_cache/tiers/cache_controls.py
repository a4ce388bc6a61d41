"""Cache controls: pin / unpin a stored prefix for a while, prefetch it into the memory tier, export / import it
as an mlx-lm prompt-cache file. ``SpecCache.pin`` etc. are thin calls into here; ``serve`` exposes them as
``/v1/cache/...`` (``server/cache_routes.py``).

Why pins are leases held by this process (not the store's persisted ``pinned`` flag): a pin has a TTL, and a
TTL needs a clock that someone watches. Here the memory tier's entry carries the pin's end (``pin_until``) and
the store holds a lease on the LMDB entry (``store.leases``); both end by themselves when the TTL passes, on
unpin, or when the process ends. So a pin protects a prefix from eviction while this process serves it and can
never leak: after a restart nothing is pinned (the prefix itself stays stored until evicted; pin it again).

A pin names the longest stored prefix of the given tokens. Pinning it: the prefix is restored through the tiers
(that also puts it into the memory tier), an LMDB entry for exactly those tokens is made if there was none (a
prefix served from a longer entry's chunks would otherwise go with that entry), the LMDB entry gets a lease and
the memory entry of exactly those tokens is pinned until the TTL: where only a longer entry served the prefix (by
trimming), one is made from a copy of the prefix's arrays (never the longer entry pinned, nor views of its
buffers, which would keep all of it alive). So a pin's bytes are the bytes of the memory entry it pins (the K/V of
exactly the pinned tokens, also when the memory tier holds none), what it keeps from eviction;
they count against the owner's ``quota_bytes`` and all pins against ``total_quota_bytes`` (the server derives
both from its tiers and tenants: ``cache_routes.quotas``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from spec_cache.errors import InvalidRequest
from spec_cache.tiers.prefix_files import BadPrefixFile, check_fits, is_array, read_prefix_file, token_ids

__all__ = ["Pin", "Resident", "NotStored", "PinQuotaExceeded", "BadPrefixFile", "pin", "unpin", "pins",
           "prefetch", "import_prefix"]


class NotStored(InvalidRequest):
    """No stored prefix of the given tokens (or no such pin) in this namespace."""


class PinQuotaExceeded(InvalidRequest):
    """The pin would hold more bytes than its owner may pin."""


@dataclass
class Pin:
    """One pin: ``length`` tokens of ``ns_key`` held until ``until`` (``time.monotonic()``)."""

    pin_id: str
    ns_key: bytes
    tokens: tuple[int, ...]      # the pinned prefix
    owner: Any                   # whom it counts against (the server's tenant; None: the default tenant)
    until: float
    expires_at: float            # the same end as a Unix time (for clients)
    nbytes: int                  # bytes of the memory entry it pins (no such entry: the K/V of its tokens)
    memory_tokens: bytes | None  # that entry's tokens (uint32 bytes: ``tokens``); None when the tier holds none
    store_key: bytes | None      # the LMDB entry leased
    tier: str                    # where the prefix came from when pinned: memory, local or shared

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Resident:
    """What ``prefetch`` left in the memory tier: ``length`` tokens restored from ``tier`` (None: nothing)."""

    length: int
    tier: str | None
    resident: bool               # the memory tier holds an entry serving all ``length`` tokens


class _Table:
    """The pins of one cache (thread-safe); expired pins drop on read."""

    def __init__(self) -> None:
        self.pins: dict[str, Pin] = {}
        self.lock = threading.Lock()

    def live(self) -> list[Pin]:
        now = time.monotonic()
        with self.lock:
            for pin_id in [k for k, p in self.pins.items() if p.until <= now]:
                del self.pins[pin_id]
            return list(self.pins.values())


_TABLE_LOCK = threading.Lock()
#: pins one owner may hold at once (bytes bound them too; this bounds the table when the memory tier is off)
MAX_PINS = 1024


def _table(cache) -> _Table:
    table = cache.__dict__.get("_pins")
    if table is None:
        with _TABLE_LOCK:
            table = cache.__dict__.setdefault("_pins", _Table())
    return table


def pin_id(ns_key: bytes, tokens: Sequence[int]) -> str:
    """A pin's id: the same prefix in the same namespace is the same pin (pinning again sets its TTL)."""
    return hashlib.sha256(bytes(ns_key) + np.asarray(tokens, dtype=np.uint32).tobytes()).hexdigest()[:24]


def prefetch(cache, ns_key: bytes, tokens: Sequence[int], *, drafter_namespace: str | None = None,
             usable: Callable[[Any], bool] | None = None) -> Resident:
    """Restore the longest usable stored prefix of ``tokens`` now (memory, LMDB or the shared tier), which leaves
    it in the memory tier for the next request. Inside ``SpecCache.shared_via_prefetch()`` (the server's scheduler
    thread) the shared tier's part is what ``prefetch_shared`` fetched before (``serve`` calls it off the thread)."""
    resident, _ = _restore(cache, ns_key, tokens, drafter_namespace, usable)
    return resident


def _restore(cache, ns_key, tokens, drafter_namespace, usable):
    tokens = [int(t) for t in tokens]
    restored = cache.restore(ns_key, tokens, drafter_namespace=drafter_namespace, usable=usable)
    if restored is None:
        return Resident(0, None, False), None
    held = cache.memory.serving(ns_key, tokens[:restored.length])
    return Resident(restored.length, restored.tier, held is not None), restored


def pin(cache, ns_key: bytes, tokens: Sequence[int], ttl_s: float, *, owner: Any = None,
        quota_bytes: int | None = None, total_quota_bytes: int | None = None, drafter_namespace: str | None = None,
        usable: Callable[[Any], bool] | None = None, granularity: int = 1) -> Pin:
    """Pin the longest stored prefix of ``tokens`` for ``ttl_s`` seconds (see the module doc). Raises
    ``NotStored`` when nothing is stored, ``PinQuotaExceeded`` when ``owner``'s pins would hold more than
    ``quota_bytes`` or all pins more than ``total_quota_bytes``.

    ``granularity``: the pin covers the stored prefix cut down to a multiple of it (none that long: ``NotStored``,
    the answer for nothing stored). Why: a server that reports ``cached_tokens`` rounded must not tell more
    through a pin, and a pin of the exact length would (its id is a digest of the tokens it covers, its bytes
    grow with them, and pinning the same prefix twice is one pin): probing guesses would come apart token by
    token. A pin's bytes are those of the memory entry of exactly the tokens it covers (made here when only a
    longer one held them), else their K/V (:func:`_kv_bytes`): what it keeps from eviction."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < float("inf"):
        raise InvalidRequest(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    resident, restored = _restore(cache, ns_key, tokens, drafter_namespace, usable)
    length = 0 if restored is None else _cut(restored, granularity)
    if length == 0:
        raise NotStored("no stored prefix of these tokens")
    covered = [int(t) for t in tokens[:length]]
    table = _table(cache)
    pid = pin_id(ns_key, covered)
    quota = _Quota(table, pid, owner, quota_bytes, total_quota_bytes)
    quota.check(_kv_bytes(restored.caches, length))  # before anything is stored for it
    whole = length == restored.length
    owned = None
    store_key = cache.store.entry_key(ns_key, covered)
    if store_key is None:  # served from a longer entry's chunks: store the prefix as its own entry
        owned = _owned(restored.caches)
        put = cache.save(ns_key, covered, owned, drafter_namespace=drafter_namespace if whole else None,
                         draft_checkpoint=restored.draft_checkpoint if whole else None,
                         minimum_reusable=_converted(restored.caches))
        store_key = None if put is None else put.entry
    made = False
    held = _exactly(cache.memory, ns_key, covered)
    if held is None:  # only a longer entry serves it (by trimming), or none: hold exactly these tokens, pinned
        made = cache.memory.put(ns_key, covered, owned or _owned(restored.caches), durable=True, pinned=True,
                                minimum_reusable=_converted(restored.caches)) is not None
        held = _exactly(cache.memory, ns_key, covered)
    memory_tokens = None if held is None else held[0]
    if store_key is None and memory_tokens is None:
        raise NotStored("the prefix could be restored but neither tier could hold it")
    nbytes = _kv_bytes(restored.caches, length) if held is None else held[1]
    try:
        quota.check(nbytes)
    except PinQuotaExceeded:
        if made:
            cache.memory.pin(ns_key, covered, False)
        raise
    now = time.monotonic()
    record = Pin(pid, bytes(ns_key), tuple(covered), owner, now + float(ttl_s), time.time() + float(ttl_s), nbytes,
                 memory_tokens, store_key, restored.tier)
    with table.lock:
        table.pins[pid] = record
    _apply(cache, table, record)
    return record


class _Quota:
    """What ``owner`` may still pin: its other pins against ``quota_bytes``, everyone's against ``total``. A
    refusal names only the caller's own share and pins (never other tenants' or the server's total: another
    tenant's pins are none of its business)."""

    def __init__(self, table: _Table, pid: str, owner: Any, quota_bytes: int | None, total: int | None) -> None:
        others = [p for p in table.live() if p.pin_id != pid]
        if sum(p.owner == owner for p in others) >= MAX_PINS:
            raise PinQuotaExceeded(f"this tenant holds {MAX_PINS} pins already (the most one may hold)")
        self.mine = sum(p.nbytes for p in others if p.owner == owner)
        self.everyone = sum(p.nbytes for p in others)
        self.quota, self.total = quota_bytes, total

    def check(self, nbytes: int) -> None:
        mine = self.mine + nbytes
        share = "" if self.quota is None else f"; this tenant may pin at most {self.quota}"
        if self.quota is not None and mine > self.quota:
            raise PinQuotaExceeded(f"pinning {nbytes} more bytes would hold {mine} pinned bytes{share}")
        if self.total is not None and self.everyone + nbytes > self.total:
            raise PinQuotaExceeded(f"pinning {nbytes} more bytes is refused: the server pins no more now (this "
                                   f"tenant holds {self.mine} pinned bytes{share})")


def _exactly(memory, ns_key: bytes, tokens: list[int]) -> tuple[bytes, int] | None:
    """``(tokens, bytes)`` of the memory entry for exactly ``tokens``, or None (none, or only a longer one)."""
    held = memory.serving(ns_key, tokens)
    return held if held is not None and len(held[0]) == 4 * len(tokens) else None


def _owned(caches) -> list:
    """New caches over copies of exactly the tokens ``caches`` cover: a trimmed cache's arrays are views of the
    longer state's buffers, which an entry holding them would keep alive while counting only its own tokens."""
    import mlx.core as mx

    from spec_cache.state.cache_kinds import kind_of

    out = []
    for c in caches:
        kind = kind_of(c)
        meta, arrays = kind.capture(c)
        arrays = [mx.contiguous(a) if is_array(a) else a for a in arrays]
        mx.eval([a for a in arrays if is_array(a)])
        out.append(kind.build(meta, arrays))
    return out


def _cut(restored, granularity: int) -> int:
    """The restored prefix's length cut down to a multiple of ``granularity`` (its caches trimmed in place: they
    are new objects over the tiers' arrays); 0 when it cannot be cut (a recurrent layer) or is shorter."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    length = restored.length - restored.length % max(1, int(granularity))
    if 0 < length < restored.length:
        if not can_trim_prompt_cache(restored.caches):
            return 0
        trim_prompt_cache(restored.caches, restored.length - length)
    return length


def _kv_bytes(caches, length: int) -> int:
    """Bytes of the state of the first ``length`` tokens: per K/V layer the positions it holds (a ring: at most its
    window) times its bytes per position; a recurrent layer's arrays whole."""
    total = 0
    for c in caches:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        parts = [a for a in (*_parts(keys), *_parts(values)) if is_array(a)]
        if parts and parts[0].ndim == 4 and parts[0].shape[2] > 0:
            positions = min(length, int(parts[0].shape[2]))
            total += sum(a.nbytes // a.shape[2] for a in parts if a.ndim == 4 and a.shape[2]) * positions
        elif hasattr(c, "cache"):
            total += sum(a.nbytes for a in c.cache if is_array(a))
    return int(total)


def _parts(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def unpin(cache, pin_id_: str, *, owner: Any = None, any_owner: bool = False) -> Pin:
    """End pin ``pin_id_`` now (``owner``'s own only, unless ``any_owner``); ``NotStored`` if there is none."""
    table = _table(cache)
    table.live()
    with table.lock:
        record = table.pins.get(pin_id_)
        if record is None or not (any_owner or record.owner == owner):
            raise NotStored(f"no pin {pin_id_!r}")
        del table.pins[pin_id_]
    _apply(cache, table, record)
    return record


def pins(cache, *, owner: Any = None, any_owner: bool = False) -> list[Pin]:
    """The live pins (``owner``'s, or every one with ``any_owner``), soonest to end first."""
    return sorted((p for p in _table(cache).live() if any_owner or p.owner == owner), key=lambda p: p.until)


def _apply(cache, table: _Table, record: Pin) -> None:
    """Set the memory pin and the LMDB lease that ``record``'s entries need now: the latest end among the live
    pins on the same entry, or none."""
    live = table.live()
    if record.memory_tokens is not None:
        ends = [p.until for p in live if p.ns_key == record.ns_key and p.memory_tokens == record.memory_tokens]
        tokens = np.frombuffer(record.memory_tokens, dtype=np.uint32)
        cache.memory.pin(record.ns_key, tokens, bool(ends), until=max(ends) if ends else None)
    if record.store_key is not None:
        ends = [p.until for p in live if p.store_key == record.store_key]
        if ends:
            cache.store.leases.hold(record.store_key, max(ends))
        else:
            cache.store.leases.release(record.store_key)


def _converted(caches) -> int:
    from spec_cache.rows.kv_quant import converted_at

    try:
        return converted_at(caches) or 0
    except ValueError:
        return 0


# --- import (export: spec_cache.convert.interop.export_prefix) --------------------------------------------------------
def import_prefix(cache, ns_key: bytes, tokens: Sequence[int] | None, data: bytes, target, *,
                  target_identity: str | None = None, quantized: bool = False, plan: Any = None) -> int:
    """Store the prompt-cache file ``data`` as the checkpoint of ``tokens`` (None: the file's ``spec_cache_tokens``
    metadata) for ``target`` (a ``spec_cache.rows.target.TargetModel``), in the memory tier and LMDB; the number of
    tokens stored. ``BadPrefixFile`` when the file is unreadable, names another target, covers other tokens, or does
    not fit the model (:func:`check_fits`: every layer's kind, shapes, dtype, length and cache parameters).

    Nothing is stored unless all of it is checked first: an entry that does not fit would be restored by the next
    request and fail the engine step of every row batched with it. If LMDB then refuses the checkpoint (its
    budget, a quota), the memory tier's copy is dropped too: a refused import leaves no trace in any tier."""
    caches, metadata = read_prefix_file(data)
    recorded = metadata.get("spec_cache_tokens")
    if recorded is not None:
        recorded = token_ids(recorded, target.vocab_size)
    if tokens is None:
        if recorded is None:
            raise BadPrefixFile("give the tokens the file covers (it records none)")
        tokens = recorded
    tokens = token_ids(list(tokens), target.vocab_size, "the token ids given")
    if recorded is not None and recorded != tokens:
        raise BadPrefixFile("the file records other token ids than the ones given")
    named = metadata.get("spec_cache_target_identity")
    if named is not None and target_identity is not None and named != target_identity:
        raise BadPrefixFile(f"the file was exported for target {str(named)[:16]}…, this server's is "
                            f"{target_identity[:16]}…")
    check_fits(target, caches, len(tokens), quantized=quantized, plan=plan)
    put = cache.save(ns_key, tokens, caches, minimum_reusable=_converted(caches))
    if put is None:
        cache.memory.discard(ns_key, tokens)
        raise BadPrefixFile("the prefix could not be stored (see the server log)")
    return len(tokens)
