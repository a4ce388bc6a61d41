"""``MemoryTier``: checkpoints held as MLX arrays above the LMDB store (the seed's RAM tier).

Why one file: the tier's rules (longest prefix, supersession, tenants, budget) act on one entry table under one
lock; the cache kinds it holds are ``cache_kinds``' table.

A checkpoint saved or restored in this process stays here as the MLX arrays the engine produced (device memory on
a GPU, RAM on a CPU or Apple machine). A hit hands a row its state with no host round trip and no re-verification:
the arrays never left process memory, and were verified when they entered (restored from LMDB) or were computed
here. What the tier holds is never changed by the rows that continue from it: a hit hands out *new* array objects
(slices or views of the held ones); MLX arrays are values, an update of a row's cache builds new arrays and never
writes into a buffer another array still references.

Rules (from the seed's RAM tier, seed-design.md section 3.1):

* Longest usable prefix. An entry whose tokens are a prefix of the request serves its whole length, with its
  drafter parts. A *trimmable* entry (every layer token-sliceable: KV or quantized KV) also serves any shorter
  common prefix, target only (attachments and ring buffers are exact-length), never below its minimum reusable
  offset (a quantized state's conversion point). The caller's ``usable(candidate)`` predicate (``length``,
  ``has_drafter``, ``minimum_reusable``; the same one ``Store.fetch`` takes) picks among candidates.
* ``put`` of the same tokens replaces the entry (drafter parts are merged); a trimmable entry supersedes the
  trimmable, attachment-free ancestors it can serve by trimming.
* Tenants: ``set_tenant(ns_key, label)`` (``SpecCache.namespace`` calls it with the store's tenant label) puts a
  namespace's bytes on its tenant's account. A tenant over its quota (``tenant_quota_bytes``, or ``tenant_share``
  of the budget) evicts its own entries first; over the budget, the tenant holding most bytes (most over its
  fair share, budget / tenants) loses its least recently used entry first, so one tenant's flood never evicts
  a tenant within its share. Without labels (one tenant) eviction is the plain LRU below.
* LRU by bytes under ``budget_bytes``; pinned entries and entries whose LMDB write has not committed yet
  (``durable`` false) are never evicted: a checkpoint leaves RAM only once the cold tier holds it (or its write
  failed for good). ``reclaim`` evicts under memory pressure (MLX's active memory against a fraction of the
  device's memory); entries idle for ``idle_seconds`` are demoted (dropped here; LMDB still serves them).

Costs: a lookup compares the request with every entry of its namespace (numpy, ~1 µs per 10k tokens per entry);
a hit costs one slice per stored array (no copy); a put costs nothing beyond holding the arrays.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from spec_cache.errors import InvalidRequest
from spec_cache.state.cache_kinds import kind_named, kind_of
from spec_cache.store import InvalidInput, TenantPolicy, fair_victim_tenant

__all__ = ["HitView", "MemoryHit", "MemoryTier", "default_budget", "held_bytes"]

#: fraction of the device's memory above which ``reclaim`` runs on put
PRESSURE_FRACTION = 0.90


@dataclass(frozen=True)
class HitView:
    """A held prefix as the caller's ``usable`` predicate sees it: the fields it shares with the store's ``Hit``
    (which the same predicate sees from LMDB). Not the store's ``Candidate``: that one is an index guess, not
    yet checked; this one is held and checked."""

    length: int              # tokens of target state the candidate restores
    has_drafter: bool        # whether the asked drafter's row comes with it
    minimum_reusable: int    # a quantized state's conversion point (0: full precision)


@dataclass
class _Layer:
    """One layer as held: ``kind`` (a ``cache_kinds`` name: kv, qkv, rotating, arrays), its arrays and scalars."""

    kind: str
    arrays: list             # kv: [keys, values]; qkv: 3 key parts + 3 value parts; rotating/arrays: as stored
    meta: dict               # qkv: group_size, bits, converted_at; rotating: offset/keep/max_size/idx; arrays: present


@dataclass
class _Entry:
    """A checkpoint held in memory."""

    ns_key: bytes
    tokens: np.ndarray       # uint32, the prefix this state covers
    layers: list[_Layer]
    drafters: dict           # drafter namespace -> DraftRowCheckpoint (exact length)
    minimum_reusable: int
    trimmable: bool          # every layer is token-sliceable (kv/qkv)
    nbytes: int
    durable: bool            # the cold tier holds it (or its write failed for good: nothing more will come)
    pinned: bool = False
    pin_until: float | None = None  # a pin's end (``time.monotonic()``); None: until unpinned
    last_use: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[bytes, bytes]:
        return self.ns_key, self.tokens.tobytes()

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class MemoryHit:
    """A chosen candidate: ``length`` tokens from ``entry`` (trimmed when shorter than the entry)."""

    length: int
    has_drafter: bool
    minimum_reusable: int
    entry: _Entry = field(repr=False)


def held_bytes(arrays) -> int:
    return int(sum(a.nbytes for a in arrays if a is not None))


def default_budget() -> int:
    """1/8 of the accelerator's memory on a GPU (MLX's ``device_info``), else 1/8 of RAM; at most 32 GiB."""
    total = 0
    try:
        import mlx.core as mx

        total = int(mx.device_info().get("memory_size", 0) or 0)
    except Exception:
        total = 0
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 << 30
    return int(min(total // 8, 32 << 30))


#: how many of a namespace's latest entries ``MemoryTier.common_prefix`` compares
COMMON_PREFIX_SCAN = 32


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class MemoryTier:
    """Checkpoints as MLX arrays, LRU by bytes. Thread-safe (the write-behind thread marks entries durable).

    ``memory_probe()`` returns (active bytes, limit bytes) for pressure reclaim (default: MLX's active memory
    against ``PRESSURE_FRACTION`` of the device's memory); ``idle_seconds`` None turns idle demotion off.
    """

    def __init__(self, budget_bytes: int, *, idle_seconds: float | None = 600.0,
                 memory_probe: Callable[[], tuple[int, int]] | None = None, tenant_quota_bytes: int | None = None,
                 tenant_share: float | None = None):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise InvalidRequest("memory_bytes must be an int >= 0")
        try:  # the store's quota rule, one definition (spec_cache.store.eviction)
            policy = TenantPolicy.of(tenant_quota_bytes, tenant_share, budget_bytes)
        except InvalidInput as exc:
            raise InvalidRequest(str(exc)) from None
        self.budget_bytes = budget_bytes
        self.tenant_quota = policy.quota(budget_bytes)  # bytes one tenant may hold (None: no quota)
        self._tenant_of: dict[bytes, bytes] = {}   # namespace key -> tenant label (absent: the default tenant)
        self.tenant_bytes: dict[bytes, int] = {}   # tenant label (b"": default) -> bytes held
        self.idle_seconds = idle_seconds
        self._probe = memory_probe or _mlx_memory
        self._lock = threading.RLock()
        self._entries: OrderedDict[tuple[bytes, bytes], _Entry] = OrderedDict()  # LRU first
        self._by_ns: dict[bytes, dict[bytes, _Entry]] = {}
        self.bytes = 0
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "evicted": 0, "superseded": 0, "reclaimed": 0,
                         "demoted": 0, "refused": 0}

    # --- put -------------------------------------------------------------------------------------
    def put(self, ns_key: bytes, tokens: Sequence[int], caches: Sequence[Any], *,
            drafter_namespace: str | None = None, draft_checkpoint=None, minimum_reusable: int = 0,
            durable: bool = False, pinned: bool = False) -> _Entry | None:
        """Hold single-row mlx-lm ``caches`` covering ``tokens`` (and this drafter's checkpoint).

        The arrays are held as given (the engine hands owned snapshots). Returns the entry (None when the tier is
        off or the checkpoint alone is over the budget). ``durable``: the cold tier already holds it.
        """
        if self.budget_bytes == 0:
            return None
        packed = np.asarray(tokens, dtype=np.uint32)
        layers = [_hold(cache) for cache in caches]
        drafters = {}
        if draft_checkpoint is not None and drafter_namespace is not None:
            drafters[drafter_namespace] = draft_checkpoint
        nbytes = sum(held_bytes(layer.arrays) for layer in layers)
        nbytes += sum(held_bytes(cp.attachment.tensors) for cp in drafters.values())
        if nbytes > self.budget_bytes or (self.tenant_quota is not None and nbytes > self.tenant_quota):
            self.counters["refused"] += 1
            return None
        trimmable = bool(layers) and all(kind_named(layer.kind).trimmable for layer in layers)
        entry = _Entry(ns_key, packed, layers, drafters, int(minimum_reusable), trimmable, nbytes, durable, pinned)
        with self._lock:
            old = self._entries.get(entry.key)
            if old is not None:  # exact duplicate: replace, keep other drafters' parts
                for dns, cp in old.drafters.items():
                    entry.drafters.setdefault(dns, cp)
                    if dns not in drafters:
                        entry.nbytes += held_bytes(cp.attachment.tensors)
                if old.pinned and not entry.pinned:  # the pin (and its end) stays with the tokens
                    entry.pinned, entry.pin_until = True, old.pin_until
                entry.durable = entry.durable and old.durable
                self._remove(old)
            self._add(entry)
            self.counters["puts"] += 1
            if entry.trimmable:
                self._supersede(entry)
            self._evict_to(self.budget_bytes)
        self.reclaim_if_pressed()
        return entry

    def mark_durable(self, entry: _Entry) -> None:
        """The cold tier holds ``entry`` now (or never will): it may be evicted from here."""
        with self._lock:
            entry.durable = True
            if self._entries.get(entry.key) is entry and _superseded(entry,
                                                                       self._by_ns.get(entry.ns_key, {}).values()):
                self._remove(entry)  # a longer entry put while its write was pending serves it by trimming
                self.counters["superseded"] += 1
            self._evict_to(self.budget_bytes)

    def pin(self, ns_key: bytes, tokens: Sequence[int], pinned: bool = True, until: float | None = None) -> bool:
        """Pin (or unpin) the entry for exactly ``tokens``; pinned entries are never evicted. ``until``
        (``time.monotonic()``): the pin ends by itself then (None: when unpinned)."""
        key = (ns_key, np.asarray(tokens, dtype=np.uint32).tobytes())
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.pinned, entry.pin_until = bool(pinned), (until if pinned else None)
            if not pinned:
                self._evict_to(self.budget_bytes)
            return True

    def discard(self, ns_key: bytes, tokens: Sequence[int]) -> bool:
        """Drop the entry for exactly ``tokens`` (pinned or not); False if none. Why: a checkpoint LMDB refused
        (an import answered 4xx) must leave no copy here for the next request to restore."""
        key = (ns_key, np.asarray(tokens, dtype=np.uint32).tobytes())
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            self._remove(entry)
            return True

    def held_prefix(self, ns_key: bytes, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` a held entry could serve (an entry that is a prefix of them: its length; a
        trimmable one: the common prefix, down to its minimum reusable offset), 0 for none. A read for planning
        (``spec-cache serve`` skips rendering message boundaries the cache already covers): no hit is counted,
        nothing moves in the LRU order, and no caller's usability rule is applied."""
        query = np.asarray(tokens, dtype=np.uint32)
        best = 0
        with self._lock:
            for entry in self._by_ns.get(ns_key, {}).values():
                for hit in _candidates(entry, query, None):
                    best = max(best, hit.length)
                    break  # candidates come longest first
        return best

    def common_prefix(self, ns_key: bytes, tokens: Sequence[int]) -> int:
        """The most leading ``tokens`` an entry of namespace ``ns_key`` shares with them (held or with its LMDB
        write pending; usable or not). No hit is counted and nothing moves in the LRU order.

        Why: the write queue counts a checkpoint as the bytes after the chunks LMDB holds or will hold by its write
        (``SpecCache._submit``). The entries here are those chunks' checkpoints (a durable one LMDB holds, a pending
        one is queued before it), so this answers from memory what asking LMDB (a hash and a read per chunk)
        answered on the request thread. Only the namespace's ``COMMON_PREFIX_SCAN`` latest puts are compared (a
        conversation's previous turn is among them; a namespace can hold thousands of small entries). Entries not
        seen make the estimate low, never high (the checkpoint counts more of its bytes)."""
        query = np.asarray(tokens, dtype=np.uint32)
        with self._lock:
            latest = itertools.islice(reversed(self._by_ns.get(ns_key, {}).values()), COMMON_PREFIX_SCAN)
            return max((_lcp(entry.tokens, query) for entry in latest), default=0)

    def serving(self, ns_key: bytes, tokens: Sequence[int]) -> tuple[bytes, int] | None:
        """``(entry tokens, bytes)`` of the held entry that serves all of ``tokens`` (the shortest; a longer
        trimmable one serves it by trimming), or None; counts no hit (``pin`` takes the entry's tokens)."""
        query = np.asarray(tokens, dtype=np.uint32)
        with self._lock:
            found = [e for e in self._by_ns.get(ns_key, {}).values() if e.length == len(query) or (
                e.trimmable and e.length > len(query) and len(query) >= e.minimum_reusable)]
            found = [e for e in found if _lcp(e.tokens, query) == len(query)]
            if not found:
                return None
            entry = min(found, key=lambda e: e.length)
            return entry.tokens.tobytes(), entry.nbytes

    def set_tenant(self, ns_key: bytes, label: bytes | None) -> None:
        """Count namespace ``ns_key``'s bytes on tenant ``label`` (None or b"": the default tenant)."""
        label = bytes(label or b"")
        with self._lock:
            held = list(self._by_ns.get(ns_key, {}).values())
            for entry in held:
                self._account(entry, -1)
            if label:
                self._tenant_of[ns_key] = label
            else:
                self._tenant_of.pop(ns_key, None)
            for entry in held:
                self._account(entry, +1)
            self._evict_to(self.budget_bytes)

    def forget_namespace(self, ns_key: bytes) -> bool:
        """Drop namespace ``ns_key``'s tenant label if it holds no entry here; True if it holds none (the caller
        forgets the namespace), False if it holds one (kept, label and all)."""
        with self._lock:
            if self._by_ns.get(ns_key):
                return False
            self._tenant_of.pop(ns_key, None)
            return True

    # --- lookup / take ---------------------------------------------------------------------------
    def lookup(self, ns_key: bytes, tokens: Sequence[int], *, drafter_namespace: str | None = None,
               usable: Callable[[Any], bool] | None = None, count: bool = True) -> MemoryHit | None:
        """The longest usable prefix of ``tokens`` held here (see the module doc), or None. ``count=False``: a
        probe (``SpecCache``'s target-only lookup compares namespaces first): no hit/miss counted, no LRU touch."""
        query = np.asarray(tokens, dtype=np.uint32)
        best: MemoryHit | None = None
        with self._lock:
            self._demote_idle()
            for entry in list(self._by_ns.get(ns_key, {}).values()):
                for hit in _candidates(entry, query, drafter_namespace):
                    if usable is not None and not usable(HitView(hit.length, hit.has_drafter,
                                                                   hit.minimum_reusable)):
                        continue
                    if best is None or (hit.length, hit.has_drafter) > (best.length, best.has_drafter):
                        best = hit
                    break  # candidates come longest first
            if not count:
                return best
            if best is None:
                self.counters["misses"] += 1
                return None
            self.counters["hits"] += 1
            best.entry.last_use = time.monotonic()
            self._entries.move_to_end(best.entry.key)
            return best

    def take(self, hit: MemoryHit, drafter_namespace: str | None = None):
        """``(caches, draft_checkpoint)`` for ``hit``: new mlx-lm cache objects over slices of the held arrays."""
        entry = hit.entry
        caches = [_rebuild(layer, hit.length, entry.length) for layer in entry.layers]
        checkpoint = None
        if hit.has_drafter and drafter_namespace is not None:
            checkpoint = _fresh_checkpoint(entry.drafters[drafter_namespace])
        return caches, checkpoint

    # --- eviction --------------------------------------------------------------------------------
    def reclaim(self, target_bytes: int) -> int:
        """Evict least recently used evictable entries until the tier holds at most ``target_bytes``."""
        with self._lock:
            before = self.counters["evicted"]
            self._evict_to(max(0, int(target_bytes)))
            freed = self.counters["evicted"] - before
            self.counters["reclaimed"] += freed
            return freed

    def reclaim_if_pressed(self) -> None:
        """Under memory pressure (active memory over the limit), give back what is over, down to zero."""
        try:
            active, limit = self._probe()
        except Exception:
            return
        if limit and active > limit:
            self.reclaim(self.bytes - (active - limit))

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._entries.values()):
                self._remove(entry)

    def stats(self) -> dict:
        with self._lock:
            self._expire_pins()
            tenants = {(label.hex() if label else "default"): n for label, n in sorted(self.tenant_bytes.items())}
            return {"budget": self.budget_bytes, "bytes": self.bytes, "entries": len(self._entries),
                    "pinned": sum(e.pinned for e in self._entries.values()),
                    "not_durable": sum(not e.durable for e in self._entries.values()), "tenants": tenants,
                    "tenant_quota": self.tenant_quota, **self.counters}

    def sequences(self) -> tuple[int, int]:
        """``(entries, bytes)`` without the entries a longer one supersedes once their LMDB write is done (what
        mlx-lm's ``LRUPromptCache`` counts: it drops a trimmable entry's prefixes at once). Only entries still
        waiting for LMDB can be such (``put`` and ``mark_durable`` drop the others), so few are compared."""
        with self._lock:
            n, nbytes = len(self._entries), self.bytes
            for ns in self._by_ns.values():
                for e in [e for e in ns.values() if not e.durable]:
                    if _superseded(e, ns.values()):
                        n, nbytes = n - 1, nbytes - e.nbytes
            return n, nbytes

    # --- internals -------------------------------------------------------------------------------
    def _add(self, entry: _Entry) -> None:
        self._entries[entry.key] = entry
        self._by_ns.setdefault(entry.ns_key, {})[entry.key[1]] = entry
        self.bytes += entry.nbytes
        self._account(entry, +1)

    def _account(self, entry: _Entry, sign: int) -> None:
        label = self._tenant_of.get(entry.ns_key, b"")
        left = self.tenant_bytes.get(label, 0) + sign * entry.nbytes
        if left:
            self.tenant_bytes[label] = left
        else:
            self.tenant_bytes.pop(label, None)

    def _remove(self, entry: _Entry) -> None:
        self._entries.pop(entry.key, None)
        ns = self._by_ns.get(entry.ns_key)
        if ns is not None:
            ns.pop(entry.key[1], None)
            if not ns:
                del self._by_ns[entry.ns_key]
        self.bytes -= entry.nbytes
        self._account(entry, -1)

    def _supersede(self, entry: _Entry) -> None:
        """Drop trimmable, attachment-free ancestors that ``entry`` serves by trimming (same conversion point);
        never a pinned one. One whose LMDB write is still pending goes only for an ``entry`` whose write is pending
        too: its write still runs (the write queue holds its job, ``SpecCache._lend`` gives that job ``entry``'s
        arrays), and until then ``entry`` holds its state here (queued after it, never evicted before its own
        write, which comes after). Why: a row checkpointed at each message boundary while the writer was behind
        kept every boundary's ~2 GB snapshot here (issue 35's agent run on an H100: device memory 14 -> 76 GiB).
        A durable ``entry`` (restored from LMDB) can be evicted any time: the pending ancestor stays."""
        for other in list(self._by_ns.get(entry.ns_key, {}).values()):
            if (other is entry or other.pinned or (entry.durable and not other.durable) or not other.trimmable
                    or other.drafters
                    or other.length >= entry.length or other.minimum_reusable != entry.minimum_reusable
                    or other.length < entry.minimum_reusable):
                continue
            if _lcp(other.tokens, entry.tokens) == other.length:
                self._remove(other)
                self.counters["superseded"] += 1

    def _expire_pins(self) -> None:
        """Pins whose ``until`` passed end here (eviction and idle demotion look first)."""
        now = time.monotonic()
        for entry in self._entries.values():
            if entry.pinned and entry.pin_until is not None and entry.pin_until <= now:
                entry.pinned, entry.pin_until = False, None

    def _evict_to(self, limit: int) -> None:
        self._expire_pins()
        over_quota = self.tenant_quota is not None and any(n > self.tenant_quota for n in self.tenant_bytes.values())
        if self.bytes <= limit and not over_quota:
            return
        if len(self.tenant_bytes) > 1 or over_quota:
            self._evict_fair(limit)
            return
        for entry in list(self._entries.values()):  # least recently used first
            if self.bytes <= limit:
                return
            if entry.pinned or not entry.durable:
                continue
            self._remove(entry)
            self.counters["evicted"] += 1

    def _evict_fair(self, limit: int) -> None:
        """Tenants over their quota evict their own least recently used entries; then, while over ``limit``,
        the tenant holding most bytes (most over its fair share) loses its least recently used entry."""
        queues: dict[bytes, list[_Entry]] = {}
        for entry in self._entries.values():  # least recently used first
            if not entry.pinned and entry.durable:
                queues.setdefault(self._tenant_of.get(entry.ns_key, b""), []).append(entry)
        heads = dict.fromkeys(queues, 0)

        def evict_one(label: bytes) -> bool:
            queue = queues.get(label, ())
            if heads.get(label, 0) >= len(queue):
                return False
            self._remove(queue[heads[label]])
            heads[label] += 1
            self.counters["evicted"] += 1
            return True
        if self.tenant_quota is not None:
            for label in list(self.tenant_bytes):
                while self.tenant_bytes.get(label, 0) > self.tenant_quota and evict_one(label):
                    pass
        exhausted: set[bytes] = set()
        while self.bytes > limit:
            label = fair_victim_tenant(self.tenant_bytes, exhausted)  # the store's fair-share rule
            if label is None:
                return
            if not evict_one(label):
                exhausted.add(label)

    def _demote_idle(self) -> None:
        if self.idle_seconds is None:
            return
        self._expire_pins()
        cutoff = time.monotonic() - self.idle_seconds
        for entry in list(self._entries.values()):
            if entry.last_use >= cutoff:
                return  # LRU order: the rest were used later
            if entry.durable and not entry.pinned:
                self._remove(entry)
                self.counters["demoted"] += 1


def _superseded(entry: _Entry, held) -> bool:
    """Whether a longer trimmable entry of ``held`` (its namespace) serves ``entry`` by trimming (``_supersede``'s
    rule, durability aside)."""
    if not entry.trimmable or entry.pinned or entry.drafters:
        return False
    return any(o.trimmable and o.length > entry.length and o.minimum_reusable == entry.minimum_reusable
               and entry.length >= o.minimum_reusable and _lcp(o.tokens, entry.tokens) == entry.length for o in held)


def _candidates(entry: _Entry, query: np.ndarray, drafter_namespace: str | None):
    """This entry's candidates for ``query``, longest first: the whole entry, then a trimmed prefix."""
    common = _lcp(entry.tokens, query)
    if common == entry.length:
        yield MemoryHit(entry.length, drafter_namespace is not None and drafter_namespace in entry.drafters,
                        entry.minimum_reusable, entry)
    if entry.trimmable and 1 <= common < entry.length and common >= entry.minimum_reusable:
        yield MemoryHit(common, False, entry.minimum_reusable, entry)


def _hold(cache) -> _Layer:
    """The arrays of one single-row mlx-lm cache, covering exactly its offset (``cache_kinds``' capture)."""
    kind = kind_of(cache)
    meta, arrays = kind.capture(cache)
    return _Layer(kind.name, arrays, meta)


def _rebuild(layer: _Layer, length: int, held: int):
    """A new mlx-lm cache over (slices of) the held arrays: nothing the row does reaches the tier's arrays (a
    slice is a new array object, a view of the same buffer, never written)."""
    kind = kind_named(layer.kind)
    return kind.build(layer.meta, kind.prefix(layer.arrays, length, held))


def _fresh_checkpoint(cp):
    """The same drafter checkpoint over new array objects."""
    from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint

    a = cp.attachment
    tensors = tuple(t[...] if hasattr(t, "shape") and hasattr(t, "dtype") and not isinstance(t, np.ndarray)
                    else t for t in a.tensors)
    return DraftRowCheckpoint(cp.processed_tokens, CheckpointAttachment(a.schema, dict(a.metadata), tensors))


def _mlx_memory() -> tuple[int, int]:
    """(MLX active bytes, the pressure limit): ``PRESSURE_FRACTION`` of the device's memory (RAM on a CPU)."""
    import mlx.core as mx

    total = int(mx.device_info().get("memory_size", 0) or 0)
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(mx.get_active_memory()), int(total * PRESSURE_FRACTION)
