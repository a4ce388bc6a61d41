"""``WriteBehind``: a byte-bounded FIFO of background jobs, drained by one daemon thread.

``offer(job, nbytes)`` never blocks and never drops on its own: a job that would push the queued bytes past
``cap_bytes`` is refused (``offer`` returns False) and the CALLER decides what a refusal means:

* the shared tier's publisher (``shared/tier.py``) drops it and counts it: a slow or absent Redis must never hold
  up decoding, and the local store still has the checkpoint (the cap bounds how far the shared tier may lag); a
  tenant within its share of the cap has the oldest queued job of the tenant holding the most dropped instead;
* SpecCache's promoter (``spec_cache.tiers.cache``) drops a fetched prefix it could not queue (counted as
  ``promote_dropped``): it was already restored, only its copy into LMDB is lost; tenants share its cap as the
  publisher's;
* the lossless checkpoint writer (``spec_cache.tiers.write_behind.CheckpointWriter``) never drops: it queues past
  the cap (``offer(..., over_cap=True)``) when something else bounds what waits (the memory tier holds the state),
  else it writes the checkpoint itself on the caller's thread (back-pressure).

On their own only ``close``/``stop`` drop jobs (what is still queued when their timeout ends; they report how
many); a caller may take a queued job back out (``drop_oldest``: the publisher, for another tenant's job).

``TenantShares``: how tenants share one capped buffer (issue 37, ninth and tenth attacker passes). A tenant within
its share (the cap / tenants holding something, itself included) that finds the buffer full has the oldest entries
of the tenant holding the most (over its share) taken out instead of losing its own; one tenant alone, nothing
changes. Used by the publisher's and the promoter's ``WriteBehind`` (``TenantShares.offer``) and by the shared
prefetch ``Handoff`` (``make_room`` over its own list).
Jobs are small descriptors (the bytes are read by the handler when it gets to them); ``nbytes`` is what the
handler will still have to move, which is what the cap bounds. Costs one lock and a notify per ``offer``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("spec_cache.store")


class TenantShares:
    """The bytes each tenant holds in one capped buffer, and whose entries go when a tenant within its share finds
    it full. ``offer``/``finished`` lock on their own; ``make_room`` is for a buffer under its caller's lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: dict[Any, int] = {}

    def held(self, tenant: Any) -> int:
        """Bytes ``tenant`` holds (queued or in flight)."""
        return self._held.get(tenant, 0)

    def add(self, tenant: Any, nbytes: int) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + nbytes

    def remove(self, tenant: Any, nbytes: int) -> None:
        left = self._held.get(tenant, 0) - nbytes
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def make_room(self, tenant: Any, nbytes: int, cap: int, used: Callable[[], int],
                  drop_oldest: Callable[[Any], int | None]) -> tuple[bool, int]:
        """Take out other tenants' oldest entries until ``nbytes`` of ``tenant`` fit under ``cap``, where ``tenant``
        is within its share (its bytes with ``nbytes`` at most cap / tenants holding something, itself included)
        and they are over theirs, the one holding the most first. ``used()``: the buffer's bytes now;
        ``drop_oldest(victim)``: take the victim's oldest entry out, its bytes (None: none can go). Returns
        (whether ``nbytes`` fit now, how many entries went); one tenant alone or over its share: (False, 0)."""
        others = {t: n for t, n in self._held.items() if n > 0 and t != tenant}
        share = cap // (len(others) + 1)
        if not others or self.held(tenant) + nbytes > share:
            return False, 0
        dropped = 0
        while used() + nbytes > cap:
            over = [t for t in others if others[t] > share]
            if not over:
                break
            victim = max(over, key=others.__getitem__)
            freed = drop_oldest(victim)
            if freed is None:  # only what it has in flight is left: that cannot go
                del others[victim]
                continue
            others[victim] -= freed
            self.remove(victim, freed)
            dropped += 1
        return used() + nbytes <= cap, dropped

    def offer(self, queue: WriteBehind, job: Any, nbytes: int, tenant: Any,
              tenant_of: Callable[[Any], Any]) -> tuple[bool, int]:
        """``queue.offer(job, nbytes)``, shared fairly: when the queue refuses it, ``make_room`` for ``tenant`` (the
        jobs taken out are the victims' oldest queued ones, ``tenant_of(job)`` naming a queued job's tenant) and
        offer again. Returns (queued, how many queued jobs of others were taken out for it). The queue's handler
        calls ``finished(tenant, nbytes)`` for every job it was handed."""
        with self.lock:  # one offer at a time: what it takes out and what each tenant holds agree
            ok, dropped = queue.offer(job, nbytes), 0
            if not ok:
                fits, dropped = self.make_room(
                    tenant, nbytes, queue.cap_bytes, lambda: queue.queued[1],
                    lambda victim: queue.drop_oldest(lambda j: tenant_of(j) == victim))
                ok = fits and queue.offer(job, nbytes)
            if ok:
                self.add(tenant, nbytes)
            return ok, dropped

    def finished(self, tenant: Any, nbytes: int) -> None:
        """A job ``offer`` queued was handled (whatever came of it): its bytes no longer count."""
        with self.lock:
            self.remove(tenant, nbytes)


class WriteBehind:
    """A byte-capped FIFO served by a daemon thread that calls ``handler(job)`` for each job."""

    def __init__(self, cap_bytes: int, handler: Callable[[Any], None], name: str = "spec-cache-write-behind", *,
                 batch_handler: Callable[[list], None] | None = None, max_batch: int = 16, linger_s: float = 0.0,
                 quiet_s: float = 0.0, linger_max_s: float = 0.0, small_bytes: int = 0):
        """``batch_handler``: when given, the thread hands it every job queued at that moment (at most
        ``max_batch``) in one call instead of calling ``handler`` job by job (one LMDB commit for several); with
        ``linger_s``, it first waits that long for more jobs to join the first (``drain``/``close`` cut it short).
        A small batch (queued bytes under ``small_bytes``) waits on while jobs keep coming: until none came for
        ``quiet_s``, at most ``linger_max_s`` after the first (a burst shares one commit; a commit's fixed cost
        matters only next to small batches)."""
        self.cap_bytes = cap_bytes
        self._handler = handler
        self._batch_handler = batch_handler
        self._max_batch = max(1, max_batch)
        self._linger_s = linger_s if batch_handler is not None else 0.0
        self._quiet_s, self._linger_max_s, self._small_bytes = quiet_s, max(linger_s, linger_max_s), small_bytes
        self._last_offer = 0.0
        self._hurry = 0  # drains waiting: no lingering while someone waits for the queue
        self._in_flight = 0  # jobs handed to the handler and not finished
        self._jobs: collections.deque[tuple[Any, int]] = collections.deque()
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> tuple[int, int]:
        """(jobs waiting, bytes of the jobs waiting and of the one in flight)."""
        with self._cond:
            return len(self._jobs), self._bytes

    @property
    def closed(self) -> bool:
        """Whether ``close``/``stop`` was called (every ``offer`` is refused from then on)."""
        with self._cond:
            return self._closed

    def offer(self, job: Any, nbytes: int, *, over_cap: bool = False) -> bool:
        """Queue ``job`` (about ``nbytes`` to move); False (refused: not queued, the caller decides whether to drop
        it, write it itself or wait) if it does not fit under the cap. ``over_cap``: queue it even past the cap (the
        caller bounds what waits by other means); never once closed."""
        with self._cond:
            if self._closed or (self._bytes + nbytes > self.cap_bytes and not over_cap):
                return False
            self._jobs.append((job, nbytes))
            self._bytes += nbytes
            self._last_offer = time.monotonic()
            self._cond.notify_all()
            return True

    def drop_oldest(self, match: Callable[[Any], bool]) -> int | None:
        """Take the oldest queued job that ``match`` accepts out of the queue (never the one in flight): its
        ``nbytes``, or None when no queued job matches. For a caller that drops anyway (the shared tier's
        publisher) and would rather drop another job than the one it offers."""
        with self._cond:
            for i, (job, nbytes) in enumerate(self._jobs):
                if match(job):
                    del self._jobs[i]
                    self._bytes -= nbytes
                    self._cond.notify_all()
                    return nbytes
        return None

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job was handled (or ``timeout`` passed); True if the queue is empty and idle."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while self._jobs or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._hurry -= 1

    def close(self, timeout: float) -> int:
        """Stop accepting jobs, wait up to ``timeout`` for the queue to drain, drop the rest, stop the thread.

        The job in flight is always waited for (the handler's own timeouts bound it): it may be reading the local
        store, which the caller closes next. Returns how many queued jobs were dropped.
        """
        return self.stop(timeout)[0]

    def stop(self, timeout: float, *, bounded: bool = False) -> tuple[int, int, int]:
        """``close``, telling what was left: (jobs dropped, their bytes, jobs still in flight: 0 when none).

        ``bounded``: the whole call takes at most ``timeout``, the job in flight included (at interpreter exit
        nothing may hang); a job still in flight then stays with its thread, and the caller must not close what
        that job uses.
        """
        deadline = time.monotonic() + timeout
        self.drain(timeout)
        with self._cond:
            self._closed = True
            left = len(self._jobs)
            left_bytes = sum(nbytes for _, nbytes in self._jobs)
            self._bytes -= left_bytes
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()) if bounded else None)
        with self._cond:
            in_flight = max(1, self._in_flight) if self._thread.is_alive() else 0
        return left, left_bytes, in_flight

    def _linger_until(self, first: float) -> float:
        """When the batch whose first job the thread took at ``first`` goes (under ``_cond``)."""
        until = first + self._linger_s
        if self._quiet_s and self._bytes < self._small_bytes:
            until = max(until, min(self._last_offer + self._quiet_s, first + self._linger_max_s))
        return until

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                first = time.monotonic()
                while (self._linger_s and len(self._jobs) < self._max_batch and not self._hurry
                       and not self._closed):
                    left = self._linger_until(first) - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                take = 1 if self._batch_handler is None else min(len(self._jobs), self._max_batch)
                batch = [self._jobs.popleft() for _ in range(take)]
                self._busy, self._in_flight = True, len(batch)
            try:
                if self._batch_handler is None:
                    self._handler(batch[0][0])
                else:
                    self._batch_handler([job for job, _ in batch])
            except Exception:  # the handler counts its own failures; never let the thread die
                log.exception("write-behind: a job failed unexpectedly")
            finally:
                with self._cond:
                    self._bytes -= sum(nbytes for _, nbytes in batch)
                    self._busy, self._in_flight = False, 0
                    self._cond.notify_all()
