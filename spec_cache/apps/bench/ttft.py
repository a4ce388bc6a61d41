"""TTFT of a cold prefill vs a restore from the store, through the public ``Generator`` API.

Default model: llama, hidden 1024, 8 layers, 16 heads / 4 KV heads (head_dim 64), intermediate 2816, vocab 32000,
float32, random weights written locally; drafter: the assistant, whose row is restored too. Cold = no cache;
warm = the same prompt again after a first run stored its prompt-boundary checkpoint (store reopened, page cache
warm). Median of N runs each.

Why one file: the TTFT sections (``run``, ``run_tiers`` and its stages, ``memory_restore``, ``write_overhead``,
``write_bf16_llama`` for the GPU driver) share ``length_key``, ``rebind`` and the tiny-model setup, and each is one
entry point a bench calls (``bench/__init__``, ``tools/device/bench_gpu.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any

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
    from spec_cache.decode.generator import Generator
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
    from spec_cache.tiers.cache import SpecCache

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


# --- tiers: cold vs memory tier vs LMDB vs mlx-lm's own files (the GPU driver's 8B-shaped model; any model) ----
def rebind(gen, cache):
    """A ``Generator`` over ``gen``'s loaded model bound to another cache (no second copy of the weights)."""
    from spec_cache.decode.generator import Generator

    try:
        return Generator(gen.engine, cache=cache, target_identity=gen.target_identity,
                         drafter_namespace=gen.drafter_namespace, prefix_ns=gen.prefix_namespace,
                         ns_key=None if cache is None else cache.namespace(gen.target_identity, gen.prefix_namespace),
                         eos_token_ids=gen.eos_token_ids, adapters=gen.adapters)
    except TypeError:  # the constructor changed: load again
        return None


def _state_bytes(caches) -> int:
    total = 0
    for c in caches:
        for a in c.state[:2] if hasattr(c, "keys") else []:
            if a is not None:
                total += sum(x.nbytes for x in a) if isinstance(a, (list, tuple)) else a.nbytes
    return total


def _timed_runs(gen, prompt, reps, cache=None):
    """``reps`` requests of ``prompt``; with ``cache``, its write-behind queue is drained (untimed) before each,
    so a request is not measured while the previous one's checkpoint is still being written."""
    out = []
    for _ in range(reps):
        if cache is not None:
            cache.drain(timeout=600)
        out.append(gen.generate([prompt], max_tokens=1)[0])
    return out


def run_tiers(target_dir, lengths=(1024, 4096), *, cold_reps: int = 3, warm_reps: int = 5, vocab: int | None = None,
              memory_bytes: int | None = None, progress=print, work: str | None = None, seed: int = 0) -> dict:
    """Per prompt length, all in one process on one loaded model (no drafter):

    * ``cold``: TTFT with no cache (a full prefill);
    * ``memory``: TTFT of the same prompt once a first run stored its prompt-boundary checkpoint, restored from the
      memory tier (``RestoredPrefix.tier == "memory"``); the write-behind queue is drained (untimed) before each
      timed request, and one request made at once after the first run (its checkpoint still being written) is
      reported apart as ``memory_writer_busy_s``;
    * ``lmdb``: the same after ``drain()``, store closed and reopened with ``memory_bytes=0`` (page cache warm):
      lookup, verified read, copy into MLX, last-token forward;
    * ``mlx_lm``: ``load_prompt_cache`` of the same state saved by mlx-lm + the last-token forward + argmax;
    * restore-only times of the three (``cache.restore`` from each tier; ``load_prompt_cache`` + eval) and their GB/s.

    Every warm run is checked: ``cached_tokens == n - 1`` and tokens equal to the cold run's (AssertionError
    otherwise); the mlx-lm baseline's token is compared and reported.

    Stages: ``_tiers_setup`` (load, warm up, the run's header), then per length ``_tiers_row`` (cold runs, the
    memory tier, LMDB, mlx-lm's file, the ratios), then ``_capture_report``.
    """
    import shutil

    if vocab is None:
        with open(os.path.join(target_dir, "config.json")) as f:
            vocab = int(json.load(f)["vocab_size"])
    own_work = work is None
    work = work or tempfile.mkdtemp(prefix="bench-tiers-")
    rng = np.random.default_rng(seed)
    out, cold_gen = _tiers_setup(target_dir, cold_reps, warm_reps)
    for n in lengths:
        prompt = rng.integers(3, vocab, n).tolist()
        plan = _TierPlan(target_dir, cold_gen, prompt, work, cold_reps, warm_reps, memory_bytes)
        row = out["lengths"][plan.key] = _tiers_row(plan)
        if progress:
            progress(_tiers_line(n, row))
    out.update(_capture_report())
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return out


@dataclass
class _TierPlan:
    """One prompt length of ``run_tiers``: what each stage of its row needs."""

    target_dir: str
    cold_gen: Any           # the Generator without a cache (its model is rebound to each store)
    prompt: list
    work: str
    cold_reps: int
    warm_reps: int
    memory_bytes: int | None

    @property
    def n(self) -> int:
        return len(self.prompt)

    @property
    def key(self) -> str:
        return length_key(self.n)

    @property
    def store_dir(self) -> str:
        return os.path.join(self.work, f"store-{self.key}")

    @property
    def mlx_path(self) -> str:
        return os.path.join(self.work, f"mlx-{self.key}.safetensors")

    def generator(self, cache):
        from spec_cache.decode.generator import Generator

        return rebind(self.cold_gen, cache) or Generator.load(self.target_dir, cache=cache)

    def check(self, warm, expect, tier: str) -> None:
        if not all(w.cached_tokens == self.n - 1 and w.tokens == expect for w in warm):
            raise AssertionError(f"{self.key}: {tier} warm run did not restore n-1 tokens or changed the tokens")


def _tiers_setup(target_dir, cold_reps: int, warm_reps: int):
    """The model loaded once (no cache) and warmed up; the report's header (load time, the restore and copy
    routes)."""
    import time

    from spec_cache.decode.generator import Generator
    from spec_cache.state.cache_state import restore_concat

    t0 = time.perf_counter()
    cold_gen = Generator.load(target_dir)
    load_s = time.perf_counter() - t0
    cold_gen.generate([[3, 4, 5]], max_tokens=1)  # warm up MLX
    concat = restore_concat()
    out = {"target": str(target_dir), "model_load_s": load_s, "cold_reps": cold_reps, "warm_reps": warm_reps,
           "restore_route": getattr(concat, "__name__", type(concat).__name__), "lengths": {}}
    try:
        from spec_cache.state import device_copy
        out["copy_route_status"] = device_copy.status()
    except Exception as exc:  # reporting only
        out["copy_route_status"] = f"unknown: {exc}"
    return out, cold_gen


def _tiers_row(plan: _TierPlan) -> dict:
    """One length's row, stage by stage; the stores and mlx-lm's file are removed afterwards."""
    import shutil

    row: dict = {"tokens": plan.n}
    cold = _timed_runs(plan.cold_gen, plan.prompt, plan.cold_reps)
    row["cold_s"] = statistics.median(r.ttft_s for r in cold)
    row["cold_reps_s"] = [r.ttft_s for r in cold]
    expect = cold[0].tokens
    row.update(_memory_tier(plan, expect))
    row.update(_lmdb_tier(plan, expect))
    row.update(_mlx_lm_file(plan, expect))
    os.remove(plan.mlx_path)
    shutil.rmtree(plan.store_dir, ignore_errors=True)
    row.update(_tier_ratios(row))
    return row


def _memory_tier(plan: _TierPlan, expect) -> dict:
    """The first run (a miss) stores the checkpoint; the next ones restore it from memory. Then the restore alone,
    mlx-lm's file of the same state (trimmed to n - 1 tokens, as stored) for the last stage, and the drain."""
    from spec_cache.tiers.cache import SpecCache

    extra = {} if plan.memory_bytes is None else {"memory_bytes": plan.memory_bytes}
    cache = SpecCache.open(plan.store_dir, **extra)
    try:
        gen = plan.generator(cache)
        row = _memory_runs(plan, gen, cache, expect)
        row.update(_memory_restore(plan, gen, cache))
    finally:
        cache.close()
    return row


def _memory_runs(plan: _TierPlan, gen, cache, expect) -> dict:
    prompt, warm_reps = plan.prompt, plan.warm_reps
    row: dict = {}
    first = gen.generate([prompt], max_tokens=1)[0]
    row["first_run_s"] = first.ttft_s
    before = cache.memory_stats()
    busy = gen.generate([prompt], max_tokens=1)[0]  # at once: the first run's checkpoint is being written
    row["memory_writer_busy_s"] = busy.ttft_s
    warm = _timed_runs(gen, prompt, warm_reps, cache)
    after = cache.memory_stats()
    warm.append(busy)
    row["memory_s"] = statistics.median(r.ttft_s for r in warm[:-1])
    row["memory_reps_s"] = [r.ttft_s for r in warm[:-1]]
    row["memory_hits"] = after.get("hits", 0) - before.get("hits", 0)
    row["memory_stats"] = {k: v for k, v in after.items() if isinstance(v, (int, float, str, bool))}
    plan.check(warm, expect, "memory-tier")
    if row["memory_hits"] < warm_reps + 1:
        raise AssertionError(f"{plan.key}: warm runs were not memory-tier hits ({row['memory_hits']} hits)")
    return row


def _memory_restore(plan: _TierPlan, gen, cache) -> dict:
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    from spec_cache.apps.bench.timing import median_time

    prompt, n = plan.prompt, plan.n
    row: dict = {}
    hit = cache.restore(gen.ns_key, prompt[:-1])
    assert hit is not None and hit.tier == "memory" and hit.length == n - 1
    row["state_bytes"] = _state_bytes(hit.caches)

    def memory_restore():
        r = cache.restore(gen.ns_key, prompt[:-1])
        mx.eval([c.state for c in r.caches])
    row["memory_restore_s"] = median_time(memory_restore, plan.warm_reps)
    save_prompt_cache(plan.mlx_path, hit.caches)
    del hit
    t = time.perf_counter()
    ok = cache.drain(timeout=600)
    row["drain_s"] = time.perf_counter() - t
    if not ok:
        raise AssertionError(f"{plan.key}: drain() did not finish")
    return row


def _lmdb_tier(plan: _TierPlan, expect) -> dict:
    """The store reopened with the memory tier off (page cache warm): TTFT, then the restore alone."""
    import mlx.core as mx

    from spec_cache.apps.bench.timing import median_time
    from spec_cache.tiers.cache import SpecCache

    prompt, n = plan.prompt, plan.n
    row: dict = {}
    cache = SpecCache.open(plan.store_dir, memory_bytes=0)
    try:
        gen = plan.generator(cache)
        warm = _timed_runs(gen, prompt, plan.warm_reps + 1, cache)[1:]  # the first one warms the page cache
        row["lmdb_s"] = statistics.median(r.ttft_s for r in warm)
        row["lmdb_reps_s"] = [r.ttft_s for r in warm]
        plan.check(warm, expect, "LMDB")

        def lmdb_restore():
            r = cache.restore(gen.ns_key, prompt[:-1])
            assert r is not None and r.tier == "local" and r.length == n - 1
            mx.eval([c.state for c in r.caches])
        row["lmdb_restore_s"] = median_time(lmdb_restore, plan.warm_reps)
    finally:
        cache.close()
    return row


def _mlx_lm_file(plan: _TierPlan, expect) -> dict:
    """mlx-lm's baseline: ``load_prompt_cache`` + last-token forward + argmax (TTFT), and load + eval (restore
    only)."""
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from spec_cache.apps.bench.timing import median_time

    model, path, last = plan.cold_gen.engine.target.model, plan.mlx_path, plan.prompt[-1]

    def load_forward():
        caches = load_prompt_cache(path)
        logits = model(mx.array([[last]], dtype=mx.uint32), cache=caches)
        return mx.argmax(logits[0, -1]).item()

    def load_eval():
        caches = load_prompt_cache(path)
        mx.eval([c.state for c in caches])

    load_forward()
    toks, times = [], []
    for _ in range(plan.warm_reps):
        t = time.perf_counter()
        toks.append(load_forward())
        times.append(time.perf_counter() - t)
    return {"mlx_lm_s": statistics.median(times), "mlx_lm_token_matches_cold": all(tok == expect[0] for tok in toks),
            "mlx_lm_load_s": median_time(load_eval, plan.warm_reps)}


def _tier_ratios(row: dict) -> dict:
    """Restore rates (GB/s of the state) and the speed-ups, from a row's times."""
    gb = row["state_bytes"] / 1e9
    out = {f"{name}_GBps": gb / row[f"{name}_s"] for name in ("memory_restore", "lmdb_restore", "mlx_lm_load")}
    out["memory_vs_cold"] = row["cold_s"] / row["memory_s"]
    out["lmdb_vs_cold"] = row["cold_s"] / row["lmdb_s"]
    out["mlx_lm_vs_cold"] = row["cold_s"] / row["mlx_lm_s"]
    out["lmdb_restore_vs_mlx_lm_load"] = row["mlx_lm_load_s"] / row["lmdb_restore_s"]
    out["lmdb_ttft_vs_mlx_lm"] = row["mlx_lm_s"] / row["lmdb_s"]
    out["memory_restore_vs_mlx_lm_load"] = row["mlx_lm_load_s"] / row["memory_restore_s"]
    return out


def _tiers_line(n: int, row: dict) -> str:
    return (f"  tiers {n:6d} tokens ({row['state_bytes'] / 2**20:.0f} MiB): cold {row['cold_s'] * 1e3:8.1f} ms,"
            f" memory {row['memory_s'] * 1e3:7.1f} ms ({row['memory_vs_cold']:.1f}x), lmdb"
            f" {row['lmdb_s'] * 1e3:7.1f} ms ({row['lmdb_vs_cold']:.1f}x), mlx-lm {row['mlx_lm_s'] * 1e3:7.1f}"
            f" ms; restore GB/s lmdb {row['lmdb_restore_GBps']:.2f}, mlx-lm load {row['mlx_lm_load_GBps']:.2f}")


def _capture_report() -> dict:
    """How checkpoints were captured off the device (the route, and the D2H bytes and seconds when known)."""
    out: dict = {}
    try:
        from spec_cache.state import device_copy
        out["capture_route"] = device_copy.capture_status()
        d2h = device_copy._D2H
        if d2h is not None:
            out["capture_d2h"] = {"bytes": d2h.bytes, "seconds": d2h.seconds}
    except Exception as exc:  # reporting only
        out["capture_route"] = f"unknown: {exc}"
    return out


def memory_restore(reps: int, tokens: int, layers: int = 16, heads: int = 8, dim: int = 128) -> dict:
    """A KV state (float16, ``layers`` x ``heads`` x ``tokens`` x ``dim``) saved through ``SpecCache.save`` (held in
    the memory tier), then ``SpecCache.restore`` from the memory tier against mlx-lm's ``load_prompt_cache`` + eval
    of the same state (page cache warm). Median of ``reps``."""
    import shutil

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

    from spec_cache.apps.bench.timing import median_time
    from spec_cache.tiers.cache import SpecCache

    mx.random.seed(0)
    caches = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        v = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        mx.eval(k, v)
        c.update_and_fetch(k, v)
        caches.append(c)
    nbytes = layers * 2 * heads * tokens * dim * 2
    work = tempfile.mkdtemp(prefix="bench-memory-")
    path = os.path.join(work, "cache.safetensors")
    save_prompt_cache(path, caches)
    toks = list(range(3, tokens + 3))
    with SpecCache.open(os.path.join(work, "store")) as cache:
        ns = cache.namespace("0" * 64, "bench-memory")
        cache.save(ns, toks, caches)

        def restore():
            r = cache.restore(ns, toks)
            assert r is not None and r.tier == "memory" and r.length == tokens
            mx.eval([c.state for c in r.caches])

        def load():
            loaded = load_prompt_cache(path)
            mx.eval([c.state for c in loaded])

        restore(); load()
        t_load = median_time(load, reps)
        t_restore = median_time(restore, reps)
        stats = cache.memory_stats()
    shutil.rmtree(work, ignore_errors=True)
    return {"state_bytes": nbytes, "reps": reps, "mlx_lm_load_s": t_load, "memory_restore_s": t_restore,
            "memory_restore_vs_mlx_lm_load": t_load / t_restore, "load_GBps": nbytes / 1e9 / t_load,
            "memory_hits": stats.get("hits")}


def write_overhead(prompts: int = 4, prompt_tokens: int = 512, new_tokens: int = 8, rounds: int = 2, *,
                   hidden: int = 1024, layers: int = 8, vocab: int = 32000, progress=print) -> dict:
    """Latency of requests with checkpoint writing on vs off, same prompts, back to back (so a checkpoint written
    behind one request is measured in the next one's time too).

    off: a ``Generator`` without a cache. on: the same model with a fresh ``SpecCache`` (memory tier + write-behind
    defaults): each request misses, runs, and stores its checkpoints. Per round: the ``prompts`` requests off, then
    on (its queue drained afterwards, untimed). ``checkpoint_write_overhead`` = total on / total off (goal <= 1.05).
    """
    import shutil
    import time

    from spec_cache.decode.generator import Generator
    from spec_cache.testing.tiny import write_tiny_target
    from spec_cache.tiers.cache import SpecCache

    work = tempfile.mkdtemp(prefix="bench-writes-")
    target = write_tiny_target(os.path.join(work, "target"), hidden_size=hidden, num_layers=layers,
                               num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 256), head_dim=64,
                               intermediate_size=int(hidden * 2.75), vocab_size=vocab, tokenizer=False)
    rng = np.random.default_rng(1)
    batch = [rng.integers(3, vocab, prompt_tokens).tolist() for _ in range(prompts)]
    off_gen = Generator.load(target)
    off_gen.generate([[3, 4, 5]], max_tokens=2)
    on_times, off_times, drains = [], [], []
    expect = None
    for r in range(rounds):
        t = []
        for p in batch:
            t0 = time.perf_counter()
            res = off_gen.generate([p], max_tokens=new_tokens)
            t.append(time.perf_counter() - t0)
        off_times.append(t)
        expect = expect or [x.tokens for x in res]
        cache = SpecCache.open(os.path.join(work, f"store-{r}"))
        try:
            on_gen = rebind(off_gen, cache) or Generator.load(target, cache=cache)
            t = []
            for p in batch:
                t0 = time.perf_counter()
                res = on_gen.generate([p], max_tokens=new_tokens)
                t.append(time.perf_counter() - t0)
                if res[0].cached_tokens != 0:
                    raise AssertionError("a request with writing on hit the cache: prompts must be new")
            on_times.append(t)
            t0 = time.perf_counter()
            cache.drain(timeout=600)
            drains.append(time.perf_counter() - t0)
            stored = cache.store.stats() if hasattr(cache.store, "stats") else None
        finally:
            cache.close()
    total_on, total_off = sum(map(sum, on_times)), sum(map(sum, off_times))
    out = {"prompts": prompts, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rounds": rounds,
           "model": f"llama hidden {hidden}, {layers} layers, vocab {vocab}, float32",
           "on_s": on_times, "off_s": off_times, "drain_after_s": drains,
           "request_on_median_s": statistics.median(x for t in on_times for x in t),
           "request_off_median_s": statistics.median(x for t in off_times for x in t),
           "checkpoint_write_overhead": total_on / total_off}
    if isinstance(stored, dict):
        out["store_stats"] = {k: v for k, v in stored.items() if isinstance(v, (int, float))}
    shutil.rmtree(work, ignore_errors=True)
    if progress:
        progress(f"  write overhead: on {total_on:.3f} s / off {total_off:.3f} s = {total_on / total_off:.3f}x")
    return out


def write_bf16_llama(path, *, layers: int = 32, hidden: int = 4096, heads: int = 32, kv_heads: int = 8,
                     head_dim: int = 128, intermediate: int = 14336, vocab: int = 128256, seed: int = 0,
                     shard_layers: int = 4) -> str:
    """A llama model directory with random bfloat16 weights (defaults: Llama-3-8B's shape, 8.0 B parameters,
    ~16 GB), written shard by shard so only a few layers' weights are in memory at once. mlx-lm loads it as is.
    ``spec_cache.testing.tiny`` writes float32 models only; this is the benchmark's bf16 one (no tokenizer)."""
    import json as _json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    os.makedirs(path, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "num_hidden_layers": layers, "intermediate_size": intermediate, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5, "vocab_size": vocab,
              "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        _json.dump(config, f, indent=2, sort_keys=True)
    key = mx.random.key(seed)

    def rand(shape, scale):
        nonlocal key
        key, sub = mx.random.split(key)
        return (mx.random.normal(shape, key=sub) * scale).astype(mx.bfloat16)

    def layer(i):
        p = f"model.layers.{i}."
        q, kv = heads * head_dim, kv_heads * head_dim
        w = {p + "self_attn.q_proj.weight": rand((q, hidden), hidden ** -0.5),
             p + "self_attn.k_proj.weight": rand((kv, hidden), hidden ** -0.5),
             p + "self_attn.v_proj.weight": rand((kv, hidden), hidden ** -0.5),
             p + "self_attn.o_proj.weight": rand((hidden, q), 0.5 * q ** -0.5),
             p + "mlp.gate_proj.weight": rand((intermediate, hidden), hidden ** -0.5),
             p + "mlp.up_proj.weight": rand((intermediate, hidden), hidden ** -0.5),
             p + "mlp.down_proj.weight": rand((hidden, intermediate), 0.5 * intermediate ** -0.5),
             p + "input_layernorm.weight": mx.ones((hidden,), dtype=mx.bfloat16),
             p + "post_attention_layernorm.weight": mx.ones((hidden,), dtype=mx.bfloat16)}
        return w

    shards = [{"model.embed_tokens.weight": rand((vocab, hidden), 1.0),
               "model.norm.weight": mx.ones((hidden,), dtype=mx.bfloat16),
               "lm_head.weight": rand((vocab, hidden), hidden ** -0.5)}]
    for start in range(0, layers, shard_layers):
        shard = {}
        for i in range(start, min(layers, start + shard_layers)):
            shard.update(layer(i))
        shards.append(shard)
    count = len(shards)
    for k, shard in enumerate(shards):
        mx.eval(list(shard.values()))
        mx.save_safetensors(os.path.join(path, f"model-{k + 1:05d}-of-{count:05d}.safetensors"), shard,
                            metadata={"format": "mlx"})
        shards[k] = None
    del tree_flatten
    return str(path)
