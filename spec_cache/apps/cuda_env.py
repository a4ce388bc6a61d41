"""Environment defaults a long-running MLX process needs on MLX's CUDA backend, set before its device starts.

Why: MLX's CUDA backend keeps LRU caches keyed by exact shapes (cuDNN attention plans: 256,
``MLX_CUDA_SDPA_CACHE_SIZE``; CUDA graphs: 400, ``MLX_CUDA_GRAPH_CACHE_SIZE``) and, while
``MLX_ENABLE_CACHE_THRASHING_CHECK`` is on (its default), throws "Cache thrashing is happening" once a cache's
*lifetime* misses pass twice its capacity (``lru_cache.h`` in MLX 0.32; the counter never resets). A server meets a
new attention shape at nearly every prefill chunk and every verify window (the keys grow each step), so after ~512
of them every new one raises in ``mx.eval``, or aborts the process where it is thrown on a worker thread (reported
for a speculative MLX CUDA server: lablup/mlxcel#818). The check only ever raises; turned off, each cache just
evicts its least recently used entry. A value the user set is kept. Nothing changes on other backends (the
variable is read by the CUDA caches alone).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

THRASHING_CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def relax_cache_checks(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn MLX's cache-thrashing throw off unless the user set it; True if this call set it. Call before the
    process's first GPU operation (the caches read it when they are made)."""
    environ = os.environ if environ is None else environ
    if THRASHING_CHECK in environ:
        return False
    environ[THRASHING_CHECK] = "0"
    return True
