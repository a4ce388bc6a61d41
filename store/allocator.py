"""glibc's malloc thresholds for LMDB's large transaction buffers (see ``store.env``'s write-path notes).

glibc serves each 16 MiB value LMDB mallocs from fresh memory (mmap'd, or heap top trimmed back after every
commit) and the copy into it page-faults at the VM's first-touch rate: a writable store therefore sets
``M_MMAP_THRESHOLD`` (32 MiB, the most glibc allows) and ``M_TRIM_THRESHOLD`` once per process, unless the
process chose its own malloc settings or ``SPEC_CACHE_MALLOC_TUNE=0``. Process-wide: it speeds up every large
copy in the process (mlx-lm's own loads included), at the cost of up to ``TRIM_THRESHOLD_BYTES`` of freed heap
kept mapped for reuse.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

TRIM_THRESHOLD_BYTES = 512 << 20  # freed heap glibc keeps mapped
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest value glibc's mallopt accepts on 64-bit

_allocator_tuned: bool | None = None
_allocator_lock = threading.Lock()


def tune_allocator() -> bool:
    """Keep glibc from handing LMDB's large transaction buffers out as fresh pages on every put (see the module
    docstring). Once per process; a no-op off glibc, when the process chose its own malloc settings, or with
    ``SPEC_CACHE_MALLOC_TUNE=0``. Returns whether the thresholds are set."""
    global _allocator_tuned
    with _allocator_lock:
        if _allocator_tuned is not None:
            return _allocator_tuned
        _allocator_tuned = False
        if os.environ.get("SPEC_CACHE_MALLOC_TUNE", "1") == "0" or platform.system() != "Linux":
            return False
        if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                                         "MALLOC_MMAP_MAX_")) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
            return False
        try:
            if platform.libc_ver()[0] != "glibc":
                return False
            libc = ctypes.CDLL(None)
            mallopt = libc.mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
            _allocator_tuned = bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)) and \
                bool(mallopt(m_trim_threshold, TRIM_THRESHOLD_BYTES))
        except (OSError, AttributeError, ValueError):
            _allocator_tuned = False
        return _allocator_tuned


def allocator_tuned() -> bool:
    """Whether this process runs with the thresholds set (for benchmarks)."""
    return bool(_allocator_tuned)
