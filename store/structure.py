"""LMDB's own structure, checked without liblmdb: the pages, not the values.

LMDB 0.9 has no page checksums. A damaged branch or leaf page can make liblmdb return ``MDB_CORRUPTED`` (which
the store reports as a ``StoreError``) but also trip an ``assert`` or read out of bounds, which kills the
process. py-lmdb >= 3.0 ships a pure-Python verifier (``lmdb.verify``) that walks every page reachable from
the committed meta with plain file reads; nothing in it can crash on hostile bytes. ``verify`` and ``gc`` run it
before they walk the sub-databases with cursors, and ``repair`` uses it to say what it found.

Cost: about 10 µs per stored row (values in overflow pages are not read): 0.05 s for a 1 GiB store of 400
checkpoints, 0.2 s for 20 000 small ones.
"""

from __future__ import annotations

import os

try:  # py-lmdb >= 3.0
    from lmdb import verify as _lmdb_verify
except ImportError:  # pragma: no cover - older py-lmdb
    _lmdb_verify = None

AVAILABLE = _lmdb_verify is not None


def check_structure(path: str, env=None) -> list[str] | None:
    """Problems in the page structure of ``path``/data.mdb ([] = sound), or None when the verifier is not
    available (py-lmdb < 3.0).

    The verifier is an offline tool: it takes the file's size when it opens it, then walks the newest committed
    meta. With ``env`` (an open ``lmdb.Environment`` of that path, perhaps written by other processes) a commit
    between the two reads makes a sound store look damaged ("reachable page N is beyond EOF"), and pages of a
    meta newer than our read snapshot may be reused under the walk. So a walk that found problems while the
    committed transaction id moved is not believed: it runs again with the write lock held (no commit can land
    during it; writers wait a walk's length, about 10 µs a row), which gives the answer. A read-only
    environment cannot take the lock: it walks again until a walk sees no commit (a few tries).
    """
    if _lmdb_verify is None:
        return None
    if env is None:
        return _walk(path)
    for _ in range(_QUIET_TRIES):
        before = env.info()["last_txnid"]
        txn = env.begin()  # pins our snapshot's pages while the walk reads them
        try:
            found = _walk(path)
        finally:
            txn.abort()
        if not found or env.info()["last_txnid"] == before:
            return found
        if not env.flags().get("readonly"):
            lock = env.begin(write=True)  # no commit lands during this walk; nothing is written under it
            try:
                return _walk(path)
            finally:
                lock.abort()
    return found


_QUIET_TRIES = 5  # walks of a read-only environment before its last answer stands


def _walk(path: str) -> list[str]:
    data = os.path.join(path, "data.mdb")
    try:
        return list(_lmdb_verify.verify(data, subdir=False))
    except _lmdb_verify.VerifyError as exc:
        return [f"not a readable LMDB file: {exc}"]
    except OSError as exc:
        return [f"cannot read {data}: {exc.strerror or exc}"]
