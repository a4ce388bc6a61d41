"""Bytes stored for prompts sharing a long prefix, against one mlx-lm prompt-cache file per prompt.

100 prompts = one shared 4096-token prefix + a distinct 64-token suffix each; the KV state of every prompt is
stored through ``Store.put`` (chunks shared) and, as the baseline, written with mlx-lm's ``save_prompt_cache``
(one file per prompt, as an engine without a prefix store would keep them). Ideal ratio: (100 x 4160) / (4096 +
100 x 64) = 39.6x token-states.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np


def run(prompts: int = 100, prefix: int = 4096, suffix: int = 64, *, layers: int = 8, kv_heads: int = 4,
        head_dim: int = 64) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    from spec_cache.naming.namespace import namespace_key
    from spec_cache.state.cache_state import capture_caches
    from spec_cache.store import Store, maintenance

    rng = np.random.default_rng(0)
    total = prefix + suffix
    work = tempfile.mkdtemp(prefix="bench-dedup-")
    store = Store.open(os.path.join(work, "store"), durable=False, map_size=16 << 30)
    ns = namespace_key("0" * 64, "dedup")
    store.register_namespace(ns, target="0" * 64, prefix_namespace="dedup")
    shared = [mx.array(rng.standard_normal((2, 1, kv_heads, prefix, head_dim), dtype=np.float32))
              for _ in range(layers)]
    base_tokens = rng.integers(0, 32000, prefix).tolist()
    file_bytes = 0
    path = os.path.join(work, "p.safetensors")
    for p in range(prompts):
        tokens = base_tokens + rng.integers(0, 32000, suffix).tolist()
        caches = []
        for layer in range(layers):
            tail = mx.array(rng.standard_normal((2, 1, kv_heads, suffix, head_dim), dtype=np.float32))
            kv = mx.concatenate([shared[layer], tail], axis=3)
            c = KVCache()
            c.update_and_fetch(kv[0], kv[1])
            caches.append(c)
        store.put(ns, tokens, capture_caches(caches))
        save_prompt_cache(path, caches)
        file_bytes += os.path.getsize(path)
    stats = maintenance.stats(store)
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    ideal = prompts * total / (prefix + prompts * suffix)
    return {"prompts": prompts, "prefix_tokens": prefix, "suffix_tokens": suffix, "store_bytes": stats["bytes"],
            "mlx_lm_file_bytes": file_bytes, "dedup_bytes_ratio": file_bytes / stats["bytes"],
            "ideal_token_state_ratio": ideal}
