"""``TxnGate``: read transactions of one process share it; a map resize takes it alone.

LMDB's ``mdb_env_set_mapsize`` may run only while the process has no transaction open. The store used to get that
by holding its one lock around every read transaction as well as every write, so a reader (the server's scheduler
thread looking up a continuation record or restoring a prefix) waited for a whole write transaction on the
write-behind thread: encoding, hashing and committing a checkpoint of hundreds of MiB (issue 35's H100 trace: 3.3 s
of the scheduler thread's time in ``Store.reading``). Readers never need to wait for a writer (LMDB readers see a
snapshot), only a resize needs the readers gone, and resizes are rare (the map doubles). So: readers enter shared,
a resize waits until no other thread holds a read transaction, and new readers wait while it runs.

Readers are preferred (a reader never waits for a resize that is merely waiting), so a thread that nests read
transactions never deadlocks against a resize; and a thread that resizes while it holds a read transaction itself
(a write inside a read, as LMDB itself tolerates from one thread) waits only for the others.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["TxnGate"]


class TxnGate:
    """Shared entry for read transactions, exclusive entry for a map resize (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers: dict[int, int] = {}  # thread ident -> read transactions it holds
        self._resizing = False

    def enter_read(self) -> None:
        me = threading.get_ident()
        with self._cond:
            while self._resizing and not self._readers.get(me):
                self._cond.wait()
            self._readers[me] = self._readers.get(me, 0) + 1

    def leave_read(self) -> None:
        me = threading.get_ident()
        with self._cond:
            left = self._readers.get(me, 0) - 1
            if left > 0:
                self._readers[me] = left
            else:
                self._readers.pop(me, None)
                self._cond.notify_all()

    @property
    def readers(self) -> int:
        """Read transactions open in this process through the gate (all threads)."""
        with self._cond:
            return sum(self._readers.values())

    @contextlib.contextmanager
    def exclusive(self):
        """Held while the map is resized: no other thread of the process has a read transaction open."""
        me = threading.get_ident()
        with self._cond:
            while self._resizing or any(n for ident, n in self._readers.items() if ident != me):
                self._cond.wait()
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
