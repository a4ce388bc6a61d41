"""Store throughput and lookup benchmarks, as ratios against baselines run in the same process.

* put/get of a 256 MiB KV state (16 layers x 8 kv heads x 4096 tokens x 128 dims, float16) through
  ``Store.put`` / ``Store.fetch`` + ``mx.array`` + eval, against mlx-lm's ``save_prompt_cache`` /
  ``load_prompt_cache`` + eval of the same arrays (page cache warm; median of N).
* longest-prefix lookup of a 32k-token prompt with 1k, 10k and 100k stored entries.

The put is broken into phases so a slow machine shows where its time goes: ``encode`` (gather + checksum into
records), ``lmdb_put`` (the rest of the transaction body: ``txn.put`` copying records into LMDB's pages, index
updates), ``commit`` (``pwrite`` + ``fdatasync``). Next to them: the disk's own rate (``pwrite`` + ``fdatasync`` of
the same bytes into a new file and over an existing one), first-touch vs warm memory copy rates (a copy into fresh
pages is what glibc's thresholds decide; see ``store/env.py``), and the record checksum rates (XXH3-128, format 2,
vs blake3, format 1) over the state.

Usage: python tools/bench_store.py [--json] [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from spec_cache.apps.bench.timing import median_time


class _PutPhases:
    """Times ``encode_record`` calls (wherever the store imported it) and reads the environment's last write."""

    def __init__(self):
        from spec_cache.store import codec

        self.codec = codec
        self.encode_s = 0.0
        self.patched = []
        orig = codec.encode_record

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.encode_s += time.perf_counter() - t0
        self.orig, self.timed = orig, timed

    def __enter__(self):
        for name, mod in list(sys.modules.items()):
            if name.startswith("spec_cache.store") and getattr(mod, "encode_record", None) is self.orig:
                setattr(mod, "encode_record", self.timed)
                self.patched.append(mod)
        return self

    def __exit__(self, *exc):
        for mod in self.patched:
            setattr(mod, "encode_record", self.orig)
        return False

    def phases(self, env, total: float) -> dict:
        w = getattr(env, "last_write", {}) or {}
        fn, commit = w.get("fn_s", float("nan")), w.get("commit_s", float("nan"))
        return {"total": total, "encode": self.encode_s, "lmdb_put": fn - self.encode_s, "commit": commit,
                "attempts": w.get("attempts")}


def _rates(nbytes: int, work: str, reps: int) -> dict:
    """The machine's own limits for the put's phases: disk, fresh vs warm memory, checksums (GB/s)."""
    import blake3
    import xxhash

    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    mv = memoryview(src)
    gb = nbytes / 1e9
    out = {}
    path = os.path.join(work, "disk-probe")

    def write_sync(new: bool):
        if new and os.path.exists(path):
            os.remove(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, mv, 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
    out["disk_new_file_GBps"] = gb / median_time(lambda: write_sync(True), max(reps // 2, 2))
    out["disk_overwrite_GBps"] = gb / median_time(lambda: write_sync(False), max(reps // 2, 2))
    os.remove(path)
    piece = 16 << 20  # the size of a chunk record here: what LMDB mallocs per value
    pieces = [src[i:i + piece] for i in range(0, nbytes, piece)]

    def fresh_copy():  # into never-touched pages (an anonymous map each time), as a first put into new memory
        import mmap

        for p in pieces:
            m = mmap.mmap(-1, len(p))
            dst = np.frombuffer(m, np.uint8)
            dst[:] = p
            del dst
            m.close()
    warm = np.empty(piece, np.uint8)

    def warm_copy():
        for p in pieces:
            warm[:len(p)] = p
    out["copy_fresh_pages_GBps"] = gb / median_time(fresh_copy, reps)
    out["copy_warm_pages_GBps"] = gb / median_time(warm_copy, reps)
    out["xxh3_128_GBps"] = gb / median_time(lambda: xxhash.xxh3_128(mv).digest(), reps)
    out["blake3_GBps"] = gb / median_time(
        lambda: blake3.blake3(mv, max_threads=blake3.blake3.AUTO).digest(), reps)
    out["blake3_1thread_GBps"] = gb / median_time(lambda: blake3.blake3(mv).digest(), reps)
    return out



def kv_state(layers=16, heads=8, tokens=4096, dim=128):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(0)
    caches, arrays = [], []
    for _ in range(layers):
        k = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        v = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        mx.eval(k, v)
        c = KVCache()
        c.update_and_fetch(k, v)
        caches.append(c)
        arrays.append((k, v))
    return caches, arrays


def bench_put_get(reps: int, tokens: int) -> dict:
    """``Store.put`` / ``Store.fetch`` (into MLX, as ``SpecCache.restore`` does) of a KV state against mlx-lm's
    ``save_prompt_cache`` (+ fsync) / ``load_prompt_cache`` (+ eval) of the same state: medians of ``reps``, GB/s,
    the put's phases (encode, LMDB put, commit), and the device's raw rates (``_rates``)."""
    from spec_cache.store.allocator import allocator_tuned

    caches, arrays = kv_state(tokens=tokens)
    nbytes = sum(k.nbytes + v.nbytes for k, v in arrays)
    work = tempfile.mkdtemp(prefix="bench-store-")
    bench = _PutGet(work, caches, arrays, tokens)
    t_put_growing, t_save, t_put = bench.writes(reps)
    t_load, t_get = bench.reads(reps)
    stages = bench.get_stages(reps)
    tuned = allocator_tuned()
    bench.store.close()
    rates = _rates(nbytes, work, reps)
    shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    out = {"state_bytes": nbytes, "reps": reps,
           "mlx_lm_save_s": t_save, "put_s": t_put, "put_vs_mlx_lm_save": t_save / t_put,
           "put_growing_file_s": t_put_growing,
           "mlx_lm_load_s": t_load, "get_s": t_get, "restore_vs_mlx_lm_load": t_load / t_get,
           "put_GBps": gb / t_put, "get_GBps": gb / t_get, "save_GBps": gb / t_save, "load_GBps": gb / t_load,
           "malloc_thresholds_set": tuned}
    out.update(stages)
    out["restore_numpy_route_vs_mlx_lm_load"] = t_load / stages["get_numpy_route_s"]
    out.update(_put_phases(bench.phases, gb))
    out.update(rates)
    return out


class _PutGet:
    """One KV state, its mlx-lm file and a store, and the four timed operations on them."""

    def __init__(self, work: str, caches, arrays, tokens: int) -> None:
        from spec_cache.store import Store

        self.caches, self.arrays, self.tokens = caches, arrays, tokens
        self.path = os.path.join(work, "cache.safetensors")
        self.toks = list(range(tokens))
        self.store = Store.open(os.path.join(work, "store"), map_size=8 << 30)
        self.fresh = iter(range(1 << 30))
        self.phases: list[dict] = []
        self.ns = None

    def layers(self):
        from spec_cache.store import LayerState, Tensor

        return [LayerState("kv", {}, [Tensor("float16", k.shape, memoryview(k)), Tensor("float16", v.shape, memoryview(v))],
                           token_axis=2) for k, v in self.arrays]

    def save(self) -> None:
        from mlx_lm.models.cache import save_prompt_cache

        save_prompt_cache(self.path, self.caches)
        fd = os.open(self.path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def load(self) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache

        loaded = load_prompt_cache(self.path)
        mx.eval([c.state for c in loaded])

    def put(self):  # a new namespace each time, so every chunk is really written
        from spec_cache.naming.namespace import namespace_key

        key = namespace_key("0" * 64, f"bench-{next(self.fresh)}")
        self.store.register_namespace(key, target="0" * 64, prefix_namespace="bench")
        state = self.layers()
        with _PutPhases() as timer:
            t0 = time.perf_counter()
            self.store.put(key, self.toks, state)
            self.phases.append(timer.phases(self.store.env, time.perf_counter() - t0))
        return key

    def get(self) -> None:  # what SpecCache.restore does: one copy out of the map into MLX, joined in MLX
        import mlx.core as mx

        from spec_cache.state.cache_state import restore_concat, to_mx

        r = self.store.fetch(self.ns, self.toks, concat=restore_concat())  # the namespace written last
        out = [to_mx(t) for layer in r.layers for t in layer.tensors]
        mx.eval(out)
        assert r.length == self.tokens

    def get_stages(self, reps: int) -> dict:
        """Where a restore's time goes, each stage timed alone (medians, seconds): ``fetch`` (lookup, read
        transaction, every record's header decoded and its tokens checked, no checksum, no copy), ``verify``
        (every record's checksum on one thread, then spread over the store's verify threads), ``copies`` (the
        tensors copied from the map into fresh MLX arrays, nothing else); and the whole restore through the route
        used before issue 21 (numpy assembly, then ``mx.array``: ``SPEC_CACHE_COPY_ROUTE=numpy``), and the default
        restore again (``get_again``) among them, so its share of each stage reads off one round-robin run."""
        import mlx.core as mx

        from spec_cache.state.cache_state import to_mx
        from spec_cache.state.device_copy import HOST_ARRAYS
        from spec_cache.store import codec, keys, read
        from spec_cache.store.store import _RECORD_DB

        store, packed = self.store, keys.pack_tokens(self.toks)

        def records(txn):
            hit = store._lookup(txn, self.ns, packed, None)
            return hit, [txn.get(k, db=store.env.dbs[_RECORD_DB["chunk"]]) for k in hit.chain[1:]] + (
                [txn.get(hit.entry, db=store.env.dbs[_RECORD_DB["entry"]])] if hit.entry is not None else [])

        def fetch():
            with store.env.read() as txn:
                hit, raws = records(txn)
                recs = [read.verified_record(r, "chunk", k, packed[i * store.chunk_tokens:(i + 1) * store.chunk_tokens],
                                             deferred=[], verifier=read.BackgroundVerifier(min_bytes=0))
                        for i, (k, r) in enumerate(zip(hit.chain[1:], raws))]
                assert recs
                if hit.entry is not None:
                    codec.decode_record(raws[-1], verify=False)

        def verify(pool: bool):
            with store.env.read() as txn:
                _hit, raws = records(txn)
                if pool:
                    assert all(store._verifier.pool().map(codec.verify_checksum, raws))
                else:
                    assert all(codec.verify_checksum(r) for r in raws)

        def copies():
            with store.env.read() as txn:
                _hit, raws = records(txn)
                recs = [codec.decode_record(r, verify=False) for r in raws]
                names = [n for n in recs[0].tensors if n != "tokens"]
                out = []
                for name in names:
                    parts = [r.tensors[name] for r in recs if name in r.tensors]
                    full = list(parts[0].shape)
                    full[2] = sum(p.shape[2] for p in parts)
                    ((data, view),) = HOST_ARRAYS.allocate([(parts[0].dtype, tuple(full))])
                    at = 0
                    for p in parts:
                        view[:, :, at:at + p.shape[2]] = p.array()
                        at += p.shape[2]
                    out.append(data)
                mx.eval(out)

        def numpy_route():
            r = store.fetch(self.ns, self.toks)  # no concat: numpy assembly, checksums on the verifier's threads
            mx.eval([to_mx(t) for layer in r.layers for t in layer.tensors])
        stages = {"get_stage_fetch_s": fetch, "get_stage_verify_1thread_s": lambda: verify(False),
                  "get_stage_verify_threads_s": lambda: verify(True), "get_stage_copies_s": copies,
                  "get_numpy_route_s": numpy_route, "get_again_s": self.get}
        times: dict = {name: [] for name in stages}
        for f in stages.values():
            f()  # once untimed
        for _ in range(reps):  # round robin: a load that comes and goes hits every stage alike
            for name, f in stages.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        out = {name: statistics.median(v) for name, v in times.items()}
        out.update({"verify_threads": store._verifier.threads, "xxh3_gil_free": _gil_free()})
        return out

    def writes(self, reps: int) -> tuple[float, float, float]:
        """(first put into the empty store, median save, median put). Steady state, as in a cache at its budget:
        the previous checkpoint is evicted (untimed) before each put, so LMDB reuses its pages, as the file system
        reuses the blocks of the file save_prompt_cache overwrites. The first put (the file grows) is apart."""
        from spec_cache.store.maintenance import evict

        t0 = time.perf_counter()
        self.ns = self.put()
        t_put_growing = time.perf_counter() - t0
        save_times, put_times = [], []
        for _ in range(reps):
            evict(self.store, namespace=self.ns)
            save_times.append(median_time(self.save, 1))
            t0 = time.perf_counter()
            self.ns = self.put()
            put_times.append(time.perf_counter() - t0)
        return t_put_growing, statistics.median(save_times), statistics.median(put_times)

    def reads(self, reps: int) -> tuple[float, float]:
        """(median load, median get), each once untimed first."""
        self.load()
        self.get()
        return median_time(self.load, reps), median_time(self.get, reps)


def _gil_free() -> bool:
    from spec_cache.store import xxh3

    return xxh3.NOGIL


def _put_phases(phases: list[dict], gb: float) -> dict:
    """The first put's phases (into a growing data.mdb), then the median of each phase over the steady puts."""
    out: dict = {}
    for name in ("encode", "lmdb_put", "commit"):
        out[f"put_growing_{name}_s"] = phases[0][name]
        out[f"put_{name}_s"] = statistics.median(p[name] for p in phases[1:])
        out[f"put_{name}_GBps"] = gb / out[f"put_{name}_s"] if out[f"put_{name}_s"] > 0 else None
    out["put_attempts_max"] = max((p["attempts"] or 0) for p in phases)
    return out



def bench_lookup(counts: list[int], reps: int, prompt_tokens: int = 32768) -> dict:
    from spec_cache.naming.namespace import namespace_key
    from spec_cache.store import LayerState, Store, Tensor

    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="bench-lookup-")
    store = Store.open(os.path.join(work, "store"), durable=False, map_size=8 << 30)
    ns = namespace_key("0" * 64, "lookup")
    store.register_namespace(ns, target="0" * 64, prefix_namespace="lookup")
    prompt = rng.integers(0, 32000, prompt_tokens).astype(np.uint32)

    def state(n):
        kv = np.zeros((1, 1, n, 1), dtype=np.float16)
        return [LayerState("kv", {}, [Tensor.from_numpy(kv), Tensor.from_numpy(kv)], token_axis=2)]

    store.put(ns, prompt[: prompt_tokens - 1000], state(prompt_tokens - 1000))
    out, have = {}, 1
    for count in counts:
        while have < count:
            n = int(rng.integers(32, 600))
            seq = rng.integers(0, 32000, n).astype(np.uint32)
            store.put(ns, seq, state(n))
            have += 1
        store.flush()
        hit = store.lookup(ns, prompt)
        assert hit is not None and hit.length == prompt_tokens - 1000
        out[f"lookup_ms_32k_{count}"] = median_time(lambda: store.lookup(ns, prompt), reps) * 1e3
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    out["lookup_growth"] = out[f"lookup_ms_32k_{counts[-1]}"] / out[f"lookup_ms_32k_{counts[0]}"]
    return out


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="64 MiB state, 1k/10k entries")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    result = {}
    result.update(bench_put_get(args.reps, 1024 if args.quick else 4096))
    result.update(bench_lookup([1000, 10000] if args.quick else [1000, 10000, 100000], max(args.reps, 21)))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:28} {v:.4g}" if isinstance(v, float) else f"{k:28} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
