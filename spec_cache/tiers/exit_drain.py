"""The exit drain: checkpoints queued behind requests reach LMDB even when a script never closes its cache.

``SpecCache`` queues LMDB writes on a daemon thread; a script that simply ends (or ends by an uncaught exception)
would lose them, since daemon threads are stopped when the interpreter finalizes. One ``atexit`` hook closes every
cache of this process that is still open, each bounded by its ``exit_timeout_s``, and logs what it wrote and what
it had to leave.

Why ``atexit`` and not ``threading._register_atexit``: CPython runs ``atexit`` hooks after it has joined the
non-daemon threads (so a worker thread's last ``save`` is queued already) and before it stops the daemon threads
(so the writer thread still runs and the MLX arrays it copies from are alive; ``tests/library/test_durability.py``).
``threading._register_atexit`` hooks run before the non-daemon threads are joined, when those may still save.
Caches are held weakly (the registry never keeps one alive) and leave it on ``close()``. A forked child inherits
the registry but not the writer thread or a usable LMDB handle: only caches opened by this process are closed.
Not covered: ``os._exit``, SIGKILL, and signals whose default action kills the process (SIGTERM without a handler;
the servers install one): ``durability="sync"`` is the mode for those.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref

log = logging.getLogger("spec_cache")

#: default bound on the exit drain of one cache (seconds)
DEFAULT_EXIT_TIMEOUT_S = 30.0

_open: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def track(cache) -> None:
    """Close ``cache`` at interpreter exit unless it is closed first (``untrack``)."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(_at_exit)
            _hooked = True
        _open.add(cache)


def untrack(cache) -> None:
    with _lock:
        _open.discard(cache)


def _at_exit() -> None:
    started = time.monotonic()  # every cache's bound counts from here: their writer threads drain in parallel
    with _lock:
        caches = [c for c in _open if getattr(c, "_pid", None) == os.getpid()]
    for cache in caches:
        try:
            close_at_exit(cache, started)
        except Exception:  # one cache's failure must not stop the others' drain, nor the exit
            log.exception("spec-cache: closing a cache at exit failed")


def close_at_exit(cache, started: float) -> None:
    """Close ``cache`` by ``started + cache.exit_timeout_s``, logging what was written and what was left."""
    left = cache._shutdown(max(0.0, started + cache.exit_timeout_s - time.monotonic()))
    if left is None:
        return
    waited = time.monotonic() - started
    where = cache.store.path
    if left.dropped or left.in_flight:
        stuck = f" {int(left.in_flight)} still being written (abandoned: LMDB drops its unfinished transaction; the " \
                "store is left open for the OS to release)," if left.in_flight else ""
        _report(logging.WARNING, "spec-cache: at exit, gave up on %s after %.1f s (exit_timeout_s): %d written,%s "
                "%d queued checkpoints (%d bytes) not written", where, waited, left.written, stuck, left.dropped,
                left.dropped_bytes)
    elif left.written:
        _report(logging.INFO, "spec-cache: at exit, wrote %d queued checkpoints to %s in %.2f s", left.written,
                where, waited)


def _report(level: int, message: str, *args) -> None:
    """Log; a loss also goes to stderr when no handler would show it (the package installs a NullHandler, and a
    script that ends without closing its cache has often configured no logging either)."""
    log.log(level, message, *args)
    if level >= logging.WARNING and not _shown(log, level):
        print(message % args, file=sys.stderr, flush=True)


def _shown(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` reaches a handler that is not a ``NullHandler``."""
    if not logger.isEnabledFor(level):
        return False
    current = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and level >= h.level for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False
