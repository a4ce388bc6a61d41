"""TTFT of a cold prefill vs a restore from the store, through the public ``Generator`` API.

Default model: llama, hidden 1024, 8 layers, 16 heads / 4 KV heads (head_dim 64), intermediate 2816, vocab 32000,
float32, random weights written locally; drafter: the assistant, whose row is restored too. Cold = no cache;
warm = the same prompt again after a first run stored its prompt-boundary checkpoint (store reopened, page cache
warm). Median of N runs each.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np


def blas_in_use() -> str:
    """Which matrix library runs the model: the GPU, or on CPU OpenBLAS (preloaded) vs mlx's reference BLAS."""
    import mlx.core as mx

    if "gpu" in str(mx.default_device()).lower():
        return f"GPU ({mx.default_device()})"
    preload = os.environ.get("LD_PRELOAD", "")
    return "openblas (LD_PRELOAD)" if "openblas" in preload else "mlx bundled reference BLAS"


def length_key(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def run(lengths=(1024, 4096), *, warm_reps: int = 5, cold_reps: int = 1, hidden: int = 1024, layers: int = 8,
        vocab: int = 32000, progress=print) -> dict:
    from spec_cache.cache import SpecCache
    from spec_cache.generator import Generator
    from spec_cache.tiny import write_tiny_drafter, write_tiny_target

    work = tempfile.mkdtemp(prefix="bench-ttft-")
    target = write_tiny_target(os.path.join(work, "target"), hidden_size=hidden, num_layers=layers,
                               num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
                               intermediate_size=int(hidden * 2.75), vocab_size=vocab, tokenizer=False)
    drafter = write_tiny_drafter(os.path.join(work, "assistant"), "assistant", target, seed=1)
    rng = np.random.default_rng(0)
    out = {"model": f"llama hidden {hidden}, {layers} layers, vocab {vocab}, float32", "drafter": "assistant",
           "blas": blas_in_use(), "cold_reps": cold_reps, "warm_reps": warm_reps, "curve": []}
    cold_gen = Generator.load(target, drafter)
    cold_gen.generate([[1, 2, 3]], max_tokens=1)  # warm up MLX
    for n in lengths:
        prompt = rng.integers(3, vocab, n).tolist()
        cold = [cold_gen.generate([prompt], max_tokens=1)[0] for _ in range(cold_reps)]
        store_dir = os.path.join(work, f"store-{n}")
        with SpecCache.open(store_dir) as cache:
            Generator.load(target, drafter, cache=cache).generate([prompt], max_tokens=1)
        with SpecCache.open(store_dir) as cache:
            gen = Generator.load(target, drafter, cache=cache)
            warm = [gen.generate([prompt], max_tokens=1)[0] for _ in range(warm_reps)]
        if not all(w.cached_tokens == n - 1 and w.restored_drafter and w.tokens == cold[0].tokens for w in warm):
            raise AssertionError("warm run did not restore the full prefix or changed the tokens")
        c, w = statistics.median(r.ttft_s for r in cold), statistics.median(r.ttft_s for r in warm)
        key = length_key(n)
        out[f"ttft_cold_s_{key}"], out[f"ttft_warm_s_{key}"], out[f"restore_vs_prefill_{key}"] = c, w, c / w
        out["curve"].append([n, c, w])
        if progress:
            progress(f"  ttft {n:6d} tokens: cold {c:8.3f} s, warm {w * 1e3:8.1f} ms, {c / w:7.1f}x")
    return out
