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

    With ``env`` (an open ``lmdb.Environment`` of that path) a read transaction is held during the walk, so
    writers in other processes cannot reuse the pages being read (their snapshot stays pinned).
    """
    if _lmdb_verify is None:
        return None
    data = os.path.join(path, "data.mdb")
    txn = env.begin() if env is not None else None
    try:
        return list(_lmdb_verify.verify(data, subdir=False))
    except _lmdb_verify.VerifyError as exc:
        return [f"not a readable LMDB file: {exc}"]
    except OSError as exc:
        return [f"cannot read {data}: {exc.strerror or exc}"]
    finally:
        if txn is not None:
            txn.abort()
