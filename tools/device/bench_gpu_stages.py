"""Where an LMDB restore's time goes (the GPU driver's ``gpu_8b`` section, ``bench_gpu_8b.next_turn``): each stage
of ``SpecCache.restore`` timed on its own, or through instrumentation that wraps the store's checksum function and
its wait for background checksums while installed (``_probe``); nothing in the library changes.

The store's read path is being reworked (issue 21: checksums on several threads, copies fused with them), so every
figure says how it was obtained, and one the current code does not expose comes back as None, never as 0.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager


class _Probe:
    """Seconds spent waiting for background checksums (``BackgroundVerifier.wait``) and hashing records
    (``store.codec.checksum``: on the thread that installed the probe, and on any other thread), while installed.
    Hashing fused with copies (``store.fill``'s lanes) does not go through ``codec.checksum`` and is not seen."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner = threading.get_ident()
        self.reset()

    def reset(self) -> None:
        self.wait_s = self.hash_here_s = self.hash_elsewhere_s = 0.0
        self.hash_calls = 0

    def add_hash(self, seconds: float) -> None:
        with self.lock:
            if threading.get_ident() == self.owner:
                self.hash_here_s += seconds
            else:
                self.hash_elsewhere_s += seconds
            self.hash_calls += 1


@contextmanager
def _probe():
    from spec_cache.store import codec, read

    probe = _Probe()
    undo = []
    wait = read.BackgroundVerifier.__dict__.get("wait")
    if isinstance(wait, staticmethod):
        def timed_wait(pending, _f=wait.__func__):
            t0 = time.perf_counter()
            try:
                return _f(pending)
            finally:
                probe.wait_s += time.perf_counter() - t0
        read.BackgroundVerifier.wait = staticmethod(timed_wait)
        undo.append(lambda: setattr(read.BackgroundVerifier, "wait", wait))
    checksum = getattr(codec, "checksum", None)
    if callable(checksum):
        def timed_checksum(*a, _f=checksum, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                probe.add_hash(time.perf_counter() - t0)
        codec.checksum = timed_checksum
        undo.append(lambda: setattr(codec, "checksum", checksum))
    try:
        yield probe
    finally:
        for u in reversed(undo):
            u()


def _no_copy(pieces, axis, dtype):
    """A ``concat`` that copies nothing: ``Store.fetch`` then costs the reads, decoding and checks only."""
    return None


def restore_stages(cache, ns_key: bytes, key: list, reps: int) -> dict:
    """Medians over ``reps`` (after one untimed) of the stages of ``cache.restore(ns_key, key)`` from LMDB (memory
    tier off):

    * ``lookup_s``: ``Store.lookup`` (the index only);
    * ``fetch_s``: ``Store.fetch`` with a concat that copies nothing, less its hashing on the calling thread and
      its wait for background checksums: LMDB reads, record decode, key/token/length checks;
    * ``verify_s``: in the real restore, the calling thread's own hashing plus its wait for background checksums
      (what verification costs the restore beyond what overlaps); ``checksum_s``: seconds hashed per restore on
      all threads (None where hashing is fused with the copies and not seen);
    * ``host_copy_s``: on the staging route (GPU), the loader's threaded copies out of the map; on other routes,
      the real restore's call minus the copy-less fetch (copies into MLX, with whatever is fused with them);
    * ``upload_s``: on the staging route, waits for staging regions + the eval after ``restore`` returns (device
      copies still in flight); elsewhere that eval;
    * ``restore_s``: ``cache.restore`` + eval of every array; ``other_s``: what the stages above leave of it
      (Python per tensor, rebuilding caches; negative where stages overlap).
    """
    import mlx.core as mx

    from spec_cache.state import device_copy
    from spec_cache.state.cache_state import restore_concat

    store = cache.store
    n = len(key)
    concat = restore_concat()
    loader = concat if isinstance(concat, device_copy.StagingLoader) else None
    out: dict = {"tokens": n, "reps": reps, "route": type(concat).__name__ if concat is not None else "numpy"}

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def fetch():
        r = store.fetch(ns_key, key, concat=_no_copy)
        if r is None or r.length != n:
            raise AssertionError(f"fetch of the stored prompt restored {None if r is None else r.length}")

    def restore():
        t0 = time.perf_counter()
        r = cache.restore(ns_key, key)
        t1 = time.perf_counter()
        if r is None or r.length != n or r.tier != "local":
            raise AssertionError(f"restore of the stored prompt gave {r and (r.length, r.tier)}")
        mx.eval([c.state for c in r.caches])
        return t1 - t0, time.perf_counter() - t1

    out["lookup_s"] = statistics.median(timed(lambda: store.lookup(ns_key, key)) for _ in range(reps))
    fetches, rows = [], []
    with _probe() as probe:
        for k in range(reps + 1):  # the first of each untimed
            probe.reset()
            t = timed(fetch)
            if k:
                fetches.append({"t": t, "wait": probe.wait_s, "here": probe.hash_here_s})
        for k in range(reps + 1):
            probe.reset()
            if loader is not None:
                loader.reset_counters()
            call_s, eval_s = restore()
            c = loader.counters() if loader is not None else {}
            if k:
                rows.append({"restore_s": call_s + eval_s, "call_s": call_s, "eval_s": eval_s,
                             "verify_s": probe.hash_here_s + probe.wait_s, "verify_wait_s": probe.wait_s,
                             "checksum_s": probe.hash_here_s + probe.hash_elsewhere_s,
                             "checksum_calls": probe.hash_calls, "staging_calls": c.get("calls"),
                             "staging_copy_s": c.get("copy_s"), "staging_wait_s": c.get("wait_s"),
                             "staging_bytes": c.get("bytes")})

    def med(rows, name):
        values = [x[name] for x in rows if x[name] is not None]
        return statistics.median(values) if values else None
    out["fetch_no_copy_s"] = med(fetches, "t")
    out["fetch_s"] = statistics.median(x["t"] - x["wait"] - x["here"] for x in fetches)
    for name in ("restore_s", "call_s", "eval_s", "verify_s", "verify_wait_s", "checksum_s", "checksum_calls",
                 "staging_calls", "staging_copy_s", "staging_wait_s", "staging_bytes"):
        out[name] = med(rows, name)
    if not out["checksum_calls"]:
        out["checksum_s"] = None  # hashing did not go through codec.checksum (fused with the copies)
    if out["staging_calls"]:  # the staging route was taken
        out["host_copy_s"] = out["staging_copy_s"]
        out["upload_s"] = out["staging_wait_s"] + out["eval_s"]
        out["copy_how"] = "staging loader counters"
    else:
        out["host_copy_s"] = out["call_s"] - out["fetch_no_copy_s"]
        out["upload_s"] = out["eval_s"]
        out["copy_how"] = "restore call minus the copy-less fetch"
    out["other_s"] = out["restore_s"] - sum(out[k] for k in ("lookup_s", "fetch_s", "verify_s", "host_copy_s",
                                                             "upload_s"))
    return out
