"""``Store``: checkpoints of token prefixes in one LMDB environment (the store's ``Cache``).

A checkpoint is the target's per-layer state after a token prefix plus, optionally, one drafter's row
checkpoint, under a 32-byte namespace key. Token-sliceable layers (KV, quantized KV) are split into fixed
chunks shared by every prompt with the same prefix; the rest of the state (the tail past the last full chunk,
layers that cannot be trimmed, drafter attachments) lives in an exact-boundary entry. One put is one LMDB
write transaction; one fetch reads everything it returns inside one read transaction.

Costs: a lookup hashes the prompt once (about 1 µs per 256 tokens) and does one B-tree get per matched chunk
plus one per candidate tail length, independent of how many entries the store holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from spec_cache.schemas import CheckpointAttachment, SchemaError, validate_attachment
from spec_cache.schemas.errors import UnknownSchemaError

from . import keys as K
from .codec import CorruptRecord, check_key, copy_out, decode_record, encode_record, verify_checksum
from .env import Environment
from .errors import CorruptIndex, InvalidInput, StoreError, StoreFullError
from .index import Index, decode, draft_key, now_ns, pack, unpack
from .tensors import LayerState, Tensor, numpy_dtype

log = logging.getLogger("spec_cache.store")
FLUSH_EVERY = 64
ASYNC_VERIFY_BYTES = 1 << 20  # records at least this big are checksummed on a second thread during fetch
FLUSH_SECONDS = 1.0


@dataclass(frozen=True)
class Hit:
    """Where the longest usable prefix lies: ``length`` tokens, from an entry or from chunks alone."""

    length: int
    has_drafter: bool
    entry: bytes | None          # entry key, or None for a chunk-boundary (target-only) hit
    chain: tuple[bytes, ...]     # root .. the chunk the prefix ends in or hangs off
    minimum_reusable: int = 0


@dataclass
class Restored:
    """State read back for a hit: per-layer target state and this drafter's checkpoint (or None)."""

    length: int
    layers: list[LayerState]
    attachment: CheckpointAttachment | None
    entry: bytes | None
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PutResult:
    entry: bytes
    bytes_written: int
    new_chunks: int
    evicted: int


def _signature(layers: Sequence[LayerState]) -> tuple[bytes, list[int]]:
    """Layer signature of the chunked layers (kinds, scalars, dtypes, shapes without the token axis)."""
    sig, chunked = [], []
    for i, layer in enumerate(layers):
        if layer.token_axis is None:
            continue
        chunked.append(i)
        shapes = [[t.dtype, [(-1 if a == layer.token_axis else d) for a, d in enumerate(t.shape)]]
                  for t in layer.tensors]
        sig.append([i, layer.kind, layer.meta, layer.token_axis, shapes])
    return (pack(sig) if sig else b""), chunked


def _slice(arr: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * arr.ndim
    index[axis] = slice(start, stop)
    return arr[tuple(index)]


class Store:
    """A spec-cache store in one directory. Thread-safe for use from one process; many processes may share
    a directory (LMDB's locking). Use as a context manager or call ``close()``."""

    def __init__(self, env: Environment, max_bytes: int | None):
        self.env = env
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._touched: dict[bytes, int] = {}
        self._counts: dict[bytes, list[int]] = {}  # ns -> [hits, misses]
        self._pending = 0
        self._last_flush = time.monotonic()
        self._bad: set[bytes] = set()
        self._verifier = None  # thread that checksums large records while fetch copies them out  # corrupt keys this process could not drop (read-only store)

    # --- open / close ------------------------------------------------------------------------------
    @classmethod
    def open(cls, path, *, max_bytes: int | None = None, readonly: bool = False, durable: bool = True,
             chunk_tokens: int | None = None, map_size: int | None = None) -> "Store":
        """Open (creating if needed) the store in directory ``path``.

        ``max_bytes`` caps stored bytes (LRU eviction on put); ``durable=False`` skips fsync per commit.
        Raises ``StoreOpenError``/``StoreFormatError`` with a message naming the directory.
        """
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise InvalidInput("max_bytes must be a positive int or None")
        env = Environment(path, readonly=readonly, durable=durable, map_size=map_size, chunk_tokens=chunk_tokens)
        return cls(env, max_bytes)

    @property
    def path(self) -> str:
        return self.env.path

    @property
    def chunk_tokens(self) -> int:
        return int(self.env.meta["chunk_tokens"])

    def close(self) -> None:
        if self.env.env is not None:
            if not self.env.readonly:
                self._flush_best_effort()
            self.env.close()
            self.env.env = None
        if self._verifier is not None:
            self._verifier.shutdown(wait=True)
            self._verifier = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- namespaces --------------------------------------------------------------------------------
    def register_namespace(self, ns_key: bytes, *, target: str, prefix_namespace: str, tenant: bool = False) -> None:
        """Record what a namespace key stands for (shown by ``ls``/``show``); idempotent."""
        def fn(txn):
            ix = Index(txn, self.env.dbs)
            info = ix.nsinfo(ns_key)
            if info is None:
                ix.put("nsinfo", ns_key, {"target": target, "prefix": prefix_namespace, "tenant": bool(tenant),
                                          "created": now_ns(), "entries": 0, "bytes": 0, "hits": 0, "misses": 0,
                                          "last_use": None, "sigs": []})
            elif info.get("rebuilt"):  # gc rebuilt this row after damage: say again what it stands for
                info.update(target=target, prefix=prefix_namespace, tenant=bool(tenant))
                del info["rebuilt"]
                ix.put("nsinfo", ns_key, info)
        self.env.write(fn)

    # --- put ---------------------------------------------------------------------------------------
    def put(self, ns_key: bytes, tokens, layers: Sequence[LayerState], *,
            drafter: tuple[str, CheckpointAttachment] | None = None, minimum_reusable: int = 0,
            pin: bool = False) -> PutResult:
        """Store the checkpoint of ``tokens`` in one transaction (all of it or none of it).

        Every layer with a ``token_axis`` must cover exactly ``len(tokens)`` tokens. ``drafter`` is
        ``(drafter namespace, attachment)``; the attachment is validated against its schema first.
        An exact duplicate replaces the old entry. Raises ``InvalidInput``, ``SchemaError``,
        ``StoreFullError`` (the checkpoint with its chunks is over ``max_bytes``, or does not fit next to the
        pinned entries); the store is unchanged then.
        """
        packed = K.pack_tokens(tokens)
        n = len(packed)
        if n < 1:
            raise InvalidInput("a checkpoint must cover at least one token")
        if not isinstance(minimum_reusable, int) or not 0 <= minimum_reusable <= n:
            raise InvalidInput("minimum_reusable must be an int in [0, len(tokens)]")
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerState):
                raise InvalidInput(f"layer {i} is not a LayerState")
            if layer.token_axis is not None and any(t.shape[layer.token_axis] != n for t in layer.tensors):
                raise InvalidInput(f"layer {i} covers {layer.tokens} tokens along its token axis, checkpoint has {n}")
        draft_tensors = None
        if drafter is not None:
            dns, attachment = drafter
            if not isinstance(dns, str) or not dns:
                raise InvalidInput("drafter namespace must be a non-empty string")
            validate_attachment(attachment, n)
            draft_tensors = _as_tensors(attachment.tensors)
        sig, chunked = _signature(layers)
        C = self.chunk_tokens
        full = n // C if chunked else 0
        root = K.root_key(ns_key, sig)
        chain = K.chain(root, packed, C, max_chunks=full)
        tail_start = full * C
        ekey = K.entry_key(chain[-1], packed[tail_start:])
        complete = len(chunked) == len(layers)
        draft_record = None
        if drafter is not None:  # every record names the key it is stored under (checked on read)
            draft_record = encode_record(
                "draft", ((f"t{j}", t.dtype, t.array()) for j, t in enumerate(draft_tensors)),
                schema=attachment.schema, meta={"metadata": dict(attachment.metadata), "processed_tokens": n,
                                                "key": draft_key(ekey, dns)})
        arrays = [[t.array() for t in layer.tensors] for layer in layers]
        table = [[i, layer.kind, layer.meta, layer.token_axis, [[t.dtype, list(t.shape)] for t in layer.tensors]]
                 for i, layer in enumerate(layers)]

        def entry_tensors():
            yield "tokens", "uint32", packed[tail_start:]
            for i, layer in enumerate(layers):
                for j, arr in enumerate(arrays[i]):
                    if layer.token_axis is None:
                        yield f"L{i}.{j}", layer.tensors[j].dtype, arr
                    else:
                        yield f"L{i}.{j}", layer.tensors[j].dtype, _slice(arr, layer.token_axis, tail_start, n)

        entry_record = encode_record("entry", entry_tensors(), meta={
            "layers": table, "length": n, "chunk_tokens": C, "min_reusable": minimum_reusable, "key": ekey})
        own_bytes = entry_record.nbytes + (draft_record.nbytes if draft_record is not None else 0)
        if self.max_bytes is not None and own_bytes > self.max_bytes:
            raise StoreFullError(f"checkpoint of {own_bytes} bytes exceeds the store's max_bytes {self.max_bytes}")

        def chunk_record(k: int):
            lo, hi = (k - 1) * C, k * C

            def gen():
                yield "tokens", "uint32", packed[lo:hi]
                for i in chunked:
                    for j, arr in enumerate(arrays[i]):
                        yield f"L{i}.{j}", layers[i].tensors[j].dtype, _slice(arr, layers[i].token_axis, lo, hi)
            # "complete": the writing checkpoint had every layer chunked (a chunk-boundary hit needs that)
            return encode_record("chunk", gen(), meta={"depth": k, "start": lo, "chunk_tokens": C,
                                                       "layers": [table[i] for i in chunked], "key": chain[k],
                                                       "complete": complete})

        def fn(txn):
            ix = Index(txn, self.env.dbs)
            info = ix.nsinfo(ns_key)
            if info is None:
                raise InvalidInput("namespace key is not registered: call register_namespace first")
            when = now_ns()
            written, new_chunks, reclaimed, chain_bytes = 0, 0, 0, 0
            if sig not in info["sigs"]:
                info["sigs"].append(sig)
                ix.put("nsinfo", ns_key, info)
            for k, key in enumerate(chain):
                node = ix.get("nodes", key)
                if node is not None and not node.get("broken"):
                    node["minr"] = max(node["minr"], minimum_reusable)
                    # a chunk boundary is usable only if every checkpoint through it was fully chunked
                    node["complete"] = bool(node["complete"] and complete)
                    ix.put("nodes", key, node)
                    chain_bytes += node["bytes"]
                    continue
                if node is not None:  # a broken chunk is rewritten in place; its references stay
                    refs, tails = node["refs"], node["tails"]
                    reclaimed += node["bytes"]  # its old bytes are still counted in the totals
                    complete_here = bool(node["complete"] and complete)
                    minr_here = max(node["minr"], minimum_reusable)
                else:
                    refs, tails = 0, {}
                    complete_here, minr_here = complete, minimum_reusable
                    if k > 0:
                        parent = ix.get("nodes", chain[k - 1])
                        parent["refs"] += 1
                        ix.put("nodes", chain[k - 1], parent)
                nbytes = 0
                if k > 0:
                    record = chunk_record(k)
                    txn.put(key, record, db=self.env.dbs["chunks"])
                    nbytes = record.nbytes
                    written += nbytes
                    chain_bytes += nbytes
                    new_chunks += 1
                ix.put("nodes", key, {"ns": ns_key, "parent": chain[k - 1] if k else None, "depth": k,
                                      "refs": refs, "tails": tails, "bytes": nbytes, "complete": complete_here,
                                      "minr": minr_here, "sig": sig if k == 0 else b""})
            if self.max_bytes is not None and own_bytes + chain_bytes > self.max_bytes:
                raise StoreFullError(f"checkpoint of {own_bytes + chain_bytes} bytes (with its chunks) exceeds "
                                     f"the store's max_bytes {self.max_bytes}")
            old = ix.get("entries", ekey)
            drafters = {}
            if old is not None:  # exact duplicate: replace the entry, keep other drafters' parts
                ix.delete("lru", K.lru_key(old["last_use"], ekey))
                drafters = dict(old["drafters"])
                if draft_record is not None:
                    drafters.pop(drafter[0], None)
                freed = old["bytes"] - sum(drafters.values())
                ix.add_ns(ns_key, d_bytes=-freed, d_entries=-1)
                ix.add_totals(-freed, -1)
            else:
                node = ix.get("nodes", chain[-1])
                tail = str(n - tail_start)
                node["tails"][tail] = node["tails"].get(tail, 0) + 1
                node["refs"] += 1
                ix.put("nodes", chain[-1], node)
            txn.put(ekey, entry_record, db=self.env.dbs["edata"])
            if draft_record is not None:
                txn.put(draft_key(ekey, drafter[0]), draft_record, db=self.env.dbs["drafts"])
                drafters[drafter[0]] = draft_record.nbytes
            entry_bytes = entry_record.nbytes + sum(drafters.values())
            ix.put("entries", ekey, {"ns": ns_key, "len": n, "node": chain[-1], "tail": n - tail_start,
                                     "last_use": when, "created": when, "pinned": bool(pin or (old or {}).get("pinned")),
                                     "bytes": entry_bytes, "drafters": drafters, "minr": minimum_reusable})
            ix.put("lru", K.lru_key(when, ekey), b"")
            written += own_bytes
            ix.add_ns(ns_key, d_bytes=written - reclaimed, d_entries=1, last_use=when)
            ix.add_totals(written - reclaimed, 1)
            evicted = 0
            if self.max_bytes is not None:
                evicted = ix.evict_to(self.max_bytes, {ekey})
                if ix.totals()["bytes"] > self.max_bytes:  # pinned entries hold the rest: refuse, change nothing
                    raise StoreFullError(
                        f"checkpoint of {own_bytes + chain_bytes} bytes does not fit next to the pinned entries "
                        f"within the store's max_bytes {self.max_bytes}")
            return PutResult(ekey, written, new_chunks, evicted)

        with self._lock:
            self._flush_best_effort()
            return self.env.write(fn, on_full=self._evict_for_space)

    def _evict_for_space(self) -> bool:
        """Called when the map cannot grow: evict one LRU entry in its own transaction."""
        def fn(txn):
            ix = Index(txn, self.env.dbs)
            victim = next(ix.lru_victims(set()), None)
            if victim is None:
                return False
            ix.delete_entry(*victim)
            return True
        try:
            return self.env.write(fn)
        except StoreFullError:
            return False

    # --- lookup ------------------------------------------------------------------------------------
    def _lookup(self, txn, ns_key: bytes, packed: np.ndarray, drafter: str | None) -> Hit | None:
        ix = Index(txn, self.env.dbs)
        info = ix.nsinfo(ns_key)
        if info is None:
            return None
        C = self.chunk_tokens
        n = len(packed)
        best: Hit | None = None

        def better(length: int, has_drafter: bool, is_entry: bool) -> bool:
            if best is None:
                return True
            return (length, has_drafter, is_entry) > (best.length, best.has_drafter, best.entry is not None)

        nodes_db = self.env.dbs["nodes"]
        for sig in info["sigs"]:
            root = K.root_key(ns_key, sig)
            raw_root = txn.get(root, db=nodes_db)
            if raw_root is None:
                continue
            # Walk the chain on raw values (existence only); unpack a node only when it is examined below.
            keys = K.chain(root, packed, C, max_chunks=n // C)
            raws = [raw_root]
            for key in keys[1:]:
                raw = txn.get(key, db=nodes_db)
                if raw is None or key in self._bad:
                    break
                raw = bytes(raw)  # a few dozen bytes; the marker test needs bytes, not a memoryview
                if b"broken" in raw and unpack(raw).get("broken"):
                    break
                raws.append(raw)
            chain = keys[:len(raws)]
            for j in range(len(chain) - 1, -1, -1):
                base = j * C
                if best is not None and best.length >= base + C and sig:
                    break  # every candidate below this level is shorter (tails of chunked chains are < C)
                node = decode("nodes", raws[j], chain[j])  # shape-checked: a damaged node is a CorruptIndex
                for t in sorted((int(x) for x in node["tails"]), reverse=True):
                    length = base + t
                    if length > n or length < 1 or not better(length, True, True):
                        continue
                    ekey = K.entry_key(chain[j], packed[base:length])
                    if ekey in self._bad:
                        continue
                    entry = ix.get("entries", ekey)
                    if entry is None or entry["len"] != length or length < entry["minr"]:
                        continue
                    has = (drafter is not None and drafter in entry["drafters"]
                           and draft_key(ekey, drafter) not in self._bad)
                    if better(length, has, True):
                        best = Hit(length, has, ekey, tuple(chain[:j + 1]), entry["minr"])
                if j > 0 and node["complete"] and node["minr"] <= base and better(base, False, False):
                    best = Hit(base, False, None, tuple(chain[:j + 1]), node["minr"])
        return best

    def lookup(self, ns_key: bytes, tokens, *, drafter: str | None = None) -> Hit | None:
        """The longest usable stored prefix of ``tokens`` (index only; nothing is read or verified)."""
        packed = K.pack_tokens(tokens)
        with self._lock, self.env.read() as txn:
            return self._lookup(txn, ns_key, packed, drafter)

    # --- fetch -------------------------------------------------------------------------------------
    def fetch(self, ns_key: bytes, tokens, *, drafter: str | None = None,
              max_attempts: int = 3, warnings: list[str] | None = None,
              concat: Callable[[list, int, str], Any] | None = None) -> Restored | None:
        """Look up and read back the longest usable prefix of ``tokens``; None on a miss.

        Every record read is verified (blake3) and its tokens compared with ``tokens``; a corrupt record is
        dropped from the store, logged, and the lookup retried (a shorter prefix may still serve). A drafter
        part with an unknown or invalid schema is skipped (target only). What went wrong is appended to
        ``warnings`` (when given; also on a miss) and to ``Restored.warnings``.

        ``concat(pieces, axis, dtype)`` builds a token-sliceable tensor from its pieces (numpy views into the
        map, valid only during the call: copy them) and returns what ``Tensor.data`` should hold; the default
        assembles one numpy array. The runtime passes one that copies straight into framework arrays, so a
        restore makes one copy out of the map instead of two.
        """
        packed = K.pack_tokens(tokens)
        warnings = [] if warnings is None else warnings
        for _ in range(max_attempts):
            with self._lock:
                try:
                    with self.env.read() as txn:
                        hit = self._lookup(txn, ns_key, packed, drafter)
                        if hit is None:
                            self._count(ns_key, hit=False)
                            return None
                        restored = self._read(txn, hit, packed, drafter, warnings, concat)
                except CorruptRecord as exc:
                    message = f"dropping corrupt record ({exc}); falling back to a shorter prefix"
                    log.warning(message)
                    warnings.append(message)
                    self._forget_corrupt(exc.key)
                    continue
                if hit.entry is not None:
                    self._touched[hit.entry] = now_ns()
                self._count(ns_key, hit=True)
                restored.warnings = warnings
                return restored
        self._count(ns_key, hit=False)
        return None

    def _read(self, txn, hit: Hit, packed: np.ndarray, drafter: str | None, warnings: list[str],
              concat=None) -> Restored:
        C = self.chunk_tokens
        deferred: list = []  # large records: checksums run on a second thread while their tensors are copied
        chunks = []
        for k in range(1, len(hit.chain)):
            key = hit.chain[k]
            chunks.append(self._decode(txn, "chunks", key, packed[(k - 1) * C:k * C], deferred))
        if hit.entry is None:
            layer_table = None
            entry_rec = None
            if chunks and chunks[-1].meta.get("complete") is False:  # the node's flag disagrees: index damage
                raise CorruptRecord("chunk-boundary prefix of a checkpoint with untrimmable layers (damaged index)",
                                    hit.chain[-1])
        else:
            base = (len(hit.chain) - 1) * C
            entry_rec = self._decode(txn, "edata", hit.entry, packed[base:hit.length], deferred)
            layer_table = entry_rec.meta.get("layers")
        pending = self._verify_in_background(deferred)
        try:
            if layer_table is None:  # chunk-boundary hit: every layer is chunked and the chunk says which
                layer_table = chunks[0].meta.get("layers")
            layers = self._assemble(layer_table, chunks, entry_rec, hit, concat=concat)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            self._verified(pending)  # a checksum failure explains a broken table best: report that first
            raise CorruptRecord(f"stored layer table does not match its tensors ({exc})", hit.entry) from None
        self._verified(pending)  # nothing is returned before every record it came from passed its checksum
        attachment = None
        if drafter is not None and hit.has_drafter:
            try:
                rec = self._decode(txn, "drafts", draft_key(hit.entry, drafter), None)
                tensors = tuple(Tensor(t.dtype, t.shape, copy_out(t)) for t in rec.tensors.values())
                attachment = CheckpointAttachment(rec.schema, rec.meta.get("metadata", {}), tensors)
                validate_attachment(attachment, hit.length)
            except UnknownSchemaError as exc:
                warnings.append(f"drafter part skipped: {exc}")
                log.warning(warnings[-1])
                attachment = None
            except SchemaError as exc:
                warnings.append(f"drafter part skipped: stored attachment is invalid: {exc}")
                log.warning(warnings[-1])
                attachment = None
        return Restored(hit.length, layers, attachment, hit.entry)

    @staticmethod
    def _assemble(layer_table, chunks, entry_rec, hit: Hit, *, concat=None) -> list[LayerState]:
        """Concatenate each chunked layer's pieces along its token axis (one copy out of the map, or
        ``concat(pieces, axis, dtype)``'s result; see ``fetch``)."""
        layers = []
        for i, kind, meta, axis, tensor_specs in layer_table:
            out = []
            for j, (dtype, shape) in enumerate(tensor_specs):
                name = f"L{i}.{j}"
                if axis is None:
                    out.append(Tensor(dtype, tuple(shape), copy_out(entry_rec.tensors[name])))
                    continue
                pieces = [c.tensors[name] for c in chunks]
                if entry_rec is not None:
                    pieces.append(entry_rec.tensors[name])
                full = list(shape)
                full[axis] = sum(p.shape[axis] for p in pieces)
                if any(len(p.shape) != len(full) or any(d != f for a, (d, f) in enumerate(zip(p.shape, full))
                                                        if a != axis) for p in pieces):
                    raise CorruptRecord(f"layer {i} pieces do not match the stored layer table", hit.entry)
                if full[axis] != hit.length:
                    raise CorruptRecord(f"layer {i} pieces cover {full[axis]} tokens, expected {hit.length}",
                                        hit.entry)
                if concat is not None:
                    out.append(Tensor(dtype, tuple(full), concat([p.array() for p in pieces], axis, dtype)))
                    continue
                arr = np.empty(full, dtype=numpy_dtype(dtype))
                at = 0
                for p in pieces:
                    step = p.shape[axis]
                    _slice(arr, axis, at, at + step)[...] = p.array()
                    at += step
                out.append(Tensor(dtype, tuple(full), arr))
            layers.append(LayerState(kind, meta, out, axis))
        return layers

    def _verify_in_background(self, deferred: list):
        """Start checksumming ``deferred`` records on the verifier thread (blake3 releases the GIL)."""
        if not deferred:
            return None
        if self._verifier is None:
            from concurrent.futures import ThreadPoolExecutor

            self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spec-cache-verify")

        def run():
            for db, key, raw in deferred:
                if not verify_checksum(raw):
                    return db, key
            return None
        return self._verifier.submit(run)

    @staticmethod
    def _verified(pending) -> None:
        """Wait for background checksums; raise ``CorruptRecord`` for the first record that failed."""
        if pending is None:
            return
        bad = pending.result()
        if bad is not None:
            raise CorruptRecord(f"{bad[0]} record: record checksum mismatch (bit flip or truncation)", bad[1])

    def _decode(self, txn, db: str, key: bytes, expect_tokens: np.ndarray | None, deferred: list | None = None):
        """Decode one record; a large one may have its checksum deferred onto ``deferred`` (see ``_verified``)."""
        raw = txn.get(key, db=self.env.dbs[db])
        if raw is None:
            raise CorruptRecord(f"{db} record missing under an indexed key", key)
        defer = deferred is not None and len(raw) >= ASYNC_VERIFY_BYTES
        if defer:
            deferred.append((db, key, raw))
        try:
            rec = decode_record(raw, verify=not defer)
        except CorruptRecord as exc:
            raise CorruptRecord(f"{db} record: {exc}", key) from None
        check_key(rec, key, db)
        if expect_tokens is not None:
            stored = rec.tensors.get("tokens")
            if stored is None or stored.shape != (len(expect_tokens),) or \
                    bytes(stored.data) != expect_tokens.tobytes():
                raise CorruptRecord(f"{db} record holds other tokens than its key says", key)
        return rec

    def _forget_corrupt(self, key: bytes | None) -> None:
        """Drop a corrupt record from the store; if that is impossible (read-only), hide it from lookups."""
        if key is None:
            return
        self._bad.add(key)
        if self.env.readonly:
            return
        try:
            self._drop_corrupt(key)
        except StoreError as exc:
            log.warning("could not drop corrupt record %s: %s", key.hex()[:16], exc)
            return
        self._bad.discard(key)

    def _drop_corrupt(self, key: bytes | None) -> None:
        if key is None:
            return

        def fn(txn):
            ix = Index(txn, self.env.dbs)
            if ix.get("entries", key) is not None:
                ix.delete_entry(key)
                return
            node = ix.get("nodes", key)
            if node is not None:  # a chunk: mark the node broken so lookups stop above it; gc removes the subtree
                ix.delete("chunks", key)
                node["broken"] = True
                ix.put("nodes", key, node)
                return
            if len(key) == 48:  # a drafter part: forget it on its entry
                entry = ix.get("entries", key[:32])
                if entry is not None:
                    for dns in list(entry["drafters"]):
                        if draft_key(key[:32], dns) == key:
                            ix.drop_drafter(key[:32], entry, dns)
        self.env.write(fn, making_room=True)

    # --- access times and counters (batched) -------------------------------------------------------
    def _count(self, ns_key: bytes, *, hit: bool) -> None:
        c = self._counts.setdefault(ns_key, [0, 0])
        c[0 if hit else 1] += 1
        self._pending += 1
        if self._pending >= FLUSH_EVERY or time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self._flush_best_effort()

    def _flush_best_effort(self) -> None:
        """Flush access times and counters, but never fail a read or a put over them (a full store, a
        damaged entry): they are dropped with a log line instead."""
        try:
            self.flush()
        except StoreError as exc:
            log.warning("access times and hit/miss counters not written: %s", exc)

    def _flush_pending(self, txn=None) -> None:
        if not self._pending and not self._touched:
            return
        touched, counts = self._touched, self._counts
        self._touched, self._counts, self._pending = {}, {}, 0
        self._last_flush = time.monotonic()

        def fn(txn):
            ix = Index(txn, self.env.dbs)
            for key, when in touched.items():
                with contextlib.suppress(CorruptIndex):  # a damaged entry is gc's to remove
                    ix.touch(key, when)
            for ns, (hits, misses) in counts.items():
                with contextlib.suppress(CorruptIndex):
                    ix.add_ns(ns, hits=hits, misses=misses, last_use=now_ns() if hits else None)
        self.env.write(fn)

    def flush(self) -> None:
        """Write batched access times and hit/miss counters now."""
        if self.env.readonly:
            self._touched, self._counts, self._pending = {}, {}, 0
            return
        with self._lock:
            self._flush_pending()

    # --- pinning -----------------------------------------------------------------------------------
    def pin(self, ns_key: bytes, tokens, pinned: bool = True) -> bool:
        """Pin (or unpin) the exact entry for ``tokens``; pinned entries are never evicted by the budget."""
        packed = K.pack_tokens(tokens)

        def fn(txn):
            ix = Index(txn, self.env.dbs)
            info = ix.nsinfo(ns_key)
            if info is None:
                return False
            C = self.chunk_tokens
            for sig in info["sigs"]:
                full = len(packed) // C if sig else 0
                chain = K.chain(K.root_key(ns_key, sig), packed, C, max_chunks=full)
                key = K.entry_key(chain[-1], packed[full * C:])
                entry = ix.get("entries", key)
                if entry is not None:
                    entry["pinned"] = bool(pinned)
                    ix.put("entries", key, entry)
                    return True
            return False
        with self._lock:
            return self.env.write(fn, making_room=not pinned)

    # --- maintenance (see maintenance.py for evict/gc/verify) --------------------------------------
    def memo(self) -> "StoreMemo":
        """An artifact-identity memo kept in this store (``spec_cache.identity`` takes it as ``memo``)."""
        return StoreMemo(self)


def _as_tensors(tensors) -> list[Tensor]:
    out = []
    for t in tensors:
        if isinstance(t, Tensor):
            out.append(t)
        elif isinstance(t, np.ndarray):
            out.append(Tensor.from_numpy(t))
        else:
            raise InvalidInput(f"attachment tensors must be store.Tensor or numpy arrays, got {type(t).__name__}")
    return out


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
