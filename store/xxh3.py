"""XXH3-128 that releases the GIL, so several records are checksummed at once on several cores.

python-xxhash holds the GIL while it hashes (measured: two threads hashing 64 MiB each take 2.5x one thread),
so a restore verified on "background" threads still ran its checksums one at a time and stalled the thread
copying tensors out. The digest here is the same function from the same compiled code: python-xxhash's own
extension library exports xxHash's C API (``XXH3_128bits_update`` and, in builds with run-time CPU dispatch,
``XXH3_128bits_update_dispatch``), and a ctypes call releases the GIL for its duration. Nothing new is installed
and the record format does not change (the same XXH3-128 digest, checked against python-xxhash at import).

Where the library cannot be loaded, its symbols are missing or the self-check disagrees, ``Hasher`` falls back
to python-xxhash (same digests, GIL held): ``NOGIL`` says which one runs.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import xxhash

__all__ = ["Hasher", "NOGIL", "xxh3_128_digest"]

log = logging.getLogger("spec_cache.store")
#: below this many bytes an update goes through python-xxhash (a ctypes call costs ~1 µs; nothing to overlap)
NOGIL_MIN_BYTES = 64 << 10


class _Canonical(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load():
    """(create, free, reset, update, digest) from python-xxhash's extension library, or None."""
    try:
        from xxhash import _xxhash

        lib = ctypes.CDLL(_xxhash.__file__)
        update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
        create, free, reset, digest = (lib.XXH3_createState, lib.XXH3_freeState, lib.XXH3_128bits_reset,
                                       lib.XXH3_128bits_digest)
    except (ImportError, OSError, AttributeError) as exc:
        log.debug("GIL-free XXH3 unavailable (%s); checksums hold the GIL", exc)
        return None
    create.restype, create.argtypes = ctypes.c_void_p, []
    free.restype, free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
    update.restype, update.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    digest.restype, digest.argtypes = _Canonical, [ctypes.c_void_p]
    return create, free, reset, update, digest


_LIB = _load()


def _address(buf) -> tuple[int, int, object]:
    """(address, length, keep-alive) of a contiguous buffer (read-only ones included: LMDB's map)."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    return arr.ctypes.data, arr.size, arr


class Hasher:
    """An incremental XXH3-128 (seed 0): ``update`` buffers in order, ``digest`` the canonical 16 bytes, equal to
    ``xxhash.xxh3_128`` over the same bytes. Large updates release the GIL when ``NOGIL``."""

    __slots__ = ("_state", "_py")

    def __init__(self):
        self._state = None
        self._py = None
        if _LIB is not None:
            state = _LIB[0]()
            if state and _LIB[2](state) == 0:
                self._state = state
            elif state:
                _LIB[1](state)
        if self._state is None:
            self._py = xxhash.xxh3_128()

    def update(self, buf) -> None:
        if self._py is not None:
            self._py.update(buf)
            return
        if self._state is None:
            raise ValueError("update on a closed Hasher")
        address, n, keep = _address(buf)
        if n and _LIB[3](self._state, address, n) != 0:
            raise RuntimeError("XXH3_128bits_update failed")
        del keep

    def update_bytes(self, arr: np.ndarray) -> None:
        """``update`` for a C-contiguous uint8 numpy array (no buffer wrapping: a restore makes hundreds)."""
        if self._py is not None:
            self._py.update(arr)
            return
        if self._state is None:
            raise ValueError("update on a closed Hasher")
        if arr.size and _LIB[3](self._state, arr.ctypes.data, arr.size) != 0:
            raise RuntimeError("XXH3_128bits_update failed")

    def digest(self) -> bytes:
        if self._py is not None:
            return self._py.digest()
        if self._state is None:
            raise ValueError("digest of a closed Hasher")
        d = _LIB[4](self._state)
        return d.high64.to_bytes(8, "big") + d.low64.to_bytes(8, "big")

    def close(self) -> None:
        if self._state is not None:
            _LIB[1](self._state)
            self._state = None

    def __del__(self):
        state, self._state = self._state, None
        if state is not None and _LIB is not None:
            _LIB[1](state)


def xxh3_128_digest(*parts) -> bytes:
    """XXH3-128 of ``parts`` concatenated (canonical big-endian digest)."""
    if _LIB is None or sum(memoryview(p).nbytes for p in parts) < NOGIL_MIN_BYTES:
        h = xxhash.xxh3_128()
        for p in parts:
            h.update(p)
        return h.digest()
    h = Hasher()
    try:
        for p in parts:
            h.update(p)
        return h.digest()
    finally:
        h.close()


def _self_check() -> bool:
    """The ctypes route must give python-xxhash's digests (sizes across XXH3's internal code paths)."""
    data = np.random.default_rng(7).integers(0, 256, (1 << 20) + 77, dtype=np.uint8)
    for n in (0, 1, 16, 17, 128, 129, 240, 241, 1024, 65536 + 3, data.size):
        h = Hasher()
        try:
            h.update(data[:n // 3])
            h.update(data[n // 3:n])
            ok = h.digest() == xxhash.xxh3_128(data[:n]).digest()
        finally:
            h.close()
        if not ok:
            return False
    return True


if _LIB is not None and not _self_check():
    log.warning("GIL-free XXH3 disagrees with python-xxhash; checksums hold the GIL")
    _LIB = None
NOGIL = _LIB is not None
