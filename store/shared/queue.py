"""The write-behind queue: checkpoints waiting to be published, bounded in bytes, drained by one thread.

``offer`` never blocks: a checkpoint that would push the queued bytes past the cap is dropped (and counted), so a
slow or absent shared tier can never hold up decoding. Jobs are small descriptors (the bytes are read from LMDB
by the worker when it gets to them); the cap bounds the bytes the worker still has to send, i.e. how far the
shared tier may lag behind the local one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("spec_cache.shared")


class WriteBehind:
    """A byte-capped FIFO served by a daemon thread that calls ``handler(job)`` for each job."""

    def __init__(self, cap_bytes: int, handler: Callable[[Any], None], name: str = "spec-cache-shared-publish"):
        self.cap_bytes = cap_bytes
        self._handler = handler
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

    def offer(self, job: Any, nbytes: int) -> bool:
        """Queue ``job`` (about ``nbytes`` to send); False (dropped) if it does not fit under the cap."""
        with self._cond:
            if self._closed or self._bytes + nbytes > self.cap_bytes:
                return False
            self._jobs.append((job, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()
            return True

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job was handled (or ``timeout`` passed); True if the queue is empty and idle."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> int:
        """Stop accepting jobs, wait up to ``timeout`` for the queue to drain, drop the rest, stop the thread.

        The job in flight is always waited for (the handler's own timeouts bound it): it may be reading the local
        store, which the caller closes next. Returns how many queued jobs were dropped.
        """
        return self.stop(timeout)[0]

    def stop(self, timeout: float, *, bounded: bool = False) -> tuple[int, int, bool]:
        """``close``, telling what was left: (jobs dropped, their bytes, whether a job is still in flight).

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
        return left, left_bytes, self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, nbytes = self._jobs.popleft()
                self._busy = True
            try:
                self._handler(job)
            except Exception:  # the handler counts its own failures; never let the thread die
                log.exception("shared tier: publish failed unexpectedly")
            finally:
                with self._cond:
                    self._bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()
