"""``SpecCache``: the runtime's view of a store — namespaces, save and restore of mlx-lm state.

Why one file: ``SpecCache`` is the one place where a storage failure becomes a miss and a warning; its save and
restore paths share the namespace, tier and write-behind bookkeeping, and split they would each have to keep that
rule.

It turns mlx-lm caches and drafter checkpoints into store records and back, and turns every storage
failure into a miss plus a warning: a cache may miss, it never takes the inference engine down.

Tiers, fastest first: the memory tier (``spec_cache.tiers.memory_tier``: checkpoints as MLX arrays in this process,
no copy and no re-verification on a hit), the local LMDB store (every record verified on read), and optionally
the shared tier. A restore is one call down (``restore(..., usable=...)``) and one result up. Checkpoint
writes can go behind the request (``save(..., background=True)``; ``spec_cache.tiers.write_behind``): the memory tier
holds a checkpoint until LMDB holds it durably.

With ``shared=`` (a Redis/Valkey URL) the store is the local tier of a fleet: a checkpoint saved here is queued
for publishing (write-behind, never blocking), and a lookup that the local store cannot serve in full asks the
shared tier for a longer prefix, verifies it, uses it at once and promotes it into LMDB in the background
(see docs/SHARED_TIER.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

from spec_cache.errors import InvalidRequest, RestoreRefused
from spec_cache.naming.namespace import namespace_key
from spec_cache.rows.kv_quant import converted_at
from spec_cache.schemas import DraftRowCheckpoint, SchemaError
from spec_cache.state.cache_state import (
    attachment_to_store,
    capture_caches,
    checkpoint_from_store,
    copies_bytes,
    host_layers,
    lendable,
    on_loan,
    restore_caches,
    restore_concat,
    shapes_only,
)
from spec_cache.store import (
    ChunkNotCopied,
    NamespaceNotRegistered,
    PutResult,
    Store,
    StoreError,
    StoreUnavailable,
    TenantShares,
    WriteBehind,
    pack_tokens,
    tenant_id,
)
from spec_cache.tiers import exit_drain
from spec_cache.tiers.memory_tier import MemoryHit, MemoryTier, default_budget
from spec_cache.tiers.namespaces import MAX_NAMESPACES, NamespaceTable, Registration
from spec_cache.tiers.shared_prefetch import Handoff
from spec_cache.tiers.write_behind import DEFAULT_QUEUE_BYTES, CheckpointWriter, WriterLeft

log = logging.getLogger("spec_cache")
#: per thread: the caches whose restores take shared prefixes only from ``prefetch_shared`` (``shared_via_prefetch``)
_via_prefetch = threading.local()
_HANDOFF_LOCK = threading.Lock()

#: ``durability`` modes: LMDB writes behind the request (default), or before ``save`` returns
DURABILITY = ("write-behind", "sync")


class CacheWarning(UserWarning):
    """A stored entry could not be used or written; the request went on without it."""


class CacheClosedError(StoreError):
    """The cache was used after ``close()``."""


@dataclass
class RestoredPrefix:
    """What a lookup gave back: ``length`` tokens of target state and, if stored, this drafter's row."""

    length: int
    caches: list[Any]
    draft_checkpoint: DraftRowCheckpoint | None
    warnings: list[str] = field(default_factory=list)
    tier: str = "local"  # where it came from: "memory", "local" (LMDB) or "shared"


_SAME = object()  # ``namespace``'s account default: the tenant itself
_SALTED = "|salt:"  # ``server.auth.salted_tenant``: "<tenant or 'open'>|salt:<digest of the cache_salt>"


def _tenant_label(account: str | bytes | None, from_tenant: bool) -> bytes | None:
    """The store's tenant label for ``account`` (None: the default tenant); a salted server tenant counts
    against the tenant before its salt."""
    if from_tenant and isinstance(account, str) and _SALTED in account:
        account = account.split(_SALTED, 1)[0]
        if account == "open":  # no API key: unauthenticated salts share the default tenant
            return None
    return None if account is None else tenant_id(account)


class SpecCache:
    """A store opened for inference: the memory tier above the local LMDB store (and, optionally, a shared tier).

    ``SpecCache.open(path, max_bytes=None, memory_bytes=<default>, shared=None, durability="write-behind")``;
    ``close()`` or ``with``. What ``save`` accepted is never lost by a process that ends without ``close()``:
    normally or by an uncaught exception, queued checkpoints are written at interpreter exit (``exit_timeout_s``).
    """

    def __init__(self, store: Store, shared=None, *, memory_bytes: int | None = None,
                 write_queue_bytes: int | None = None, durability: str = "write-behind",
                 exit_timeout_s: float = exit_drain.DEFAULT_EXIT_TIMEOUT_S, max_namespaces: int = MAX_NAMESPACES):
        if durability not in DURABILITY:
            raise InvalidRequest(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        if isinstance(exit_timeout_s, bool) or not isinstance(exit_timeout_s, (int, float)) or not \
                0 <= exit_timeout_s < float("inf"):
            raise InvalidRequest(f"exit_timeout_s must be a number of seconds >= 0, got {exit_timeout_s!r}")
        self.store = store
        self.shared = shared  # a store.shared.SharedTier, or None
        self.memory = MemoryTier(default_budget() if memory_bytes is None else memory_bytes,
                                 tenant_share=getattr(getattr(store, "tenants", None), "share", None))
        self.durability = durability
        self.exit_timeout_s = float(exit_timeout_s)
        # key -> what register_namespace was told, the least recently used first; bounded (``tiers.namespaces``)
        self._namespaces = NamespaceTable(max_namespaces)
        self._forget_earlier_namespaces()
        self._queued: dict[bytes, list[_WriteJob]] = {}  # checkpoints waiting for the writer, by namespace
        self._queued_lock = threading.Lock()
        self._tenant_queued: dict[bytes, int] = {}  # tenant label -> bytes of its checkpoints in the write queue
        self._closed = False
        self._close_lock = threading.Lock()
        self._pid = os.getpid()  # a forked child must not close its parent's cache at its exit
        # no writer thread when every save writes before it returns (sync) or nothing can be written (read-only)
        behind = not store.readonly and durability == "write-behind"
        if write_queue_bytes is None:  # the tier holds what is queued anyway: let the queue match its scale
            write_queue_bytes = max(DEFAULT_QUEUE_BYTES, self.memory.budget_bytes // 2)
        self.write_queue_bytes = write_queue_bytes
        #: seconds ``save`` spent on the caller's thread by phase, summed since the cache opened (``capture``: the
        #: state's copies queued; ``estimate``: what LMDB will hold of it; ``memory``: the memory tier's put;
        #: ``queue``: the write queued, or written when it had to be): the server's trace reads their growth per step
        self.save_seconds = {"capture": 0.0, "estimate": 0.0, "memory": 0.0, "queue": 0.0}
        self._writer = (CheckpointWriter(self._write, write_queue_bytes, write_many=self._write_many) if behind
                        else None)
        self._promoter = None
        if shared is not None:  # promotion off the request's path: the restored state is used at once; a fetched
            # prefix the queue refuses is dropped (``promote_dropped``): it was restored, only its LMDB copy is lost.
            # Tenants share its cap as the publisher's (``TenantShares``): a tenant within its share has the oldest
            # queued prefixes of the tenant holding the most dropped instead of its own (issue 37, tenth pass)
            self._promote_shares = TenantShares()
            self._promoter = WriteBehind(shared.config.queue_bytes, self._promote, name="spec-cache-promote")
        exit_drain.track(self)

    @classmethod
    def open(cls, path, max_bytes: int | None = None, *, memory_bytes: int | None = None, shared=None,
             shared_options: dict | None = None, write_queue_bytes: int | None = None,
             durability: str = "write-behind", exit_timeout_s: float = exit_drain.DEFAULT_EXIT_TIMEOUT_S,
             max_namespaces: int = MAX_NAMESPACES, **kwargs) -> "SpecCache":
        """Open the local store at ``path``; ``shared`` is a Redis/Valkey URL (or a ``SharedConfig``).

        ``memory_bytes``: the memory tier's budget (None: ``memory_tier.default_budget()``, 1/8 of the device's
        memory; 0: off). ``write_queue_bytes`` caps checkpoint bytes waiting for their LMDB write: the most a
        SIGKILL can lose (None: half the memory tier's budget, at least 1 GiB; the memory tier holds those
        checkpoints meanwhile, so the queue costs no memory of its own; a save that finds it full, the memory tier
        over its budget and its tenant over its share of the queue (cap / tenants with checkpoints queued) writes
        on the caller's thread, which on a server stalls every row: 222 ms per checkpoint at 4 clients on the H200 with
        a 1 GiB queue). ``durability``: ``"write-behind"`` (default) lets ``save(..., background=True)`` queue
        the LMDB write; ``"sync"`` makes every ``save`` commit to LMDB before it returns (``background`` is
        ignored), so a checkpoint survives a SIGKILL right after its request, at the cost of the write on the
        request's path. ``exit_timeout_s`` bounds how long interpreter exit waits for queued writes of a cache that
        was never closed (0: not at all; what is left is logged). ``shared_options`` overrides ``SharedConfig``
        fields (``timeout_s``, ``queue_bytes``, ``prefix``, ...). Other keywords go to ``Store.open``
        (``durable=False``: no fsync per commit; a commit then survives a crash of the process, not of the machine).
        ``max_namespaces``: tenant namespaces kept registered in process (``namespace``; the least recently used
        idle ones beyond it are forgotten, their empty LMDB rows dropped).
        A bad URL raises ``StoreError`` here; a server that is down is not an error (lookups miss until it is up).
        """
        if memory_bytes is not None and (isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int)
                                         or memory_bytes < 0):
            raise InvalidRequest("memory_bytes must be an int >= 0 (0 turns the memory tier off) or None")
        if durability not in DURABILITY:  # before anything is opened
            raise InvalidRequest(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        options = dict(memory_bytes=memory_bytes, write_queue_bytes=write_queue_bytes, durability=durability,
                       exit_timeout_s=exit_timeout_s, max_namespaces=max_namespaces)
        store = Store.open(path, max_bytes=max_bytes, **kwargs)
        try:
            if shared is None:
                return cls(store, **options)
            from spec_cache.store.shared import SharedConfig, SharedTier

            tier = SharedTier(SharedConfig.of(shared, **(shared_options or {})), store)
        except BaseException:
            store.close()
            raise
        try:
            return cls(store, tier, **options)
        except BaseException:
            tier.close()
            store.close()
            raise

    def close(self) -> None:
        """Write every queued checkpoint, stop the background threads, close the store. Idempotent."""
        self._shutdown(None)

    def _shutdown(self, timeout: float | None) -> WriterLeft | None:
        """Close, waiting at most ``timeout`` (None: for every queued write); None if already closed.

        Order: the LMDB writer (a written checkpoint is queued for publishing), the promoter, the shared tier's
        publisher, then the store. A write still in progress when ``timeout`` ends keeps the store open: closing
        an LMDB environment under a running transaction is not safe, and the process is ending anyway.
        """
        with self._close_lock:
            if self._closed:
                return None
            self._closed = True
        exit_drain.untrack(self)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left_s() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        left = WriterLeft(0, 0, 0, False) if self._writer is None else self._writer.stop(left_s())
        busy = left.in_flight
        if self.shared is not None:
            bound = self.shared.config.close_timeout_s
            wait = bound if deadline is None else min(bound, left_s())
            busy |= self._promoter.stop(wait, bounded=deadline is not None)[2]
            self.shared.close()  # publishes what is queued first (bounded by close_timeout_s)
        self.memory.clear()
        if not busy:
            self.store.close()
        return left
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def write_pending(self) -> tuple[int, int]:
        """(checkpoints queued for their LMDB write, their bytes); (0, 0) without write-behind."""
        return (0, 0) if self._writer is None else self._writer.pending

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until queued checkpoints are durable in LMDB (and background promotions and publishes are done);
        True if nothing is left."""
        done = self._writer is None or self._writer.drain(timeout)
        if done and self._writer is not None:
            self._flush_counters()
        if self.shared is None:
            return done
        return done and self._promoter.drain(timeout) and self.shared.drain(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def continuations(self):
        """This cache's continuation records (``spec_cache.tiers.continuations.Continuations``; made on first use)."""
        from spec_cache.tiers.continuations import Continuations

        return Continuations.of(self)

    def memo(self):
        """The artifact-identity memo kept in this cache's store (``spec_cache.naming.identity`` takes it)."""
        return self.store.memo()

    def memory_stats(self) -> dict:
        """The memory tier's counters (bytes, entries, hits, misses, budget, ...) and the write-behind queue's."""
        stats = self.memory.stats()
        stats["writes"] = {} if self._writer is None else self._writer.stats()
        return stats

    def shared_status(self) -> dict | None:
        """The shared tier's state and counters as this process sees them (None without a shared tier)."""
        return None if self.shared is None else self.shared.status()

    def namespace(self, target_identity: str, prefix_namespace: str, tenant: str | bytes | None = None, *,
                  account: str | bytes | None = _SAME, keep: bool = False) -> bytes:
        """The store key for (target, prefix namespace, tenant), registered for ``ls``/``show``.

        ``account`` is whom the namespace's bytes count against for per-tenant quotas and fair-share eviction
        (stored as a one-way label, ``store.keys.tenant_id``; None: the default tenant). By default it is
        ``tenant`` itself, except for the server's salted form ``"<tenant>|salt:<digest>"``
        (``server.auth.salted_tenant``), which counts against ``<tenant>`` (``open``, no API key: the default
        tenant), so a ``cache_salt`` splits a tenant's prefixes but not its quota.

        At most ``max_namespaces`` tenant namespaces stay registered in process; past that the least recently used
        that hold nothing are forgotten (``spec_cache.tiers.namespaces``) and registered again when named again.
        A namespace without a tenant, or registered with ``keep=True`` (a caller that saves under the key for a
        long time without naming it again), is never forgotten.
        """
        self._check_open()
        key = namespace_key(target_identity, prefix_namespace, tenant)
        known = self._namespaces.get(key)
        if known is None or (keep and not known.keep):
            label = _tenant_label(tenant if account is _SAME else account, account is _SAME)
            self._register(key, Registration(target_identity, prefix_namespace, tenant is not None, label,
                                             keep=keep or tenant is None))
            self._forget_idle_namespaces()
        return key

    def _register(self, key: bytes, reg: Registration) -> None:
        self.store.register_namespace(key, target=reg.target, prefix_namespace=reg.prefix, tenant=reg.tenant,
                                      tenant_id=reg.label)
        self.memory.set_tenant(key, reg.label)
        self._namespaces.add(key, reg)

    def _forget_idle_namespaces(self) -> None:
        """Past ``max_namespaces``, forget the least recently used namespaces that hold nothing in the memory tier
        or the write queue and that no caller holds (``hold``; an eighth of the bound at a time: one LMDB commit per
        batch), and drop their LMDB rows
        where those hold nothing either (``Store.forget_empty_namespaces``). Issue 37's sixth pass: one tenant's
        fresh ``cache_salt`` on every request grew these tables, and the store's, without bound."""
        keys = self._namespaces.over_limit(slack=max(1, self._namespaces.limit // 8))
        if not keys:
            return
        with self._queued_lock:
            queued = set(self._queued)
        idle = []
        for key in keys:
            if key not in queued and not self._namespaces.held(key) and self.memory.forget_namespace(key):
                idle.append(key)
            else:
                self._namespaces.touch(key)  # busy: the next forgetting looks at older keys first
        self._namespaces.forget(idle)
        if idle and not self.store.readonly:
            try:
                self.store.forget_empty_namespaces(idle)
            except StoreError as exc:  # the rows stay; the next batch tries its own
                log.warning("spec-cache: namespace rows not forgotten: %s", exc)

    def _forget_earlier_namespaces(self) -> None:
        """Drop the empty tenant namespace rows earlier processes left (``Store.forget_empty_tenant_namespaces``):
        each process forgets only what it registered, so without this every restart kept up to
        ``max_namespaces`` more of them for good. One pass over the rows and one commit, when the store opens (a
        read-only store: nothing, the store's own rule)."""
        try:
            self.store.forget_empty_tenant_namespaces()
        except StoreError as exc:  # the rows stay; this process forgets its own as ever
            log.warning("spec-cache: namespace rows of earlier processes not forgotten: %s", exc)

    def hold(self, ns_key: bytes) -> None:
        """Keep namespace ``ns_key`` registered until ``release``: a caller that will save under it later (the
        server's scheduler holds each job's namespace from taking the job until it ends) so that others' fresh
        namespaces never make this cache forget it meanwhile (issue 37, seventh pass: a job lost its first
        checkpoint to ``2 * max_namespaces`` fresh names of other tenants during its prefill). Counted: every
        ``hold`` needs its ``release``. Hold before naming (``namespace``), so that no forgetting comes between.
        Costs a dict update; held namespaces stay registered beyond ``max_namespaces``."""
        self._namespaces.hold(ns_key)

    def release(self, ns_key: bytes) -> None:
        """Let go of one ``hold`` of ``ns_key``; with no holder left it is forgettable again (a key not held:
        nothing)."""
        self._namespaces.release(ns_key)

    def namespaces_held(self) -> int:
        """How many namespaces this cache keeps registered in process (at most ``max_namespaces`` plus the busy)."""
        return len(self._namespaces)

    def tenant_of(self, ns_key: bytes) -> bytes:
        """The tenant label namespace ``ns_key`` counts against (b"": the default tenant, or not registered here)."""
        reg = self._namespaces.peek(ns_key)
        return (reg.label or b"") if reg is not None else b""

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("the cache is closed")

    # --- save ------------------------------------------------------------------------------------
    def save(self, ns_key: bytes, tokens: Sequence[int], caches: Sequence[Any], *,
             drafter_namespace: str | None = None, draft_checkpoint: DraftRowCheckpoint | None = None,
             minimum_reusable: int = 0, background: bool = False,
             then: Callable[[PutResult], None] | None = None,
             rider: Callable[[Any], None] | None = None) -> PutResult | None:
        """Store a checkpoint: held in the memory tier at once, written to LMDB (and queued for the shared tier).

        ``background=False`` writes LMDB now and returns its ``PutResult``: the checkpoint is committed (and, with
        the store's default ``durable=True``, fsynced) when this returns, so it survives even a SIGKILL right
        after. ``background=True`` queues the write (write-behind; ``drain()`` waits for it) and returns None, when
        the memory tier holds the checkpoint meanwhile (otherwise it is written now); a queued write survives the
        process ending normally or by an exception (the exit drain), not a SIGKILL before it is committed. Under
        ``durability="sync"`` every save writes now, whatever ``background`` says. On any failure: a
        ``CacheWarning``, None. ``then(put_result)`` runs once the checkpoint is committed to LMDB (on the writer
        thread, or here); never after a failure. ``rider(txn)`` writes rows of its own in the checkpoint's LMDB
        transaction (``Store.put``'s ``rider``: one commit for both; ``spec_cache.tiers.continuations`` writes its
        record so).
        """
        if self._closed:
            warnings.warn(f"spec-cache: checkpoint of {len(tokens)} tokens not stored: the cache is closed",
                          CacheWarning, stacklevel=2)
            return None
        behind = background and self._writer is not None
        if ns_key not in self._namespaces:  # forgotten while its request ran (``_forget_idle_namespaces``)
            reg = self._namespaces.recall(ns_key)
            if reg is not None:
                try:
                    self._register(ns_key, reg)
                except StoreError as exc:
                    warnings.warn(f"spec-cache: checkpoint of {len(tokens)} tokens not stored: {exc}", CacheWarning,
                                  stacklevel=2)
                    return None
        try:
            drafter = None
            if draft_checkpoint is not None and drafter_namespace is not None:
                if draft_checkpoint.processed_tokens != len(tokens):
                    raise InvalidRequest(f"drafter checkpoint covers {draft_checkpoint.processed_tokens} tokens, "
                                         f"target state {len(tokens)}")
                drafter = (drafter_namespace, attachment_to_store(draft_checkpoint))
            # behind the request, the device-to-host copy runs on the writer thread too (``host_layers``)
            t0 = time.perf_counter()
            layers = capture_caches(caches, defer_copy=behind)
        except (StoreError, SchemaError, TypeError, ValueError) as exc:
            warnings.warn(f"spec-cache: checkpoint of {len(tokens)} tokens not stored: {exc}", CacheWarning,
                          stacklevel=2)
            return None
        spent = self.save_seconds
        t1 = time.perf_counter()
        # what LMDB holds or will hold of it by its write, read before the put supersedes the entry saying so
        packed = np.asarray(tokens, dtype=np.uint32)  # (once for both: ~0.3 ms a conversion at 8k tokens)
        held = self._held_estimate(ns_key, packed) if behind else 0
        t2 = time.perf_counter()
        entry = self.memory.put(ns_key, packed, caches, drafter_namespace=drafter_namespace if drafter else None,
                                draft_checkpoint=draft_checkpoint if drafter else None,
                                minimum_reusable=minimum_reusable)
        job = _WriteJob(ns_key, list(tokens), layers, drafter, minimum_reusable,
                        None if entry is None else weakref.ref(entry), then, rider, packed=packed, loan=_Loan(layers))
        t3 = time.perf_counter()
        spent["capture"] += t1 - t0
        spent["estimate"] += t2 - t1
        spent["memory"] += t3 - t2
        try:
            # behind the request only while the memory tier serves the checkpoint meanwhile (tier off, or the
            # checkpoint over its budget: written now, so the next request finds it)
            if behind and entry is not None:
                self._submit(job, held)
                return None
            return self._write(job, stacklevel=3)
        finally:
            spent["queue"] += time.perf_counter() - t3

    def _submit(self, job: "_WriteJob", held: int) -> None:
        """Queue a checkpoint the memory tier holds. It counts against the queue's cap as what the writer will copy
        and write: the tokens after the chunks the store holds or a checkpoint queued before it writes first (a warm
        turn's checkpoint of a 6k-token 8B row counts its ~300 new tokens, not ~800 MB: counting the whole row
        filled the queue at two checkpoints and sent every later one to be written on the scheduler's thread, 41-46%
        of it in issue 35's H100 trace). A full queue still takes it while the memory tier's checkpoints fit the
        tier's budget (nothing of them can be evicted before LMDB holds it): the caller's thread does not write.
        ``held``: :meth:`_held_estimate`."""
        nbytes = job.tail_bytes(held)
        tenant = self.tenant_of(job.ns_key)
        with self._queued_lock:
            self._lend(job)
            self._queued.setdefault(job.ns_key, []).append(job)
            mine = self._tenant_queued.get(tenant, 0)
            others = sum(1 for who, n in self._tenant_queued.items() if n > 0 and who != tenant)
            self._tenant_queued[tenant] = mine + nbytes
            job.tenant, job.share_bytes = tenant, nbytes
        # a tenant within its share of the queue (cap / tenants with checkpoints queued) waits past a full cap even
        # when the memory tier is over its budget: the tenant that filled the queue pays the back-pressure, not the
        # others (issue 37, sixth pass: A's flood sent B's checkpoints to be written on the scheduler's thread). One
        # tenant alone: exactly as before.
        may_wait = (self.memory.bytes <= self.memory.budget_bytes
                    or (others > 0 and mine + nbytes <= self.write_queue_bytes // (others + 1)))
        if not self._writer.submit(job, nbytes, may_wait=may_wait):
            self._unqueued(job)  # written inline (or refused): nothing of it waits any more

    def _lend(self, job: "_WriteJob") -> None:
        """(under ``_queued_lock``) Queued checkpoints of ``job``'s namespace that the writer has not started and
        whose tokens ``job``'s begin with read ``job``'s arrays from now on and drop their own snapshot
        (``cache_state.lendable``): a row checkpointed at each message boundary while the writer is behind
        holds one snapshot, not one per boundary. They share one ``_Loan`` (moved over by a pointer each: the
        H200 agent run had 20-30 checkpoints queued, and rebuilding each one's 64 tensors at every checkpoint cost
        the scheduler's thread milliseconds); the arrays are put in place when the writer starts on one
        (``_to_host``, ``cache_state.on_loan``). Counted as ``lent``."""
        mine = job.token_array()
        checked: dict[_Loan, bool] = {}  # per loan the checkpoints move from: do its arrays' shapes fit job's
        for older in self._queued.get(job.ns_key, ()):
            n = len(older.tokens)
            if older.started or older.loan is None or older.loan is job.loan or n > len(mine):
                continue
            if not np.array_equal(mine[:n], older.token_array()):
                continue
            fits = checked.get(older.loan)
            if fits is None:  # keyed by the loan itself: one moved away here stays alive, its id never reused
                fits = checked[older.loan] = lendable(older.layers, job.layers, n)
            if not fits:
                continue
            if older.loan.layers is older.layers:  # its own snapshot: only its shapes stay
                older.layers = shapes_only(older.layers)
            older.loan = job.loan
            self._writer.count("lent")

    def _held_estimate(self, ns_key: bytes, tokens: Sequence[int]) -> int:
        """Leading tokens of a checkpoint of ``tokens`` that will be in the store when the writer gets to it: the
        whole chunks it shares with an entry of the memory tier (one LMDB holds, or one queued before it). An
        estimate for the queue's accounting only, in memory on the caller's thread (issue 35 item 3: asking LMDB
        here, a hash and a read per chunk, was ~1/3 of the launcher's ``insert_cache`` at 8k tokens); the writer
        asks the store itself (``_to_host``)."""
        chunk = self.store.chunk_tokens
        return self.memory.common_prefix(ns_key, tokens) // chunk * chunk

    def _unqueued(self, job: "_WriteJob") -> None:
        with self._queued_lock:
            if job.share_bytes:  # its tenant's share of the queue: once (inline writes come here twice)
                left = self._tenant_queued.get(job.tenant, 0) - job.share_bytes
                if left > 0:
                    self._tenant_queued[job.tenant] = left
                else:
                    self._tenant_queued.pop(job.tenant, None)
                job.share_bytes = 0
            waiting = self._queued.get(job.ns_key)
            if waiting is not None:
                try:
                    waiting.remove(job)
                except ValueError:
                    pass
                if not waiting:
                    del self._queued[job.ns_key]

    def _write_many(self, jobs: list["_WriteJob"]) -> int:
        """The write-behind thread's batch: the checkpoints queued meanwhile in one LMDB transaction
        (``Store.put_many``); one the batch could not take (its lone put failed too) goes through :meth:`_write`,
        which tries it alone once more and reports why. Returns how many failed unexpectedly (logged)."""
        ready, alone = [], []
        for job in jobs:
            try:
                self._to_host(job, batch_held=self._batch_held(job, ready))
                ready.append(job)
            except Exception:  # its copy failed: _write tries again and reports it (its entry is released there)
                alone.append(job)
        try:
            outcomes = self.store.put_many([(job.ns_key, job.tokens, job.layers, job.options) for job in ready])
        except Exception:  # pragma: no cover - put_many answers per checkpoint; each alone then
            outcomes = [None] * len(ready)
        for job, outcome in zip(ready, outcomes):
            if isinstance(outcome, PutResult):
                self._written(job, outcome)
            else:
                alone.append(job)
        failed = 0
        for job in alone:
            try:
                self._write(job)
            except Exception:  # one checkpoint's unexpected failure never stops the rest of the batch
                failed += 1
                log.exception("spec-cache: checkpoint of %d tokens not stored", len(job.tokens))
        return failed

    def _write(self, job: "_WriteJob", stacklevel: int = 2) -> PutResult | None:
        """Put one checkpoint into LMDB (the write-behind thread, or the caller's); mark its memory entry durable."""
        try:
            result = self._put(job)
        except StoreUnavailable:  # the data file went away under us: the store logged it once; go on without it
            result = None
        except (StoreError, SchemaError, TypeError, ValueError) as exc:
            message = f"spec-cache: checkpoint of {len(job.tokens)} tokens not stored: {exc}"
            if threading.current_thread() is threading.main_thread() or stacklevel > 2:
                warnings.warn(message, CacheWarning, stacklevel=stacklevel)
            else:
                log.warning(message)
            result = None
        except BaseException:
            entry = job.entry
            if entry is not None:
                self.memory.mark_durable(entry)  # never in LMDB now: evictable
            raise
        return self._written(job, result)

    def _written(self, job: "_WriteJob", result: PutResult | None) -> PutResult | None:
        """After a checkpoint's put (``result`` None: not stored): its memory entry becomes evictable; the shared
        tier and ``then`` hear of it."""
        self._unqueued(job)
        entry = job.entry
        if entry is not None:
            self.memory.mark_durable(entry)  # held in LMDB now, or never will be: evictable either way
        if result is not None and self.shared is not None:
            self.shared.enqueue(result.entry, [job.drafter[0]] if job.drafter is not None else [], job.nbytes,
                                job.tenant or self.tenant_of(job.ns_key))
        if result is not None and job.then is not None:
            try:
                job.then(result)
            except Exception:  # pragma: no cover - a follower's failure never fails the checkpoint
                log.exception("spec-cache: a write's follow-up failed")
        return result

    def _put(self, job: "_WriteJob") -> PutResult:
        self._to_host(job)  # bytes still in MLX (deferred capture) come to the host here
        try:
            try:
                return self.store.put(job.ns_key, job.tokens, job.layers, **job.options)
            except ChunkNotCopied:  # a chunk the store held when the copy began is gone: copy every token
                self._to_host(job, full=True)
                return self.store.put(job.ns_key, job.tokens, job.layers, **job.options)
        except NamespaceNotRegistered:
            reg = self._namespaces.peek(job.ns_key)
            if reg is None:
                raise
            # gc, another process's repair or our own forgetting dropped the namespace row since we registered it
            self.store.register_namespace(job.ns_key, target=reg.target, prefix_namespace=reg.prefix,
                                          tenant=reg.tenant, tenant_id=reg.label)
            self._to_host(job, full=True)
            return self.store.put(job.ns_key, job.tokens, job.layers, **job.options)

    def _to_host(self, job: "_WriteJob", *, full: bool = False, batch_held: int = 0) -> None:
        """Copy a job's captured layers to host memory. Where that copy costs (``copies_bytes``: MLX's CUDA
        backend), only the tokens after the chunks the store already holds, or that a checkpoint before it in the
        same batch writes (``batch_held``), are copied and the put is told so (``copied_from``): a warm turn's
        checkpoint copies its new tokens, not its whole history. ``full``: every token (the put found a chunk
        gone since)."""
        with self._queued_lock:  # from here no later checkpoint lends it its arrays (``_lend``)
            job.started = True
            if job.captured is None:
                lent = job.loan is not None and job.loan.layers is not job.layers
                job.captured = on_loan(job.layers, job.loan.layers) if lent else job.layers
        start = 0
        if not full and copies_bytes() and _deferred(job.captured):
            try:
                start = max(self.store.held_tokens(job.ns_key, job.tokens, job.captured), batch_held)
            except StoreError:
                start = 0
        job.layers = host_layers(job.captured, start)
        job.copied_from = start

    def _batch_held(self, job: "_WriteJob", before: list["_WriteJob"]) -> int:
        """Tokens of ``job`` whose whole chunks a checkpoint queued before it in one batch writes first (same
        namespace, layers shaped alike): the common prefix, down to a chunk boundary. 0 unless host copies cost."""
        if not before or not copies_bytes():
            return 0
        return _common_chunks(job, before, self.store.chunk_tokens)

    def _flush_counters(self) -> None:
        try:
            self.store.flush()
        except StoreError as exc:
            log.warning("spec-cache: hit/miss counters not written: %s", exc)

    # --- restore ---------------------------------------------------------------------------------
    def restore(self, ns_key: bytes, tokens: Sequence[int], *, drafter_namespace: str | None = None,
                usable: Callable[[Any], bool] | None = None, next_token: int | None = None,
                target_only: Sequence[bytes] = ()) -> RestoredPrefix | None:
        """The longest usable stored prefix of ``tokens`` as mlx-lm caches (+ drafter row), or None.

        One call down through the tiers: the memory tier first; LMDB only for a longer usable prefix (or the same
        length with the drafter row the memory tier lacks); with a shared tier, when the local tiers do not cover
        every token, the shared tier for a longer prefix (verified, returned, promoted into LMDB in the
        background; ``drain()`` waits for that). ``usable(candidate)`` (fields ``length``, ``has_drafter``,
        ``minimum_reusable``) rejects prefixes the caller cannot continue from; tiers return only usable ones.
        A prefix restored from LMDB or the shared tier enters the memory tier.

        ``next_token``: the prompt's token after ``tokens`` (a caller looks up a prompt without its last token,
        which it must forward). An LMDB entry of exactly ``tokens + [next_token]``, the whole prompt an earlier
        request stored (a repeated question, another process's turn), then serves ``tokens`` by trimming its last
        token, target only, when every layer is trimmable, as the memory tier serves a shorter prefix of a longer
        entry (``_restore_whole``). Without it LMDB can serve only a shorter stored prefix.

        ``target_only``: other namespace keys whose target part this request may continue from (the members of its
        target-only namespace, :meth:`target_members`: the same target, adapters and KV options under another
        drafter, or none). When this namespace's memory tier and LMDB hold no prefix as long as the longest usable
        one among them, that one is restored instead, target only (``draft_checkpoint`` None: the engine opens
        the drafter row cold beside it); see :meth:`_restore_target_only`.
        """
        if self._closed:
            warnings.warn("spec-cache: the cache is closed; lookup treated as a miss", CacheWarning, stacklevel=2)
            return None
        if target_only:
            other = self._restore_target_only(ns_key, tokens, drafter_namespace, usable, next_token, target_only)
            if other is not None:
                return other
        mem = self.memory.lookup(ns_key, tokens, drafter_namespace=drafter_namespace, usable=usable)
        if mem is not None and mem.length == len(tokens) and (mem.has_drafter or drafter_namespace is None):
            return self._from_memory(mem, drafter_namespace)
        floor = (0, False) if mem is None else (mem.length, mem.has_drafter)

        def better(hit) -> bool:  # longer than the memory hit, or as long with the drafter row it lacks
            if (hit.length, bool(hit.has_drafter)) <= floor:
                return False
            return usable is None or usable(hit)

        if next_token is not None and floor[0] < len(tokens):
            try:  # index only: a stored prefix as long as ``tokens`` (with the drafter row, maybe) comes first
                probe = self.store.lookup(ns_key, tokens, drafter=drafter_namespace, usable=better)
            except StoreError:
                probe = None
            if probe is None or probe.length < len(tokens):
                whole = self._restore_whole(ns_key, tokens, int(next_token), better)
                if whole is not None:
                    return whole
        if self.shared is not None:
            local = floor[0]
            try:
                hit = self.store.lookup(ns_key, tokens, drafter=drafter_namespace, usable=better)
                local = max(local, 0 if hit is None else hit.length)
            except StoreError as exc:  # a damaged or refused lookup; a bug elsewhere is no miss
                warnings.warn(f"spec-cache: local lookup failed, asking the shared tier: {exc}", CacheWarning,
                              stacklevel=2)
            if local < len(tokens):
                restored = self._restore_shared(ns_key, tokens, drafter_namespace, local, better)
                if restored is not None:
                    return restored
        restored = self._restore_local(ns_key, tokens, drafter_namespace, better)
        if restored is not None:
            return restored
        return None if mem is None else self._from_memory(mem, drafter_namespace)

    def target_members(self, target_identity: str, target_namespace: str, tenant: str | bytes | None = None,
                       ) -> list[bytes]:
        """The namespace keys (under ``tenant``) of every prefix namespace of ``target_identity`` whose target part
        is ``target_namespace`` (``naming.namespace.target_namespace_of``): the keys ``restore(target_only=...)``
        may take a target prefix from (issue 38). Found among this process's registrations and the store's
        ``nsinfo`` rows (any process, any version: a store written before the target-only namespace serves it
        too), re-read at most every ``MEMBERS_TTL_S``. Keys never cross tenants: each member's key is made with
        ``tenant``, so another tenant's prefixes stay invisible. Never raises for the store (a failure: the
        members this process knows)."""
        from spec_cache.naming.namespace import target_namespace_of

        cached = self.__dict__.setdefault("_members", {})
        now = time.monotonic()
        known = cached.get(target_identity)
        if (known is None or now - known[0] > MEMBERS_TTL_S) and not self._closed:
            try:
                known = (now, self.store.prefix_namespaces(target_identity))
            except StoreError as exc:
                log.warning("spec-cache: target-only members not read from the store: %s", exc)
                known = (now, set() if known is None else known[1])
            cached[target_identity] = known
        prefixes = set(known[1]) if known is not None else set()
        prefixes.update(reg.prefix for reg in self._namespaces.values() if reg.target == target_identity)
        return [namespace_key(target_identity, prefix, tenant) for prefix in sorted(prefixes)
                if target_namespace_of(prefix) == target_namespace]

    def _restore_target_only(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None, usable,
                             next_token: int | None, members: Sequence[bytes]) -> RestoredPrefix | None:
        """The longest usable target prefix among ``members`` (memory tier and LMDB of each), restored target only,
        when it is longer than anything ``ns_key``'s own memory tier and LMDB hold (its drafter part or not); else
        None (the caller's own lookup runs). Index and memory probes first (no read, no counter), then one restore.

        Why a lookup across keys and not a second copy under one target-only key: the store roots every chunk
        chain at its namespace key (``store.keys.root_key``), so a copy of each checkpoint's target part under a
        target-only key would share no chunk with the drafter namespace's and double every stored byte. Each
        checkpoint is written once, under its own prefix namespace (the seed's string, unchanged); the target-only
        namespace names the set of namespaces whose target parts are interchangeable, and this reads them."""
        own = self._held_length(ns_key, tokens, drafter_namespace, usable, next_token)
        if own >= len(tokens):
            return None

        def longer(hit) -> bool:
            return hit.length > own and (usable is None or usable(hit))
        best: tuple | None = None  # (length, key, how)
        for key in members:
            if key == ns_key:
                continue
            mem = self.memory.lookup(key, tokens, usable=longer, count=False)
            if mem is not None and (best is None or mem.length > best[0]):
                best = (mem.length, key, mem)
            try:
                hit = self.store.lookup(key, tokens, usable=longer)
            except StoreError:
                hit = None
            if hit is not None and (best is None or hit.length > best[0]):
                best = (hit.length, key, "local")
            if next_token is not None and (best is None or best[0] < len(tokens)) and \
                    self._whole_held(key, tokens, next_token, longer):
                best = (len(tokens), key, "whole")
        if best is None:
            return None
        length, key, how = best
        if isinstance(how, MemoryHit):
            self.memory.counters["hits"] += 1
            return self._from_memory(how, None)
        if how == "whole":
            got = self._restore_whole(key, tokens, int(next_token), longer)
            if got is not None:
                return got
        return self._restore_local(key, tokens, None, lambda hit: hit.length >= min(length, len(tokens))
                                   and longer(hit))

    def _held_length(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None, usable,
                     next_token: int | None) -> int:
        """How many tokens ``ns_key``'s memory tier and LMDB could restore (index and memory only; no counter)."""
        mem = self.memory.lookup(ns_key, tokens, drafter_namespace=drafter_namespace, usable=usable, count=False)
        held = 0 if mem is None else mem.length
        if held >= len(tokens):
            return held
        try:
            hit = self.store.lookup(ns_key, tokens, drafter=drafter_namespace, usable=usable)
        except StoreError:
            hit = None
        held = max(held, 0 if hit is None else hit.length)
        if held < len(tokens) and next_token is not None and self._whole_held(
                ns_key, tokens, next_token, lambda hit: usable is None or usable(hit)):
            held = len(tokens)
        return held

    def _whole_held(self, ns_key: bytes, tokens: Sequence[int], next_token: int, better) -> bool:
        """Whether LMDB's index has an entry of exactly ``tokens + [next_token]`` that ``_restore_whole`` could
        trim to ``tokens`` (``better`` accepting the trimmed prefix)."""
        length = len(tokens)

        def exactly(hit) -> bool:
            trimmed = SimpleNamespace(length=length, has_drafter=False,
                                      minimum_reusable=getattr(hit, "minimum_reusable", 0) or 0)
            return hit.length == length + 1 and trimmed.minimum_reusable <= length and better(trimmed)
        try:
            return self.store.lookup(ns_key, [int(t) for t in tokens] + [int(next_token)], usable=exactly) is not None
        except StoreError:
            return False

    def _restore_whole(self, ns_key: bytes, tokens: Sequence[int], next_token: int, better) -> RestoredPrefix | None:

        """``tokens`` from an LMDB entry of exactly ``tokens + [next_token]``, its last token trimmed (target only;
        None unless such an entry exists, ``better`` accepts the trimmed prefix and every layer is trimmable).
        The index is probed first (no read, no miss counted) so a prompt without such an entry costs one walk."""
        length = len(tokens)
        whole = [int(t) for t in tokens] + [next_token]

        def exactly(hit) -> bool:
            trimmed = SimpleNamespace(length=length, has_drafter=False,
                                      minimum_reusable=getattr(hit, "minimum_reusable", 0) or 0)
            return hit.length == length + 1 and trimmed.minimum_reusable <= length and better(trimmed)
        try:
            if self.store.lookup(ns_key, whole, usable=exactly) is None:
                return None
        except StoreError:
            return None
        got = self._restore_local(ns_key, whole, None, exactly)
        if got is None or not all(_trimmable(c) for c in got.caches):
            return None
        for c in got.caches:
            c.trim(1)
        return RestoredPrefix(length, got.caches, None, got.warnings, tier=got.tier)

    def _from_memory(self, hit, drafter_namespace: str | None) -> RestoredPrefix:
        caches, checkpoint = self.memory.take(hit, drafter_namespace)
        return RestoredPrefix(hit.length, caches, checkpoint, [], tier="memory")

    def _restore_local(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None, usable,
                       ) -> RestoredPrefix | None:
        notes: list[str] = []
        try:
            restored = self.store.fetch(ns_key, tokens, drafter=drafter_namespace, warnings=notes, usable=usable,
                                        concat=restore_concat())
        except (StoreError, SchemaError) as exc:  # damaged or refused (never a bug's ValueError: issue 34)
            warnings.warn(f"spec-cache: lookup failed, treated as a miss: {exc}", CacheWarning, stacklevel=3)
            return None
        for message in notes:
            warnings.warn(f"spec-cache: {message}", CacheWarning, stacklevel=3)
        if restored is None:
            return None
        return self._rebuild(ns_key, tokens, restored.length, restored.layers, restored.attachment,
                             drafter_namespace, list(restored.warnings), "local",
                             getattr(restored, "minimum_reusable", None))

    def _restore_shared(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None, floor: int,
                        usable) -> RestoredPrefix | None:
        """A prefix longer than ``floor`` from the shared tier, promoted into the local store; None otherwise.

        A prefix ``prefetch_shared`` fetched for these tokens is taken first; inside ``shared_via_prefetch()``
        that is the only source (this thread never waits on the network)."""
        notes: list[str] = []
        try:
            packed = pack_tokens(tokens)
        except StoreError as exc:
            warnings.warn(f"spec-cache: lookup failed, treated as a miss: {exc}", CacheWarning, stacklevel=3)
            return None
        handoff = self.__dict__.get("_shared_handoff")
        got = None if handoff is None else handoff.take(
            ns_key, drafter_namespace, packed, lambda hit: (hit.length, hit.has_drafter) > (floor, False)
            and (usable is None or usable(hit)))
        if got is not None:
            self.shared.health.add("prefetch_used")
        elif id(self) in getattr(_via_prefetch, "caches", ()):
            return None  # fetched ahead (or not at all) by ``prefetch_shared``: never on this thread
        else:
            got = self._fetch_shared(ns_key, packed, drafter_namespace, floor, usable, notes, None)
        for message in notes:
            warnings.warn(f"spec-cache: {message}", CacheWarning, stacklevel=3)
        if got is None:
            return None
        restored = self._rebuild(ns_key, tokens, got.length, got.layers, got.attachment, drafter_namespace, notes,
                                 "shared", got.minimum_reusable)
        if restored is not None:
            tenant = self.tenant_of(ns_key)
            job = (ns_key, packed[:got.length], got, drafter_namespace, tenant)
            queued, dropped = self._promote_shares.offer(self._promoter, job, got.nbytes, tenant, lambda j: j[4])
            for _ in range(dropped + (not queued)):
                self.shared.health.add("promote_dropped")
        return restored

    def _fetch_shared(self, ns_key: bytes, packed, drafter_namespace: str | None, floor: int, usable,
                      notes: list[str], deadline: float | None):
        """``SharedTier.restore``, never raising: an unexpected failure is a miss noted in ``notes``."""
        try:
            return self.shared.restore(ns_key, packed, chunk_tokens=self.store.chunk_tokens,
                                       drafter=drafter_namespace, floor=floor, warnings=notes, usable=usable,
                                       deadline=deadline)
        except Exception as exc:  # the last line of defence: a value from the network must never stop a request
            log.exception("spec-cache: shared tier lookup failed unexpectedly")
            self.shared.health.add("errors")
            notes.append(f"shared tier lookup failed unexpectedly ({type(exc).__name__}: {exc}), treated as a miss")
            return None

    def prefetch_shared(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None = None,
                        deadline: float | None = None, *, usable: Callable[[Any], bool] | None = None) -> bool:
        """Fetch from the shared tier, on the calling thread, a prefix of ``tokens`` longer than LMDB holds, and
        hold it (verified host arrays, ``shared_prefetch.Handoff``) for the next ``restore`` of these tokens. For
        a caller whose restores must not wait on the network (the server's scheduler: its prefetch pool calls
        this before a job is admitted, its own restores run inside ``shared_via_prefetch()``).

        ``deadline`` (``time.monotonic()``) ends the lookup early if it comes before ``lookup_budget_s``;
        ``usable`` is the restore's rule (``Generator.usable_rule``). True if a prefix is held. Thread-safe; never
        raises (failures are misses, logged).
        """
        if self.shared is None or self._closed:
            return False
        try:
            packed = pack_tokens(tokens)
            hit = self.store.lookup(ns_key, packed, drafter=drafter_namespace, usable=usable)
        except StoreError as exc:  # a damaged or refused lookup; a bug elsewhere is no miss
            log.warning("spec-cache: shared prefetch skipped, the local lookup failed: %s", exc)
            return False
        floor = 0 if hit is None else hit.length
        if floor >= len(packed):
            return False  # LMDB covers every token: the shared tier cannot add anything
        self.shared.health.add("prefetches")
        notes: list[str] = []
        got = self._fetch_shared(ns_key, packed, drafter_namespace, floor, usable, notes, deadline)
        for message in notes:
            log.warning("spec-cache: %s", message)
        if got is None:
            return False
        handoff = self.__dict__.get("_shared_handoff")
        if handoff is None:
            with _HANDOFF_LOCK:
                handoff = self.__dict__.setdefault("_shared_handoff", Handoff(self.shared.config.queue_bytes))
        if not handoff.put(ns_key, drafter_namespace, packed[:got.length], got, self.tenant_of(ns_key)):
            return False
        self.shared.health.add("prefetch_hits")
        return True

    @contextlib.contextmanager
    def shared_via_prefetch(self):
        """Within this block, restores on this thread take shared-tier prefixes only from ``prefetch_shared``
        and never send a request to the shared tier themselves."""
        caches = getattr(_via_prefetch, "caches", None)
        if caches is None:
            caches = _via_prefetch.caches = set()
        added = id(self) not in caches
        caches.add(id(self))
        try:
            yield self
        finally:
            if added:
                caches.discard(id(self))

    def drop(self, ns_key: bytes, tokens: Sequence[int]) -> bool:
        """Remove the checkpoint of exactly ``tokens`` from the memory tier (the entry that serves them) and LMDB
        (as a corrupt record is: hidden from lookups where the store is read-only); True if any tier held it.
        Why: an entry that fails the engine step it is restored into (``serve``'s fault isolation) would fail
        every later request restoring it. The shared tier keeps its copy (its entries are verified, not
        deletable from here); a write of it still queued lands after this."""
        tokens = [int(t) for t in tokens]
        served = self.memory.serving(ns_key, tokens)
        held = served is not None and self.memory.discard(ns_key, np.frombuffer(served[0], dtype=np.uint32))
        if self._closed:
            return held
        key = self.store.entry_key(ns_key, tokens)
        if key is not None:
            self.store.drop_entry(key)
        return held or key is not None

    # --- cache controls (``spec_cache.tiers.cache_controls``; ``serve``'s /v1/cache/...) ----------------------------
    def pin(self, ns_key: bytes, tokens: Sequence[int], ttl_s: float, **options):
        """Keep the longest stored prefix of ``tokens`` from eviction (memory tier and LMDB) for ``ttl_s`` s."""
        from spec_cache.tiers import cache_controls
        return cache_controls.pin(self, ns_key, tokens, ttl_s, **options)

    def unpin(self, pin_id: str, **options):
        """End a pin now (``cache_controls.unpin``)."""
        from spec_cache.tiers import cache_controls
        return cache_controls.unpin(self, pin_id, **options)

    def prefetch(self, ns_key: bytes, tokens: Sequence[int], **options):
        """Bring the longest stored prefix of ``tokens`` into the memory tier now (``cache_controls.prefetch``)."""
        from spec_cache.tiers import cache_controls
        return cache_controls.prefetch(self, ns_key, tokens, **options)

    def _promote(self, job) -> None:
        """Background: store a prefix restored from the shared tier through the store's own write path."""
        ns_key, packed, got, drafter_namespace, tenant = job
        drafter = (drafter_namespace, got.attachment) if got.attachment is not None else None
        try:
            self.store.put(ns_key, packed, got.layers, drafter=drafter, minimum_reusable=got.minimum_reusable)
            self.shared.health.add("promoted")
        except StoreUnavailable:  # logged once by the store
            self.shared.health.add("promote_failed")
        except (StoreError, SchemaError, TypeError, ValueError) as exc:
            self.shared.health.add("promote_failed")
            log.warning("spec-cache: prefix from the shared tier used but not stored locally: %s", exc)
        finally:
            self._promote_shares.finished(tenant, got.nbytes)

    def _rebuild(self, ns_key: bytes, tokens, length: int, layers, attachment, drafter_namespace, notes: list[str],
                 tier: str, minimum_reusable: int | None) -> RestoredPrefix | None:
        """mlx-lm caches (+ drafter row) from restored layers; they enter the memory tier (as durable when they
        came from LMDB), and the row gets its own array objects over them."""
        try:
            caches = restore_caches(layers)
            cp = None
            if attachment is not None:
                cp = checkpoint_from_store(length, attachment)
        except (RestoreRefused, SchemaError, StoreError) as exc:  # named where stored bytes are read (issue 34)
            warnings.warn(f"spec-cache: stored state could not be rebuilt, treated as a miss: {exc}", CacheWarning,
                          stacklevel=4)
            return None
        if minimum_reusable is None:
            try:
                minimum_reusable = converted_at(caches) or 0
            except ValueError:
                minimum_reusable = 0
        try:
            entry = self.memory.put(ns_key, list(tokens[:length]), caches, drafter_namespace=drafter_namespace,
                                    draft_checkpoint=cp, minimum_reusable=minimum_reusable,
                                    durable=True)  # LMDB or the shared tier holds it already
        except (TypeError, ValueError):
            entry = None
        if entry is not None:  # hand out new objects over the held arrays, as a memory hit does
            hit = MemoryHit(length, cp is not None, minimum_reusable, entry)
            caches, cp = self.memory.take(hit, drafter_namespace)
        return RestoredPrefix(length, caches, cp, notes, tier=tier)


#: how long ``SpecCache.target_members`` trusts the store's namespace rows it read (other processes register too)
MEMBERS_TTL_S = 2.0


def _trimmable(cache) -> bool:
    """Whether an mlx-lm cache can drop its last tokens (KV and quantized KV; not a ring buffer past its size, a
    recurrent state or a drafter's hidden vectors)."""
    check = getattr(cache, "is_trimmable", None)
    return bool(check()) if callable(check) else False


@dataclass
class _WriteJob:
    """A checkpoint on its way to LMDB: the captured layers (host views) and its memory-tier entry."""

    ns_key: bytes
    tokens: list[int]
    layers: list
    drafter: tuple | None
    minimum_reusable: int
    entry_ref: Any  # a weak reference to its memory-tier entry (None: none): ``entry``
    then: Callable[[PutResult], None] | None = None  # after the commit (``save``'s ``then``)
    rider: Callable[[Any], None] | None = None  # rows in the put's own transaction (``save``'s ``rider``)
    captured: list | None = None  # the layers as captured (bytes maybe still in MLX), kept for a full copy
    copied_from: int = 0  # the host copy in ``layers`` starts here along the token axis (``_to_host``)
    tenant: bytes = b""  # the tenant its queued bytes count against (``SpecCache.tenant_of``)
    share_bytes: int = 0  # its bytes in its tenant's share of the write queue until it leaves the queue
    started: bool = False  # the writer began its host copy: its layers are its own from then on (``_lend``)
    loan: Any = None  # the ``_Loan`` whose arrays it reads (its own layers', until a later checkpoint lends its)
    packed: np.ndarray | None = None  # ``tokens`` as uint32 (``save`` has them so): ``token_array``

    def token_array(self) -> np.ndarray:
        """Its tokens as a uint32 array, made once (``_lend`` compares them on the scheduler's thread: converting
        a 15k-token list costs ~0.5 ms, comparing two arrays microseconds)."""
        if self.packed is None:
            self.packed = np.asarray(self.tokens, dtype=np.uint32)
        return self.packed

    @property
    def entry(self) -> Any:
        """Its memory-tier entry while anyone holds it (None once gone). Weak: an entry a later checkpoint
        superseded (``MemoryTier._supersede``) must take its snapshot with it, not stay alive in the queue."""
        return None if self.entry_ref is None else self.entry_ref()

    @property
    def options(self) -> dict:
        """The keywords of its ``Store.put``."""
        return dict(drafter=self.drafter, minimum_reusable=self.minimum_reusable, rider=self.rider,
                    copied_from=self.copied_from)

    @property
    def nbytes(self) -> int:
        n = sum(layer.nbytes for layer in self.layers)
        if self.drafter is not None:
            n += sum(t.nbytes for t in self.drafter[1].tensors)
        return n

    def tail_bytes(self, held: int) -> int:
        """Bytes of the checkpoint after its first ``held`` tokens (the token-sliceable layers' share of them; other
        layers and the drafter's tensors whole): what its write copies and stores when the store holds those."""
        total = len(self.tokens)
        n = 0
        for layer in self.layers:
            if layer.token_axis is None or total == 0:
                n += layer.nbytes
            else:
                n += layer.nbytes * (total - min(held, total)) // total
        if self.drafter is not None:
            n += sum(t.nbytes for t in self.drafter[1].tensors)
        return n


def _common_chunks(job: _WriteJob, before, chunk: int) -> int:
    """The longest prefix of ``job``'s tokens, down to a chunk boundary, that a checkpoint in ``before`` shares with
    it (same namespace, layers shaped alike): those chunks are written by that one first."""
    if not before:
        return 0
    shape = None
    mine = np.asarray(job.tokens, dtype=np.int64)
    best = 0
    for other in before:
        if other is job or other.ns_key != job.ns_key:
            continue
        if shape is None:
            shape = _layer_shapes(job.captured or job.layers)
        if _layer_shapes(other.captured or other.layers) != shape:
            continue
        n = min(len(job.tokens), len(other.tokens))
        differ = np.flatnonzero(mine[:n] != np.asarray(other.tokens[:n], dtype=np.int64))
        common = int(differ[0]) if differ.size else n
        best = max(best, common // chunk * chunk)
    return best


class _Loan:
    """The arrays a group of queued checkpoints of one row read: those of the newest checkpoint (``_lend``)."""

    __slots__ = ("layers",)

    def __init__(self, layers: list) -> None:
        self.layers = layers


def _deferred(layers) -> bool:
    """Whether any tensor's bytes are still in MLX (a deferred capture)."""
    return any(not isinstance(t.data, np.ndarray) for layer in layers for t in layer.tensors)


def _layer_shapes(layers) -> list:
    """Kinds, dtypes and shapes without the token axis: what makes two checkpoints' chunks interchangeable."""
    return [(layer.kind, layer.token_axis, [(t.dtype, tuple(d for a, d in enumerate(t.shape)
                                                         if a != layer.token_axis)) for t in layer.tensors])
            for layer in layers]
