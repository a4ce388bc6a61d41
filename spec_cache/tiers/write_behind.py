"""``CheckpointWriter``: LMDB writes off the request path (write-behind).

``SpecCache.save(..., background=True)`` captures a checkpoint (host views of the evaluated MLX arrays; no copy
yet), puts it in the memory tier, and queues the LMDB write here. One daemon thread encodes each queued checkpoint
(the device-to-host copy happens there) and commits it in one LMDB transaction, then marks the memory-tier entry
durable (from then on it may be evicted from memory) and hands it to the shared tier's publisher.

Bounds: the queue holds at most ``cap_bytes`` of checkpoint state, counted as what the writer will copy and
write (a checkpoint whose first chunks the store holds, or a checkpoint queued before it writes, counts only the
tokens after them: ``SpecCache.save`` estimates it). A checkpoint that does not fit waits past the cap when the
caller says its state is held meanwhile (``submit(..., may_wait=True)``: the memory tier holds it and its
checkpoints waiting for LMDB fit the tier's budget, or, with several tenants' checkpoints queued, its tenant's
queued bytes are within its share, cap / tenants queued: ``SpecCache._submit``; counted as ``waited``), so the
request's thread never writes while the tier can hold on and never for a tenant that did not fill the queue;
otherwise it is written on the caller's thread (back-pressure, counted as ``inline``: the tenant over its share
pays it). Nothing is ever dropped. Under light load a
checkpoint is durable within the time of one ``Store.put`` of its size after its request returns (milliseconds
for small states; ~0.1-1 s for hundreds of MiB): the thread starts on it at once. ``drain()`` waits for the
queue; ``close()`` drains, then stops. A cache that is never closed is drained at interpreter exit
(``spec_cache.tiers.exit_drain``; bounded by ``exit_timeout_s``, then ``stop`` drops and reports what is left). A crash
(SIGKILL) loses only what was still queued (at most ``cap_bytes``, plus what waited past it: at most the memory
tier's budget, and the tenants' shares, at most another ``cap_bytes``): every put is one LMDB transaction, so a
committed checkpoint survives whole and an interrupted one leaves nothing. The thread lingers ``LINGER_S`` after a
checkpoint arrives (not while anyone drains) and puts the ones queued by then in one transaction (``write_many``;
``Store.put_many``): LMDB's pages per commit are paid once for a request's phases, boundary and finish checkpoints
(issue 21's write amplification), each keeping the outcome a lone put gives it. A small batch (under
``SMALL_BATCH_BYTES``) waits on while checkpoints keep coming, until ``QUIET_S`` passes without one (at most
``LINGER_MAX_S``): so a checkpoint of a small model may take up to ``LINGER_MAX_S`` plus its put to become durable
(the memory tier serves it meanwhile; a SIGKILL loses it with the rest of the queue). A checkpoint's ``rider``
(its continuation record) is written in the same transaction.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, NamedTuple

from spec_cache.store import WriteBehind

log = logging.getLogger("spec_cache")

#: default cap on queued checkpoint bytes
DEFAULT_QUEUE_BYTES = 1 << 30
#: how long the writer waits for more checkpoints to join one transaction (a request's prefill phases, its
#: prompt-boundary and finish checkpoints arrive within about this of each other); the memory tier serves them
#: meanwhile, a drain or close cuts it short, and a SIGKILL inside it loses them as it loses any queued checkpoint
LINGER_S = 0.25
#: a small batch (under ``SMALL_BATCH_BYTES`` queued) waits on while checkpoints keep coming, until none came for
#: ``QUIET_S``, at most ``LINGER_MAX_S`` after its first: a request's prefill phases, end-of-prompt and finish
#: checkpoints (a short reply decodes within it) share one commit (the 20-turn write_amp bench: 59 commits -> 20).
#: Each LMDB commit costs ~40-60 KiB of b-tree, free-list and meta pages whatever it holds: a large share of a
#: small batch's bytes, nothing next to a large one (a batch of 64 MiB or more goes after ``LINGER_S``, as before)
QUIET_S = 1.0
LINGER_MAX_S = 3.0
SMALL_BATCH_BYTES = 64 << 20


class WriterLeft(NamedTuple):
    """What ``CheckpointWriter.stop`` did: checkpoints written while it waited, queued ones dropped (and their
    bytes), and how many were still being written when it gave up (0: none)."""

    written: int
    dropped: int
    dropped_bytes: int
    in_flight: int


class CheckpointWriter:
    """A byte-capped write-behind queue for checkpoints. ``write(job)`` does the put; jobs are callables' args."""

    def __init__(self, write: Callable[[object], None], cap_bytes: int = DEFAULT_QUEUE_BYTES, *,
                 write_many: Callable[[list], int] | None = None):
        """``write_many(jobs)``: when given, the checkpoints queued when the thread gets to them (after lingering
        ``LINGER_S`` for company) are written by one call (one LMDB transaction: ``Store.put_many``), which returns
        how many failed; ``write(job)`` writes one (a lone job, and the back-pressure path)."""
        self._write = write
        self._write_many = write_many
        self._lock = threading.Lock()
        self.counters = {"queued": 0, "inline": 0, "waited": 0, "written": 0, "failed": 0, "refused": 0,
                         "batches": 0, "lent": 0}
        self._queue = WriteBehind(cap_bytes, self._handle, name="spec-cache-write-behind",
                                  batch_handler=None if write_many is None else self._handle_many,
                                  linger_s=LINGER_S, quiet_s=QUIET_S, linger_max_s=LINGER_MAX_S,
                                  small_bytes=SMALL_BATCH_BYTES)

    def submit(self, job, nbytes: int, *, may_wait: bool = False) -> bool:
        """Queue ``job``; when the queue is full, write it now on this thread, unless ``may_wait`` (its state is
        held meanwhile by someone who bounds it: the memory tier), when it is queued past the cap instead. True if
        it was queued.

        After ``close``/``stop`` (the cache is closing, perhaps at interpreter exit while another thread still
        saves) nothing is written: the store may be closing under it. Counted as ``refused``."""
        if self._queue.offer(job, nbytes):
            self._count("queued")
            return True
        if may_wait and self._queue.offer(job, nbytes, over_cap=True):
            self._count("queued")
            self._count("waited")
            return True
        if self._queue.closed:
            self._count("refused")
            log.warning("spec-cache: checkpoint not stored: the cache is closing")
            return False
        self._count("inline")
        self._handle(job)
        return False

    def _handle(self, job) -> None:
        try:
            self._write(job)
            self._count("written")
        except Exception:  # the writer reports its own failures; never let the thread die
            self._count("failed")
            log.exception("spec-cache: checkpoint write failed unexpectedly")

    def _handle_many(self, jobs: list) -> None:
        if len(jobs) == 1:
            self._handle(jobs[0])
            return
        try:
            failed = self._write_many(jobs) or 0
            self._count("written", len(jobs) - failed)
            self._count("failed", failed)
            self._count("batches")
        except Exception:  # the writer reports its own failures; never let the thread die
            self._count("failed", len(jobs))
            log.exception("spec-cache: checkpoint writes failed unexpectedly")

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (``lent``: a queued checkpoint that took a later one's arrays,
        ``SpecCache._lend``)."""
        self._count(name, n)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    @property
    def pending(self) -> tuple[int, int]:
        """(checkpoints queued, their bytes incl. the one being written)."""
        return self._queue.queued

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued checkpoint is committed; True when nothing is left."""
        return self._queue.drain(1e9 if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> int:
        """Drain (up to ``timeout``; None waits for all), stop the thread; returns checkpoints left unwritten."""
        return self._queue.close(1e9 if timeout is None else timeout)

    def stop(self, timeout: float | None = None) -> "WriterLeft":
        """Drain for at most ``timeout`` (None: all of it), then stop: what is still queued is dropped, and a write
        still in progress is not waited for past ``timeout`` (its thread keeps it; do not close the store then)."""
        with self._lock:
            before = self.counters["written"]
        if timeout is None:
            jobs, nbytes, in_flight = self._queue.stop(1e9)
        else:
            jobs, nbytes, in_flight = self._queue.stop(timeout, bounded=True)
        with self._lock:
            written = self.counters["written"] - before
        return WriterLeft(written, jobs, nbytes, in_flight)

    def stats(self) -> dict:
        jobs, nbytes = self.pending
        with self._lock:
            return {**self.counters, "pending": jobs, "pending_bytes": nbytes}
