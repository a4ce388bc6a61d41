"""``Store``: checkpoints of token prefixes in one LMDB environment (the store's ``Cache``).

Why one file: ``Store`` is the one object that opens the environment's transactions; the steps themselves live in
``write``, ``index``, ``lookup`` and ``read`` (below).

A checkpoint is the target's per-layer state after a token prefix plus, optionally, one drafter's row
checkpoint, under a 32-byte namespace key. Token-sliceable layers (KV, quantized KV) are split into fixed
chunks shared by every prompt with the same prefix; the rest of the state (the tail past the last full chunk,
layers that cannot be trimmed, drafter attachments) lives in an exact-boundary entry. One put is one LMDB
write transaction; one fetch reads everything it returns inside one read transaction.

Costs: a lookup hashes the prompt once (about 1 µs per 256 tokens) and does one B-tree get per matched chunk
plus one per candidate tail length, independent of how many entries the store holds.

One checkpoint through this module: ``write.prepare_checkpoint`` (check, key, encode) -> ``Store._commit``
(one transaction in which ``index.Index`` keeps every count) -> ``lookup.lookup`` (candidates ranked by
``candidates``, filtered by the caller's ``usable``) -> ``read.read_layers`` (verified records, assembled).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import lmdb
import numpy as np

from spec_cache.schemas import CheckpointAttachment

from . import continuations
from . import keys as K
from .candidates import Hit, Usable
from .codec import CorruptRecord
from .directory import KEEP_ASIDE
from .env import Environment, open_environment
from .errors import CorruptIndex, InvalidInput, StoreError, StoreFullError, StoreUnavailable
from .eviction import TenantPolicy, check_alone, enforce, evict_lru
from .index import Index, draft_key, now_ns
from .leases import Leases
from .lookup import lookup
from .read import ASYNC_VERIFY_BYTES, BackgroundVerifier, Concat, piece_reader, read_attachment, read_layers
from .tensors import LayerState
from .values import Entry, NamespaceInfo, decode_typed
from .write import Checkpoint, layer_signature, prepare_checkpoint

__all__ = ["Store", "StoreMemo", "Hit", "Usable", "Restored", "PutResult", "Rider", "ASYNC_VERIFY_BYTES"]

log = logging.getLogger("spec_cache.store")
FLUSH_EVERY = 64
FLUSH_SECONDS = 5.0  # access times and hit counters ride in the next put; a timed flush is a commit of its own
_RECORD_DB = {"chunk": "chunks", "entry": "edata", "draft": "drafts", "piece": "drafts"}  # kind -> sub-database
#: rows written in a checkpoint's own transaction (``Store.put``'s ``rider``): called with an LMDB write transaction
Rider = Callable[[object], None]


@dataclass
class Restored:
    """State read back for a hit: per-layer target state and this drafter's checkpoint (or None)."""

    length: int                              # tokens of the prompt the state covers
    layers: list[LayerState]                 # the target's per-layer state, in layer order
    attachment: CheckpointAttachment | None  # the drafter's part, or None (not asked, not stored, or skipped)
    entry: bytes | None                      # entry key, or None for a chunk-boundary prefix
    warnings: list[str] = field(default_factory=list)  # what went wrong on the way (dropped records, ...)
    minimum_reusable: int = 0                # shortest prefix of it a restore may use (the hit's)


@dataclass(frozen=True)
class PutResult:
    """What a put wrote."""

    entry: bytes           # the entry key (what ``SharedTier.enqueue`` publishes)
    bytes_written: int     # bytes of the records written: new chunks, the entry record, the drafter record
    new_chunks: int        # chunk records written (the others were shared with stored prefixes)
    evicted: int           # entries evicted to stay within ``max_bytes``


class Store:
    """A spec-cache store in one directory. Thread-safe for use from one process; many processes may share
    a directory (LMDB's locking). Use as a context manager or call ``close()``."""

    def __init__(self, env: Environment, max_bytes: int | None):
        self.env = env
        self.max_bytes = max_bytes
        self._lock = threading.RLock()  # writers of this process, one at a time (readers need none: ``reading``)
        self._pending_lock = threading.Lock()  # the batched access times and counters below
        self._touched: dict[bytes, int] = {}
        self._counts: dict[bytes, list[int]] = {}  # ns -> [hits, misses]
        self._pending = 0
        self._last_flush = time.monotonic()
        self._bad: set[bytes] = set()  # corrupt keys this process could not drop (read-only store): hidden
        self._verifier = BackgroundVerifier()  # checksums large records while fetch copies them out
        self.tenants = TenantPolicy()  # per-tenant quota (``open``'s tenant_quota_bytes / tenant_share)
        self.leases = Leases()  # entries eviction skips while their lease lasts (``/v1/cache/pin``)

    # --- open / close ------------------------------------------------------------------------------
    @classmethod
    def open(cls, path, *, max_bytes: int | None = None, readonly: bool = False, durable: bool = True,
             chunk_tokens: int | None = None, map_size: int | None = None, tenant_quota_bytes: int | None = None,
             tenant_share: float | None = None, on_damage: str = "refuse", keep_aside: int = KEEP_ASIDE) -> "Store":
        """Open (creating if needed) the store in directory ``path``.

        ``max_bytes`` caps stored bytes (LRU eviction on put) and is recorded in the store's ``meta`` (``budget``)
        so ``spec-cache stats`` shows it; ``durable=False`` skips fsync per commit. ``tenant_quota_bytes`` /
        ``tenant_share`` (a fraction of ``max_bytes``) cap each tenant's bytes (``eviction.py``: over its quota a
        tenant evicts its own entries; over ``max_bytes`` the tenant most over its fair share goes first).
        Raises ``StoreOpenError``/``StoreFormatError`` with a message naming the directory; ``StoreUnsafe`` for a
        read-write open of a directory another user owns or group/other may write (read-only opens are allowed).
        ``on_damage``: a store too damaged to open (``data.mdb`` truncated or empty) is refused (``"refuse"``, the
        default: ``StoreDamaged``, ``spec-cache repair`` salvages it) or moved aside to ``<path>.damaged-<time>``
        with a fresh empty store opened in its place (``"move-aside"``: a server starts cold instead of not at
        all; at most ``keep_aside`` copies, the newest, are kept, and none takes the disk room ``max_bytes``
        needs: ``directory.prune_aside``). A store damaged while open raises ``StoreUnavailable`` (a miss to the
        runtime), never SIGBUS.
        """
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise InvalidInput("max_bytes must be a positive int or None")
        policy = TenantPolicy.of(tenant_quota_bytes, tenant_share, max_bytes)
        env = open_environment(path, on_damage=on_damage, readonly=readonly, durable=durable, map_size=map_size,
                               chunk_tokens=chunk_tokens, keep_aside=keep_aside, aside_budget=max_bytes)
        if max_bytes is not None and not readonly:
            try:
                env.record_budget(max_bytes)  # stored with the store, so ``stats`` can show it later
            except BaseException:
                env.close()
                raise
        store = cls(env, max_bytes)
        store.tenants = policy
        return store

    @property
    def path(self) -> str:
        return self.env.path

    @property
    def chunk_tokens(self) -> int:
        return int(self.env.meta["chunk_tokens"])

    @property
    def readonly(self) -> bool:
        """Whether this handle was opened read-only (every write is skipped or refused)."""
        return self.env.readonly

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (every read and write of this handle fails from then on)."""
        return self.env.env is None

    def close(self) -> None:
        if self.env.env is not None:
            if not self.env.readonly:
                self.flush_best_effort()
            self.env.close()
            self.env.env = None
        self._verifier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- namespaces --------------------------------------------------------------------------------
    def register_namespace(self, ns_key: bytes, *, target: str, prefix_namespace: str, tenant: bool = False,
                           tenant_id: bytes | None = None) -> None:
        """Record what a namespace key stands for (shown by ``ls``/``show``); idempotent. ``tenant_id``
        (``keys.tenant_id``) is the label its bytes are counted under for quotas (None: the default tenant)."""
        self.env.write(lambda txn: Index(txn, self.env.dbs).register_namespace(
            ns_key, target=target, prefix_namespace=prefix_namespace, tenant=tenant, tenant_id=tenant_id))

    def forget_empty_namespaces(self, ns_keys: Sequence[bytes]) -> list[bytes]:
        """Delete the namespace rows among ``ns_keys`` that hold nothing: no entry, no byte, no chain root, no
        continuation record naming them, in one transaction; returns the keys whose row is gone now. A process
        that writes under a forgotten key later registers it again (``SpecCache`` does so on
        ``NamespaceNotRegistered``). Why: one row per ``cache_salt`` ever seen grew the store without bound outside
        its byte budget (issue 37, sixth pass); ``SpecCache`` calls this for the namespaces it stops tracking."""
        if self.env.readonly or not ns_keys:
            return []

        def fn(txn):
            index = Index(txn, self.env.dbs)
            named = continuations.namespaces_with_records(txn, self.env.dbs)
            return [ns for ns in ns_keys if ns not in named and index.forget_namespace(ns)]
        with self._lock:
            return self.env.write(fn)

    def forget_empty_tenant_namespaces(self) -> list[bytes]:
        """``forget_empty_namespaces`` over every tenant namespace row (``tenant``: a request named it, not the
        configuration): one pass over the ``nsinfo`` rows and one transaction; returns the keys whose row is gone.
        Why: a process forgets only the namespaces it registered, so the empty rows of the ones still registered
        when it ended (up to ``max_namespaces``: a tenant's fresh ``cache_salt``s) stayed for good, as many more
        each restart (issue 37, eighth pass); ``SpecCache`` calls this when it opens the store. A process writing
        under a key whose row went meanwhile registers it again (``NamespaceNotRegistered``)."""
        if self.env.readonly:
            return []
        empty = []
        with self.reading() as txn:
            for key, raw in txn.cursor(db=self.env.dbs["nsinfo"]):
                try:
                    info = decode_typed("nsinfo", raw, bytes(key))
                except (CorruptIndex, InvalidInput, KeyError, TypeError):
                    continue  # left for ``gc``
                if info is not None and info.tenant and not (info.entries or info.bytes or info.signatures):
                    empty.append(bytes(key))
        return self.forget_empty_namespaces(empty)

    def namespace_info(self, ns_key: bytes) -> NamespaceInfo | None:
        """The namespace row of ``ns_key`` (what it stands for, its counters), or None if not registered."""
        with self.reading() as txn:
            return Index(txn, self.env.dbs).namespace(ns_key)

    def prefix_namespaces(self, target: str) -> set[str]:
        """The prefix namespaces registered under the target identity ``target``, any tenant (issue 38: the
        members of a target-only namespace). One pass over the ``nsinfo`` rows, which are few (one per
        (drafter, adapters, options, tenant) used); a damaged row is skipped (``verify`` reports it)."""
        found: set[str] = set()
        with self.reading() as txn:
            for key, raw in txn.cursor(db=self.env.dbs["nsinfo"]):
                try:
                    info = decode_typed("nsinfo", raw, bytes(key))
                except (CorruptIndex, InvalidInput, KeyError, TypeError):
                    continue
                if info is not None and info.target == target and isinstance(info.prefix_namespace, str):
                    found.add(info.prefix_namespace)
        return found

    @contextlib.contextmanager
    def reading(self):
        """A read transaction. It never waits for a write of this process (LMDB readers see a snapshot; a reader
        that waited for the write-behind thread's put cost the server's scheduler seconds, issue 35); LMDB map
        growth, which needs no transaction of the process open, waits for it instead (``TxnGate``)."""
        with self.env.read() as txn:
            yield txn

    # --- put ---------------------------------------------------------------------------------------
    def put(self, ns_key: bytes, tokens, layers: Sequence[LayerState], *,
            drafter: tuple[str, CheckpointAttachment] | None = None, minimum_reusable: int = 0,
            pin: bool = False, rider: Rider | None = None, copied_from: int = 0) -> PutResult:
        """Store the checkpoint of ``tokens`` in one transaction (all of it or none of it).

        Every layer with a ``token_axis`` must cover exactly ``len(tokens)`` tokens. ``drafter`` is
        ``(drafter namespace, attachment)``; the attachment is validated against its schema first.
        An exact duplicate replaces the old entry (its other drafters' parts and its pin stay).

        Raises ``NamespaceNotRegistered`` (an ``InvalidInput``) when ``register_namespace`` was not called for
        ``ns_key``, ``InvalidInput``, ``SchemaError``, ``StoreFullError`` (the checkpoint with its chunks is
        over ``max_bytes``, or does not fit next to the pinned entries); the store is unchanged then.
        ``rider(txn)`` writes rows of its own (a continuation record naming this state) in the checkpoint's
        transaction, after the checkpoint's rows: both are committed or neither, in one commit (each LMDB commit
        costs ~12 KiB of pages even for one small row: issue 21's write amplification). It runs in a child
        transaction: one that raises is undone alone (logged), the checkpoint is stored all the same.
        ``copied_from`` (a chunk boundary, at most :meth:`held_tokens`): the chunked layers' tensors hold real
        bytes only from that token on (a caller copying device memory to the host skips what the store holds);
        when a chunk before it turns out to be missing after all (evicted since), ``ChunkNotCopied`` is raised and
        nothing is written.
        Cost: one copy of the state into records, one write transaction (plus LRU eviction under a budget).
        """
        checkpoint = prepare_checkpoint(ns_key, tokens, layers, chunk_tokens=self.chunk_tokens, drafter=drafter,
                                        minimum_reusable=minimum_reusable, copied_from=copied_from)
        self._check_budget(checkpoint.own_bytes)
        return self._put_one(checkpoint, pin, rider)

    def held_tokens(self, ns_key: bytes, tokens, layers: Sequence[LayerState]) -> int:
        """How many leading tokens of ``tokens`` the store holds as whole chunks for layers shaped like
        ``layers`` (their signature: kinds, dtypes, shapes without the token axis; no byte of them is read), so a
        put of them may pass ``copied_from`` up to this. Index reads only: one hash and get per chunk."""
        packed = K.pack_tokens(tokens)
        signature, chunked = layer_signature(layers)
        if not chunked:
            return 0
        full = len(packed) // self.chunk_tokens
        chain = K.chain(K.root_key(ns_key, signature), packed, self.chunk_tokens, max_chunks=full)
        held = 0
        with self.reading() as txn:
            index = Index(txn, self.env.dbs)
            for key in chain[1:]:
                node = index.node(key)
                if node is None or node.broken or key in self._bad:
                    break
                held += 1
        return held * self.chunk_tokens

    def _put_one(self, checkpoint: Checkpoint, pin: bool, rider: Rider | None = None) -> PutResult:
        """One checkpoint in its own transaction; refused for the budget in the pieced layout (format 1.3: a chunk
        naming an earlier entry's pieces keeps them alive when that entry is evicted to make room), it is tried once
        more written whole, which needs no more than it does in an empty store."""
        try:
            return self._write_prepared([(checkpoint, pin, rider)])[0]
        except StoreFullError:
            if checkpoint.whole:
                raise
            checkpoint.whole = True
            return self._write_prepared([(checkpoint, pin, rider)])[0]

    def put_many(self, puts: Sequence[tuple]) -> list:
        """Several checkpoints in one transaction: each ``(ns_key, tokens, layers, options)`` with ``options`` the
        keywords :meth:`put` takes (``rider`` included: it rides in this one transaction). Returns, per checkpoint
        in order, its ``PutResult`` or the exception a lone ``put`` of it would have raised.

        Why: every LMDB commit rewrites the b-tree pages it touches in each sub-database plus a meta page (~40-60
        KiB whatever the checkpoint's size), so a conversation's several checkpoints a turn cost that several times
        (issue 21's write amplification). The outcome of each checkpoint is that of a lone put: when the batch's
        transaction fails (one checkpoint over the budget, a namespace gone...), nothing of it is kept and each
        checkpoint is put alone. Eviction under the budget runs after each checkpoint, as sequential puts do."""
        outcomes: list = [None] * len(puts)
        prepared: list[tuple[int, Checkpoint, bool, Rider | None]] = []
        for i, (ns_key, tokens, layers, options) in enumerate(puts):
            try:
                checkpoint = prepare_checkpoint(ns_key, tokens, layers, chunk_tokens=self.chunk_tokens,
                                                drafter=options.get("drafter"),
                                                minimum_reusable=options.get("minimum_reusable", 0),
                                                copied_from=options.get("copied_from", 0))
                self._check_budget(checkpoint.own_bytes)
                prepared.append((i, checkpoint, bool(options.get("pin", False)), options.get("rider")))
            except Exception as exc:  # this checkpoint alone is refused, as its own put would be
                outcomes[i] = exc
        if len(prepared) > 1:
            try:
                results = self._write_prepared([(checkpoint, pin, rider) for _, checkpoint, pin, rider in prepared])
            except Exception:  # the batch is undone whole: each checkpoint alone gets its own outcome
                results = None
            if results is not None:
                for (i, *_), result in zip(prepared, results):
                    outcomes[i] = result
                return outcomes
        for i, checkpoint, pin, rider in prepared:
            try:
                outcomes[i] = self._put_one(checkpoint, pin, rider)
            except Exception as exc:
                outcomes[i] = exc
        return outcomes

    def _write_prepared(self, checkpoints: list[tuple[Checkpoint, bool, Rider | None]]) -> list[PutResult]:
        """Commit prepared checkpoints in one transaction, with the batched access times and counters."""
        with self._lock:
            # batched access times and counters ride in the put's own transaction: one commit, not two (each
            # LMDB commit rewrites the b-tree pages it touches and a meta page, ~60-100 KB: write amplification)
            pending = self._take_pending()

            def fn(txn):
                _apply_pending(Index(txn, self.env.dbs), *pending)
                results = []
                for checkpoint, pin, rider in checkpoints:
                    results.append(self._commit(txn, checkpoint, pin))
                    if rider is not None:
                        self._ride(txn, rider)
                return results
            try:
                return self.env.write(fn, on_full=self._evict_for_space)
            except BaseException:
                self._restore_pending(pending)  # written by the next flush instead
                raise

    def _commit(self, txn, checkpoint: Checkpoint, pin: bool) -> PutResult:
        """The put's transaction: chain nodes and chunk records, the entry, then eviction under the budget."""
        index = Index(txn, self.env.dbs)
        chain = index.extend_chain(checkpoint.ns_key, checkpoint.signature, checkpoint.chain,
                                   complete=checkpoint.complete, minimum_reusable=checkpoint.minimum_reusable,
                                   chunk_record=lambda k: checkpoint.chunk_write(index, k))
        self._check_budget(checkpoint.own_bytes + chain.chain_bytes, " (with its chunks)")
        when = now_ns()
        entry = Entry(checkpoint.ns_key, checkpoint.length, checkpoint.chain[-1],
                      checkpoint.length - checkpoint.tail_start, when, when, bool(pin), 0, {},
                      checkpoint.minimum_reusable)
        draft = ((checkpoint.drafter, checkpoint.draft_record, checkpoint.draft_pieces)
                 if checkpoint.draft_record is not None else None)
        record, spans = checkpoint.entry_write(index)  # a tail cut into shared pieces (format 1.3, spans.py)
        written = index.add_entry(checkpoint.entry_key, entry, record, draft, spans)
        # the writer's tenant quota, then the budget by fair share (plain LRU without tenants); refusals abort
        evicted = enforce(index, checkpoint.ns_key, checkpoint.entry_key, max_bytes=self.max_bytes,
                          policy=self.tenants, new_bytes=checkpoint.own_bytes + chain.chain_bytes,
                          exclude=self.leases.held())
        return PutResult(checkpoint.entry_key, chain.written + written, chain.new_chunks, evicted)

    def _ride(self, txn, rider: Rider) -> None:
        """``rider(child)`` in a child transaction of the put's: undone alone when it raises (logged), except for
        a full or resized map, which the whole write handles (grown, then run again)."""
        child = self.env.env.begin(write=True, parent=txn, buffers=True)
        try:
            rider(child)
        except (lmdb.MapFullError, lmdb.MapResizedError):
            child.abort()
            raise
        except Exception as exc:  # a rider's rows never cost the checkpoint its commit
            child.abort()
            log.warning("rows riding with a checkpoint not written: %s", exc)
            return
        child.commit()

    def _check_budget(self, nbytes: int, what: str = "") -> None:
        check_alone(nbytes, self.max_bytes, what)

    def _evict_for_space(self) -> bool:
        """Called when the map cannot grow: evict one entry (``eviction.evict_lru``) in its own transaction."""
        try:
            held = self.leases.held()
            return self.env.write(lambda txn: evict_lru(Index(txn, self.env.dbs), held))
        except StoreFullError:
            return False

    # --- lookup and fetch --------------------------------------------------------------------------
    def lookup(self, ns_key: bytes, tokens, *, drafter: str | None = None, usable: Usable | None = None,
               ) -> Hit | None:
        """The longest stored prefix of ``tokens`` that ``usable(hit)`` accepts (any hit when None), stepping
        down through shorter entries and chunk boundaries; None on a miss. Index only: nothing is read or
        verified. Among hits of equal length one with ``drafter``'s part comes first.

        Raises ``CorruptIndex`` for a damaged index value met on the way. Cost: see the module docstring.
        """
        packed = K.pack_tokens(tokens)
        with self.reading() as txn:
            return self._lookup(txn, ns_key, packed, drafter, usable)

    def _lookup(self, txn, ns_key: bytes, packed: np.ndarray, drafter: str | None, usable: Usable | None = None,
                ) -> Hit | None:
        return lookup(Index(txn, self.env.dbs), ns_key, packed, self.chunk_tokens, drafter=drafter, usable=usable,
                      hidden=self._bad)

    def fetch(self, ns_key: bytes, tokens, *, drafter: str | None = None, usable: Usable | None = None,
              max_attempts: int = 3, warnings: list[str] | None = None, concat: Concat | None = None,
              ) -> Restored | None:
        """Look up and read back the longest prefix of ``tokens`` that ``usable(hit)`` accepts (any hit when
        None; see ``lookup``); None on a miss.

        Every record read is verified (``read.py``: checksum, kind, key, tokens, lengths); a corrupt record is
        dropped from the store, logged, and the lookup retried (a shorter prefix may still serve), up to
        ``max_attempts`` lookups. A drafter part with an unknown or invalid schema is skipped (target only).
        What went wrong is appended to ``warnings`` (when given; also on a miss) and to ``Restored.warnings``.

        ``concat(pieces, axis, dtype)`` builds a token-sliceable tensor from its pieces (numpy views into the
        map, valid only during the call: copy them) and returns what ``Tensor.data`` should hold; the default
        assembles one numpy array. The runtime passes one that copies straight into framework arrays, so a
        restore makes one copy out of the map instead of two.
        """
        packed = K.pack_tokens(tokens)
        warnings = [] if warnings is None else warnings
        for _ in range(max_attempts):
            try:  # outside the handle's lock: a restore never waits for a put of this process (``reading``)
                with self.env.read() as txn:
                    hit = self._lookup(txn, ns_key, packed, drafter, usable)
                    if hit is None:
                        self._count(ns_key, hit=False)
                        return None
                    restored = self._read(txn, hit, packed, drafter, warnings, concat)
            except CorruptRecord as exc:
                message = f"dropping corrupt record ({exc}); falling back to a shorter prefix"
                log.warning(message)
                warnings.append(message)
                with self._lock:
                    self._forget_corrupt(exc.key, exc.piece)
                continue
            self._count(ns_key, hit=True, entry=hit.entry)
            restored.warnings = warnings
            return restored
        self._count(ns_key, hit=False)
        return None

    def _read(self, txn, hit: Hit, packed: np.ndarray, drafter: str | None, warnings: list[str],
              concat: Concat | None = None) -> Restored:
        dbs = self.env.dbs

        def raw(kind: str, key: bytes):
            return txn.get(key, db=dbs[_RECORD_DB[kind]])
        layers = read_layers(raw, packed=packed, length=hit.length, chunk_tokens=self.chunk_tokens,
                             chain=hit.chain, entry=hit.entry, concat=concat, verifier=self._verifier)
        attachment = None
        if drafter is not None and hit.has_drafter:
            key = draft_key(hit.entry, drafter)
            attachment = read_attachment(raw("draft", key), key, hit.length, warnings, get_piece=piece_reader(raw))
        return Restored(hit.length, layers, attachment, hit.entry, minimum_reusable=hit.minimum_reusable)

    def _forget_corrupt(self, key: bytes | None, piece: bytes | None = None) -> None:
        """Drop a corrupt record from the store; if that is impossible (read-only), hide it from lookups. A
        damaged shared piece (format 1.3) it names loses its record too: the next put needing it writes it again."""
        if key is None:
            return
        self._bad.add(key)
        if self.env.readonly:
            return

        def drop(txn):
            index = Index(txn, self.env.dbs)
            index.drop_corrupt(key)
            if piece is not None:
                index.drop_piece_record(piece)
        try:
            self.env.write(drop, making_room=True)
        except StoreError as exc:
            log.warning("could not drop corrupt record %s: %s", key.hex()[:16], exc)
            return
        self._bad.discard(key)

    def drop_entry(self, key: bytes) -> None:
        """Remove entry ``key`` as a corrupt record is removed (hidden from lookups where the store is read-only);
        for an entry that is readable but must not be served again (it failed the step it was restored into).
        Never raises: a failed write is logged and the entry stays hidden from this handle's lookups."""
        with self._lock:
            self._forget_corrupt(key)

    # --- access times and counters (batched) -------------------------------------------------------
    def _count(self, ns_key: bytes, *, hit: bool, entry: bytes | None = None) -> None:
        """Batch a lookup's outcome (and the access time of the ``entry`` it hit). Due for a flush, it is written
        here only when no put of this process is under way: a put takes the batch into its own transaction."""
        with self._pending_lock:
            if entry is not None:
                self._touched[entry] = now_ns()
            c = self._counts.setdefault(ns_key, [0, 0])
            c[0 if hit else 1] += 1
            self._pending += 1
            due = self._pending >= FLUSH_EVERY or time.monotonic() - self._last_flush > FLUSH_SECONDS
        if due and self._lock.acquire(blocking=False):
            try:
                self.flush_best_effort()
            finally:
                self._lock.release()

    def _flush_pending(self) -> None:
        if not self._pending and not self._touched:
            return
        pending = self._take_pending()
        self.env.write(lambda txn: _apply_pending(Index(txn, self.env.dbs), *pending))

    def _take_pending(self) -> tuple[dict, dict]:
        """The batched access times and counters, handed over for writing (cleared here)."""
        with self._pending_lock:
            pending = self._touched, self._counts
            self._touched, self._counts, self._pending = {}, {}, 0
            self._last_flush = time.monotonic()
        return pending

    def _restore_pending(self, pending: tuple[dict, dict]) -> None:
        """Put back what a failed put did not write (newer access times and added counts win)."""
        touched, counts = pending
        with self._pending_lock:
            self._merge_pending(touched, counts)

    def _merge_pending(self, touched: dict, counts: dict) -> None:
        for key, when in touched.items():
            self._touched[key] = max(when, self._touched.get(key, when))
        for ns, (hits, misses) in counts.items():
            c = self._counts.setdefault(ns, [0, 0])
            c[0] += hits
            c[1] += misses
            self._pending += hits + misses

    def flush(self) -> None:
        """Write batched access times and hit/miss counters now."""
        if self.env.readonly:
            self.discard_pending()
            return
        with self._lock:
            self._flush_pending()

    def discard_pending(self) -> None:
        """Forget batched access times and hit/miss counters without writing them (``gc`` after damage)."""
        self._touched, self._counts, self._pending = {}, {}, 0

    def flush_best_effort(self) -> None:
        """Flush access times and counters, but never fail over them (a full store, a damaged entry): they are
        dropped with a log line instead."""
        try:
            self.flush()
        except StoreUnavailable:  # logged once where it was found; not again on every flush
            self.discard_pending()
        except StoreError as exc:
            log.warning("access times and hit/miss counters not written: %s", exc)

    # --- pinning -----------------------------------------------------------------------------------
    def pin(self, ns_key: bytes, tokens, pinned: bool = True) -> bool:
        """Pin (or unpin) the exact entry for ``tokens``; pinned entries are never evicted by the budget.
        False if there is no such entry."""
        packed = K.pack_tokens(tokens)

        def fn(txn):
            index = Index(txn, self.env.dbs)
            return any(index.set_pinned(key, pinned) for key in self._exact_keys(index, ns_key, packed))
        with self._lock:
            return self.env.write(fn, making_room=not pinned)

    def entry_key(self, ns_key: bytes, tokens) -> bytes | None:
        """The key of the entry for exactly ``tokens`` (what ``leases`` hold), or None if there is none."""
        packed = K.pack_tokens(tokens)
        with self.reading() as txn:
            index = Index(txn, self.env.dbs)
            return next((key for key in self._exact_keys(index, ns_key, packed) if index.entry(key) is not None),
                        None)

    def _exact_keys(self, index: Index, ns_key: bytes, packed):
        """The entry keys ``packed`` would have under each layer signature of the namespace."""
        chunk_tokens = self.chunk_tokens
        info = index.namespace(ns_key)
        for sig in info.signatures if info is not None else ():
            full = len(packed) // chunk_tokens if sig else 0
            chain = K.chain(K.root_key(ns_key, sig), packed, chunk_tokens, max_chunks=full)
            yield K.entry_key(chain[-1], packed[full * chunk_tokens:])

    # --- maintenance (see maintenance.py for evict/gc/verify) --------------------------------------
    def memo(self) -> "StoreMemo":
        """An artifact-identity memo kept in this store (``spec_cache.naming.identity`` takes it as ``memo``)."""
        return StoreMemo(self)


def _apply_pending(index: Index, touched: dict, counts: dict) -> None:
    """Write batched access times and hit/miss counters through ``index`` (inside a write transaction)."""
    for key, when in touched.items():
        with contextlib.suppress(CorruptIndex):  # a damaged entry is gc's to remove
            index.touch(key, when)
    for ns, (hits, misses) in counts.items():
        with contextlib.suppress(CorruptIndex):
            index.add_ns(ns, hits=hits, misses=misses, last_use=now_ns() if hits else None)


class StoreMemo:
    """``get``/``put`` of artifact-identity digests in the store's ``memo`` sub-database."""

    def __init__(self, store: Store):
        self.store = store

    def get(self, key: str) -> str | None:
        try:
            with self.store.env.read() as txn:
                raw = txn.get(key.encode(), db=self.store.env.dbs["memo"])
                return None if raw is None else bytes(raw).decode("ascii", "replace")
        except Exception:
            return None

    def put(self, key: str, digest: str) -> None:
        if self.store.env.readonly:
            return
        try:
            self.store.env.write(lambda txn: txn.put(key.encode(), digest.encode(), db=self.store.env.dbs["memo"]))
        except Exception:
            pass
