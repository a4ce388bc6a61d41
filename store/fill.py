"""Verified copies straight into the caller's buffers: every stored byte read once from LMDB's map, copied once
into the array the caller keeps, and checksummed while it is still in cache.

The default read assembles each tensor from its pieces (``read.assemble_layers``) and checksums every large record
again on other threads: the records are read from memory twice, and a CPU restore then copied the assembled numpy
array once more into MLX. A ``Sink`` (``Store.fetch(concat=sink)``) hands out the final buffers instead (on the
CPU: fresh MLX arrays, written through a numpy view before anyone else holds them).

Order of work: tensor by tensor (the calling thread asks the sink for tensor ``t``'s buffer, so a freshly made
16 MiB buffer is written while it is in cache, not after 256 MiB of others evicted it), and each tensor's pieces
copied by ``lanes``: every record belongs to one lane (a worker thread), which copies that record's pieces in
order and feeds them to the record's own XXH3-128 right after copying. Since the layer table lists a record's
tensors in the order they are stored, each record's hash sees its bytes in record order: the prefix's first 16
bytes, the header, then every tensor (a tensor nothing is copied from, like ``tokens``, is hashed where it
lies): exactly the bytes ``codec.checksum`` covers, ``decode_record`` having checked that the tensors tile the
payload. A record whose tensors come in another order, and a format-1 (blake3) record, is checked whole instead.
The hash releases the GIL (``xxh3``), and so do numpy's copies, so the lanes run on several cores.

Nothing is returned before every record passed: a failed checksum raises ``CorruptRecord`` naming the record
(the first failing one in read order) and the filled buffers are dropped with the exception.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np

from .codec import CHECKSUM_OFFSET, FORMAT_MAJOR, PREFIX_SIZE, Record, copy_out, verify_checksum
from .errors import CorruptRecord
from .tensors import LayerState, Tensor, numpy_dtype
from .xxh3 import Hasher

__all__ = ["Sink", "is_sink", "fill_layers", "layers_from_plan"]

_ZERO16 = bytes(16)


class Sink(Protocol):
    """Where a fetch writes token-sliceable tensors (see the module docstring); also a ``Concat`` for readers
    that assemble tensor by tensor."""

    def allocate(self, specs: list[tuple[str, tuple[int, ...]]]) -> list[tuple[Any, np.ndarray]]:
        """For each ``(dtype, shape)``: ``(what Tensor.data will hold, a writable C-contiguous numpy view of its
        bytes of that shape, bfloat16 as uint16)``. Nobody else may hold the buffers until the fetch returns."""

    def __call__(self, pieces: list, axis: int, dtype: str) -> Any: ...


def is_sink(concat) -> bool:
    return concat is not None and callable(getattr(concat, "allocate", None))


def fill_layers(plan: list, records: list[tuple[Record, Any]], sink: Sink, pool: Executor | None,
                lanes: int = 1) -> list[LayerState]:
    """The layers of ``plan`` (``read.plan_layers``) written into ``sink``'s buffers.

    ``records``: ``(record, deferred)`` for every record read, in read order, ``deferred`` being the
    ``read.Deferred`` of a record whose checksum is still to be checked (None when ``decode_record`` already
    checked it). ``lanes`` workers of ``pool`` copy and hash while this thread has the sink make the next
    buffers (0 or no pool: everything on this thread). Raises ``CorruptRecord`` (naming the record) when a
    checksum fails."""
    passes = [_RecordPass(rec, deferred) for rec, deferred in records]
    by_id = {id(p.rec): p for p in passes}
    threaded = pool is not None and lanes >= 1 and len(passes) > 0
    lanes = max(1, min(lanes, len(passes))) if threaded else 1
    lane_of = _partition(passes, lanes)
    workers = [_Lane() for _ in range(lanes)] if threaded else []
    futures = [pool.submit(w.run) for w in workers]
    made = []
    try:
        for layer in plan:
            for dtype, axis, shape, parts in layer[4]:
                if axis is None:
                    continue
                ((data, view),) = sink.allocate([(dtype, tuple(shape))])
                if view.shape != tuple(shape) or view.dtype != numpy_dtype(dtype) or not view.flags.writeable:
                    raise RuntimeError(f"sink gave a {view.dtype} {view.shape} buffer for {dtype} {tuple(shape)}")
                made.append(data)
                work: list[list] = [[] for _ in range(lanes)]
                at = 0
                index: list = [slice(None)] * view.ndim
                for rec, name in parts:
                    p = by_id[id(rec)]
                    step = rec.tensors[name].shape[axis]
                    index[axis] = slice(at, at + step)
                    work[lane_of[id(rec)]].append((p, name, view[tuple(index)]))
                    at += step
                if workers:
                    for w, items in zip(workers, work):
                        if items:
                            w.queue.put(items)
                else:
                    _copy_items(work[0])
    finally:
        for w in workers:
            w.queue.put(None)
        for f in futures:
            f.result()
    ok = [p.finish() for p in passes]  # lanes finished theirs; a record nothing was copied from is checked here
    for good, p in zip(ok, passes):
        if good:
            continue
        if p.deferred is None:  # checked at decode; its copies failed: the table does not fit (read_layers names it)
            raise CorruptRecord(f"{p.rec.kind} record: its tensors do not fit the stored layer table")
        raise p.deferred.mismatch()
    data = iter(made)
    return layers_from_plan(plan, lambda *_: next(data))


def layers_from_plan(plan: list, chunked) -> list[LayerState]:
    """``plan``'s layers (``read.plan_layers``): an untrimmable layer's tensors copied whole out of the entry
    record, each token-sliceable one's data from ``chunked(dtype, axis, shape, parts)``, in plan order."""
    layers = []
    for _i, kind, meta, axis, tensors in plan:
        out = []
        for dtype, t_axis, shape, parts in tensors:
            if t_axis is None:
                rec, name = parts[0]
                out.append(Tensor(dtype, tuple(shape), copy_out(rec.tensors[name])))
            else:
                out.append(Tensor(dtype, tuple(shape), chunked(dtype, t_axis, shape, parts)))
        layers.append(LayerState(kind, meta, out, axis))
    return layers


def idle_lanes(threads: int) -> int:
    """Worker lanes worth starting besides the calling thread: the cores idle over the last minute (``os``'s
    load average), at most ``threads - 1``; 0 (all on the calling thread) on a busy machine. Measured on a
    2-core VM: with the other core idle, one lane overlaps the buffers' making with the copies; at a load of 6-8
    every lane lost (101 ms inline against 140 ms with one lane and 156 ms with two, medians of 11).
    ``SPEC_CACHE_FILL_LANES`` = N forces N."""
    forced = os.environ.get("SPEC_CACHE_FILL_LANES", "")
    if forced.isdigit():  # benchmarks compare lane counts
        return int(forced)
    try:
        idle = (os.cpu_count() or 1) - os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0
    return max(0, min(threads - 1, int(idle) - 1 + (1 if idle >= 1.5 else 0)))


def _partition(passes: list, lanes: int) -> dict[int, int]:
    """Records to lanes in read order, contiguous runs of about equal bytes."""
    total = sum(p.rec.size for p in passes) or 1
    out, at = {}, 0
    for p in passes:
        out[id(p.rec)] = min(lanes - 1, at * lanes // total)
        at += p.rec.size
    return out


class _RecordPass:
    """One record's copies and its incremental checksum (``deferred``), fed tensor by tensor in record order."""

    def __init__(self, rec: Record, deferred):
        self.rec, self.deferred = rec, deferred
        self.ok = True
        self.names = list(rec.tensors)
        self.order = {name: k for k, name in enumerate(self.names)}
        self.cursor = 0
        self.hasher = None
        self.whole = False  # checked in one piece at the end (format 1, or tensors met out of order)
        self.done = False
        raw = deferred.raw if deferred is not None else None
        if raw is not None:
            if raw[4] == FORMAT_MAJOR:
                self.hasher = Hasher()
                self.hasher.update(raw[:CHECKSUM_OFFSET])
                self.hasher.update(raw[PREFIX_SIZE:rec.data_at])
            else:
                self.whole = True

    def copy(self, name: str, dst: np.ndarray) -> None:
        try:
            flat = np.frombuffer(self.rec.tensors[name].data, dtype=np.uint8)  # the record's bytes, in the map
            np.copyto(dst, flat.view(dst.dtype).reshape(dst.shape), casting="no")
        except Exception:  # a tensor that does not fit its destination: not served
            self.ok = False
            return
        if self.hasher is not None:
            k = self.order[name]
            if k < self.cursor:
                self._drop_hasher()
                return
            self._hash_to(k)
            self.hasher.update_bytes(flat)  # just copied: still in cache
            self.cursor = k + 1

    def _hash_to(self, stop: int) -> None:
        for k in range(self.cursor, stop):
            self.hasher.update(self.rec.tensors[self.names[k]].data)
        self.cursor = max(self.cursor, stop)

    def _drop_hasher(self) -> None:
        self.hasher.close()
        self.hasher, self.whole = None, True

    def finish(self) -> bool:
        """Whether the record passed (its copies succeeded and its checksum matched); frees the hasher. Once."""
        if self.done:
            return self.ok
        self.done = True
        try:
            if self.ok and self.hasher is not None:
                self._hash_to(len(self.names))
                raw = self.deferred.raw
                self.ok = self.hasher.digest() + _ZERO16 == bytes(raw[CHECKSUM_OFFSET:PREFIX_SIZE])
            elif self.ok and self.whole:
                self.ok = verify_checksum(self.deferred.raw)
        except Exception:  # anything unexpected while checking bytes: not served
            self.ok = False
        finally:
            if self.hasher is not None:
                self.hasher.close()
                self.hasher = None
        return self.ok


def _copy_items(items: list) -> None:
    for p, name, dst in items:
        p.copy(name, dst)


class _Lane:
    """A worker copying and hashing its records' pieces in the order they are queued, then finishing them."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        mine: dict[int, _RecordPass] = {}
        while True:
            items = self.queue.get()
            if items is None:
                break
            for p, _name, _dst in items:
                mine.setdefault(id(p), p)
            _copy_items(items)
        for p in mine.values():
            p.finish()
