"""GPU benchmark driver for the lent H200 (run by tools/device/bench_gpu.sh there, never by CI).

Why one file: it is the one driver copied to and run on the lent machine (``bench_gpu.sh``); its sections share the
JSON file rewritten after each and the environment probe.

Writes one JSON file, rewritten after each section so that a run stopped at the device's time limit still returns
what it measured. Sections (``--sections``, in order):

* ``limits``: the machine's copy limits: host memcpy (1 thread and the staging loader's threads), pinned and
  pageable host-to-GPU DMA (torch, in a subprocess, where the image has it), device-to-device copy in MLX, the GPU
  reading the host-resident staging buffer, blake3 with threads.
* ``routes``: ``Store.fetch`` of an 8B-shaped bf16 KV state (32 layers x 8 KV heads x 128, 4k and 16k tokens)
  into MLX by each route (numpy assembly + ``mx.array``; ``mx_concat``; the staging loader with 1/4/8/16
  threads) against mlx-lm's ``load_prompt_cache`` + eval of the same state.
* ``gpu_8b`` (``bench_gpu_8b.py``, issue 21): on a Llama-3-8B-shaped bf16 model with random weights (32 layers,
  hidden 4096, 32 heads / 8 KV heads, head_dim 128, intermediate 14336, vocab 128256; no drafter; ``--dims tiny``
  for a CPU check), per length (``--lengths``, default 4k then 16k): ``run_tiers``' stages (cold vs memory tier vs
  LMDB reopened vs mlx-lm load + last-token forward), a next turn (+256 tokens) from the memory tier vs from LMDB
  with the LMDB restore's stage breakdown, and at 4k the first request with the cache on vs cold; tokens checked
  equal to cold. The JSON is rewritten after each step; a step that would not fit in ``--deadline`` is skipped, and
  SIGTERM (the shell's ``timeout``) saves it and exits. Figures ``gpu_8b_*`` go to the top-level ``figures``.
* ``ttft``, ``store_io``, ``ttft_big``: the earlier sections (small float32 models; 256 MiB put/get).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import bench_gpu_8b as b8
from bench_gpu_8b import NEW_TOKENS, STEPS, Deadline

SMALL = {"lengths": [1024, 4096, 16384], "warm_reps": 5, "cold_reps": 3, "hidden": 1024, "layers": 8, "vocab": 32000}
BIG = {"lengths": [4096, 16384], "warm_reps": 5, "cold_reps": 3, "hidden": 4096, "layers": 16, "vocab": 32000}
STORE_IO = {"reps": 5, "tokens": 4096}
GPU_8B = {"model": b8.DIMS_8B, "lengths": [4096, 16384], "cold_reps": 3, "warm_reps": 5}
ROUTES = {"tokens": [4096, 16384], "reps": 5, "threads": [1, 4, 8, 16]}
GOALS = {"gpu_8b_memory_vs_cold_4k": 8.0, "gpu_8b_memory_vs_cold_16k": 30.0, "gpu_8b_lmdb_vs_cold_4k": 4.0,
         "gpu_8b_lmdb_vs_cold_16k": 10.0, "gpu_8b_lmdb_vs_mlx_lm_load": 3.0,
         "gpu_8b_lmdb_vs_mlx_lm_load_forward_4k": 3.0, "gpu_8b_lmdb_vs_mlx_lm_load_forward_16k": 3.0,
         "gpu_8b_next_turn_lmdb_vs_memory_4k": 0.8, "gpu_8b_next_turn_lmdb_vs_memory_16k": 0.8}
GOALS_AT_MOST = {"gpu_8b_first_write_overhead_4k": 1.05}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # a missing tool is a fact to record, not a failure
        return f"unavailable: {e}"


def environment() -> dict:
    import mlx.core as mx

    env = {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
           "mlx": mx.__version__, "mlx_default_device": str(mx.default_device()),
           "gpu": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
           "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
           "mem": sh("free -g | sed -n 2p")}
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and hasattr(cuda, "is_available"):
        env["mlx_cuda_available"] = bool(cuda.is_available())
    try:
        import mlx_lm
        env["mlx_lm"] = mlx_lm.__version__
    except Exception as e:
        env["mlx_lm"] = f"error: {e}"
    try:
        from spec_cache.state import device_copy
        env["copy_route"] = device_copy.status()
        env["capture_route"] = device_copy.capture_status()
    except Exception as e:
        env["copy_route"] = f"error: {e}"
    env["spec_cache_git"] = os.environ.get("SPEC_CACHE_GIT", "")
    return env


def peak_memory():
    import mlx.core as mx

    fn = getattr(mx, "get_peak_memory", None)
    if fn is None:
        return None
    value = fn()
    getattr(mx, "reset_peak_memory", lambda: None)()
    return value


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e9 / seconds


# --- limits ---------------------------------------------------------------------------------------------------
_TORCH_DMA = r"""
import json, time, torch
n = 1 << 30
out = {}
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
for name, pin in (("pinned", True), ("pageable", False)):
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pin); host.fill_(1)
    dev.copy_(host, non_blocking=pin); torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); dev.copy_(host, non_blocking=pin); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    out[f"h2d_{name}_GBps"] = n / 1e9 / sorted(ts)[2]
print(json.dumps(out))
"""


def run_limits() -> dict:
    import mlx.core as mx
    import numpy as np

    from spec_cache.apps.bench.timing import median_time
    from spec_cache.state import device_copy

    out = {}
    n = 1 << 30
    src = np.ones(n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    out["host_memcpy_1t_GBps"] = gbps(n, median_time(lambda: np.copyto(dst, src), 5))
    for threads in (8, 16):
        c = device_copy.Copier(threads)
        out[f"host_memcpy_{threads}t_GBps"] = gbps(n, median_time(lambda: c.copy(dst, [src], 0), 5))
        c.close()
    fresh = lambda: np.copyto(np.empty(n, dtype=np.uint8), src)  # noqa: E731
    out["host_memcpy_fresh_dst_1t_GBps"] = gbps(n, median_time(fresh, 3))
    del dst
    try:
        import blake3

        out["blake3_threads_GBps"] = gbps(n, median_time(lambda: blake3.blake3(src, max_threads=blake3.blake3.AUTO).digest(), 5))
        out["blake3_1t_GBps"] = gbps(n, median_time(lambda: blake3.blake3(src).digest(), 3))
    except Exception as e:
        out["blake3"] = f"error: {e}"
    try:
        import xxhash

        out["xxh3_1t_GBps"] = gbps(n, median_time(lambda: xxhash.xxh3_64_intdigest(src), 5))
    except Exception as e:
        out["xxh3"] = f"unavailable: {e}"
    del src
    if device_copy.is_gpu():
        x = mx.zeros((n // 2,), dtype=mx.uint32)  # 2 GiB on the device
        mx.eval(x)

        def d2d():
            mx.eval(x + 0)
        d2d()
        out["d2d_read_plus_write_GBps"] = gbps(2 * x.nbytes, median_time(d2d, 5))
        del x
        loader = device_copy.staging_loader()
        if loader is not None:
            stage = mx.zeros((n // 4,), dtype=mx.uint32, stream=mx.cpu)
            mx.eval(stage)
            view = np.array(stage, copy=False)
            ok = device_copy.CudaAdvice().advise_host(device_copy._pointer(view), n)
            view[:] = 1

            def gpu_reads_host():
                mx.eval(stage + 0)
            gpu_reads_host()
            out["gpu_reads_host_resident_GBps"] = gbps(n, median_time(gpu_reads_host, 5))
            out["memcpy_into_host_resident_stage_1t_GBps"] = gbps(n, median_time(lambda: np.copyto(view, 2), 3))
            out["stage_advised"] = ok
            del stage, view
        d2h = device_copy.device_to_host()
        out["capture_route"] = device_copy.capture_status()
        if d2h is not None:  # device -> host: the copy engine vs reading managed memory through a numpy view
            x = mx.random.normal((n // 2,)).astype(mx.bfloat16)  # 1 GiB on the device
            mx.eval(x)

            def gpu_read():
                mx.eval(x.view(mx.uint16) + 0)
            gpu_read()
            out["gpu_read_device_resident_GBps"] = gbps(n, median_time(gpu_read, 3))
            for mode in ("pinned", "direct"):  # ends on the default
                d2h.mode = mode
                out[f"d2h_cuMemcpy_{mode}_GBps"] = gbps(n, median_time(lambda: d2h(x.view(mx.uint16)), 3))
            best = max(("pinned", "direct"), key=lambda m: out[f"d2h_cuMemcpy_{m}_GBps"])
            d2h.mode = out["d2h_mode_used_after_limits"] = best  # the faster one serves the sections after this
            out["gpu_read_after_cuMemcpy_GBps"] = gbps(n, median_time(gpu_read, 1))
            t0 = time.perf_counter()
            np.asarray(memoryview(x.view(mx.uint16))).copy()
            out["d2h_numpy_view_GBps"] = gbps(n, time.perf_counter() - t0)
            out["gpu_read_after_numpy_view_GBps"] = gbps(n, median_time(gpu_read, 1))
            del x
        if os.environ.get("BENCH_TORCH", "1") == "1":
            try:
                r = subprocess.run(["python3", "-c", _TORCH_DMA], capture_output=True, text=True, timeout=120,
                                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
                out.update(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
                           {"torch_dma": f"rc {r.returncode}: {r.stderr[-500:]}"})
            except Exception as e:
                out["torch_dma"] = f"error: {e}"
    return out


def _patch_verify_wait():
    """Time the restore spends waiting for its background checksums after assembling (instrumentation only:
    wraps ``BackgroundVerifier.wait``); returns a function giving the seconds since the call and undoing it."""
    try:
        from spec_cache.store import read
    except Exception:
        return lambda: float("nan")
    original = read.BackgroundVerifier.__dict__["wait"]
    total = [0.0]

    def wait(pending):
        t0 = time.perf_counter()
        try:
            return original.__func__(pending)
        finally:
            total[0] += time.perf_counter() - t0
    read.BackgroundVerifier.wait = staticmethod(wait)

    def done():
        read.BackgroundVerifier.wait = original
        return total[0]
    return done


# --- routes -----------------------------------------------------------------------------------------------------
def run_routes(cfg: dict) -> dict:
    import shutil

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

    from spec_cache.apps.bench.timing import median_time
    from spec_cache.naming.namespace import namespace_key
    from spec_cache.state import device_copy
    from spec_cache.state.cache_state import mx_concat, to_mx
    from spec_cache.store import LayerState, Store, Tensor

    out = {}
    reps = cfg["reps"]
    for tokens in cfg["tokens"]:
        mx.random.seed(0)
        layers, caches = [], []
        for _ in range(32):
            k = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
            v = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
            mx.eval(k, v)
            c = KVCache()
            c.update_and_fetch(k, v)
            caches.append(c)
            layers.append((k, v))
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        work = tempfile.mkdtemp(prefix="bench-routes-")
        store = Store.open(os.path.join(work, "store"), map_size=64 << 30)
        ns = namespace_key("0" * 64, "routes")
        store.register_namespace(ns, target="0" * 64, prefix_namespace="routes")
        toks = list(range(tokens))
        from spec_cache.state.cache_state import to_tensor

        t0 = time.perf_counter()
        store.put(ns, toks, [LayerState("kv", {}, [to_tensor(k), to_tensor(v)], token_axis=2) for k, v in layers])
        put_s = time.perf_counter() - t0
        path = os.path.join(work, "mlx.safetensors")
        save_prompt_cache(path, caches)
        del caches, layers

        def load():
            loaded = load_prompt_cache(path)
            mx.eval([c.state for c in loaded])

        row = {"state_bytes": nbytes, "put_s": put_s}
        routes = {"numpy": None, "join": mx_concat}
        loaders = {}
        if device_copy.staging_loader() is not None:
            for t in cfg["threads"]:
                loaders[t] = device_copy.StagingLoader(threads=t)
                routes[f"staging_{t}t"] = loaders[t]
        reference = None
        for name, concat in routes.items():
            def get(concat=concat):
                r = store.fetch(ns, toks, concat=concat)
                arrays = [to_mx(t) for layer in r.layers for t in layer.tensors]
                mx.eval(arrays)
                return arrays
            try:
                arrays = get()
                first = arrays[0].view(mx.uint16)
                check = mx.sum(first.astype(mx.uint32)).item()
                reference = check if reference is None else reference
                del arrays
                if name.startswith("staging"):
                    loaders[int(name.split("_")[1][:-1])].reset_counters()
                waited = _patch_verify_wait()
                t = median_time(get, reps)
                row[f"{name}_verify_wait_s_per_fetch"] = waited() / reps
                row[f"{name}_s"] = t
                row[f"{name}_GBps"] = gbps(nbytes, t)
                row[f"{name}_same_bytes"] = check == reference
                if name.startswith("staging"):
                    row[f"{name}_counters"] = loaders[int(name.split("_")[1][:-1])].counters()
                log(f"  routes {tokens}: {name} {t * 1e3:.1f} ms ({gbps(nbytes, t):.2f} GB/s)")
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                log(f"  routes {tokens}: {name} FAILED {e}")
        load()
        t = median_time(load, reps)
        row["mlx_lm_load_s"], row["mlx_lm_load_GBps"] = t, gbps(nbytes, t)
        # fetch without any copy into MLX (record decode + verification + numpy assembly) for the breakdown
        row["fetch_numpy_only_s"] = median_time(lambda: store.fetch(ns, toks), reps)
        log(f"  routes {tokens}: mlx-lm load {t * 1e3:.1f} ms ({gbps(nbytes, t):.2f} GB/s)")
        for loader in loaders.values():
            loader.close()
        store.close()
        shutil.rmtree(work, ignore_errors=True)
        out[f"{tokens // 1024}k"] = row
    return out


# --- the 8B-shaped model (tools/device/bench_gpu_8b.py) ------------------------------------------------------
def run_gpu_8b(args, deadline, publish) -> dict:
    dims = b8.parse_dims(args.dims)
    t0 = time.perf_counter()
    path, dims, write_s = b8.ensure_model(dims, args.model_dir)
    log(f"  model {dims} at {path} ({write_s:.1f} s to write, {time.perf_counter() - t0:.1f} s in all)")
    holder = {}

    def partial(out):
        out.update(model_write_s=write_s, model_dir=path, dims=dims)
        holder["out"] = out
        publish(out)
    try:
        r = b8.run(path, [int(x) for x in args.lengths.split(",") if x], cold_reps=args.cold_reps,
                   warm_reps=args.warm_reps, steps=[s for s in args.steps.split(",") if s],
                   first_write_at=[int(x) for x in args.first_write_at.split(",") if x], new_tokens=args.new_tokens,
                   deadline=deadline, publish=partial)
    finally:
        if args.model_dir is None and dims != b8.DIMS_8B:  # a test's small model; the 8B one stays for reuse
            import shutil
            shutil.rmtree(path, ignore_errors=True)
    r.update(model_write_s=write_s, model_dir=path, dims=dims)
    return r


def run_stages(n: int, reps: int = 3) -> dict:
    """Where a warm request's first token goes after a memory-tier hit on the 8B-shaped model (``n`` tokens):
    each engine step of a restored row's admission and first round, timed on its own with an eval after it."""
    import shutil

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from spec_cache.apps.bench.timing import median_time
    from spec_cache.decode.generator import Generator
    from spec_cache.rows.target import TargetRows, clone_batch_cache
    from spec_cache.tiers.cache import SpecCache

    path = b8.model_dir(b8.DIMS_8B)
    work = tempfile.mkdtemp(prefix="bench-stages-", dir="/tmp")
    out = {"tokens": n}
    rng = np.random.default_rng(5)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompt = rng.integers(3, vocab, n).tolist()
    cache = SpecCache.open(os.path.join(work, "store"))
    try:
        gen = Generator.load(path, cache=cache)
        target = gen.engine.target
        cold = gen.generate([prompt], max_tokens=1)[0]
        out["cold_ttft_s"] = cold.ttft_s
        warm = [gen.generate([prompt], max_tokens=1)[0] for _ in range(reps)]
        out["warm_ttft_s"] = statistics.median(w.ttft_s for w in warm)
        t0 = time.perf_counter()
        gen.generate([prompt], max_tokens=1)
        out["warm_generate_total_s"] = time.perf_counter() - t0
        key = prompt[:-1]

        def restore():
            return cache.restore(gen.ns_key, key)
        out["restore_s"] = median_time(restore, reps)
        hit = restore()
        assert hit.tier == "memory", hit.tier

        def merge():
            j = TargetRows.from_row_caches(target, [hit.caches])
            j.materialize()
            return j
        out["merge_rows_s"] = median_time(merge, reps)
        j = merge()
        out["extract_s"] = median_time(lambda: j.extract(0), reps)

        def clone():
            cl = [clone_batch_cache(c) for c in j._caches]
            mx.eval([a for c in cl for a in (c.keys, c.values)])
        out["clone_s"] = median_time(clone, reps)

        def verify():
            jj = merge()
            mx.synchronize()
            t = time.perf_counter()
            o = jj.verify([[prompt[-1]]])
            mx.argmax(o.logits[0, -1]).item()
            return time.perf_counter() - t
        out["verify_s"] = statistics.median(verify() for _ in range(reps))
        mx.clear_cache()
        out["verify_after_clear_cache_s"] = verify()

        def direct():
            caches = []
            for c in hit.caches:
                k = KVCache()
                k.keys, k.values, k.offset = c.keys, c.values, c.offset
                caches.append(k)
            mx.synchronize()
            t = time.perf_counter()
            logits = target.model(mx.array([[prompt[-1]]], dtype=mx.uint32), cache=caches)
            mx.argmax(logits[0, -1]).item()
            return time.perf_counter() - t
        out["mlx_lm_forward_on_held_arrays_s"] = statistics.median(direct() for _ in range(reps))
        out["active_memory"] = mx.get_active_memory()
        out["cache_memory"] = mx.get_cache_memory()
        log(f"  stages {n}: {json.dumps(out)}")
    finally:
        cache.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def run_ttft(cfg: dict) -> dict:
    from spec_cache.apps.bench import ttft

    return ttft.run(cfg["lengths"], warm_reps=cfg["warm_reps"], cold_reps=cfg["cold_reps"], hidden=cfg["hidden"],
                    layers=cfg["layers"], vocab=cfg["vocab"], progress=lambda m: log(m))


def run_store_io(cfg: dict) -> dict:
    from spec_cache.apps.bench import store_io

    return store_io.bench_put_get(cfg["reps"], cfg["tokens"])


def goals(figures: dict) -> dict:
    out = {k: {"goal": f">= {g:g}", "met": figures[k] >= g} for k, g in GOALS.items() if k in figures}
    out.update({k: {"goal": f"<= {g:g}", "met": figures[k] <= g} for k, g in GOALS_AT_MOST.items() if k in figures})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file, rewritten after each section (gpu_8b: after each step)")
    p.add_argument("--sections", default="limits,routes,gpu_8b,store_io")
    p.add_argument("--lengths", default=",".join(str(n) for n in GPU_8B["lengths"]), help="gpu_8b prompt lengths")
    p.add_argument("--deadline", type=float, default=float(os.environ.get("BENCH_DEADLINE", 560.0)),
                   help="seconds from start this driver may use (a step that would not fit is skipped)")
    p.add_argument("--big-needs", type=float, default=200.0, help="seconds ttft_big needs to be started")
    g = p.add_argument_group("gpu_8b")
    g.add_argument("--dims", default="8b", help="model shape: 8b, tiny, or key=value,... over the 8B shape")
    g.add_argument("--model-dir", default=None, help="model directory (default: /dev/shm/spec-cache-8b for 8b)")
    g.add_argument("--steps", default=",".join(STEPS), help="per length, in this order")
    g.add_argument("--first-write-at", default="4096", help="lengths the first_write step runs at")
    g.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="a next turn's new tokens")
    g.add_argument("--cold-reps", type=int, default=GPU_8B["cold_reps"])
    g.add_argument("--warm-reps", type=int, default=GPU_8B["warm_reps"])
    args = p.parse_args(argv)
    start = time.perf_counter()
    deadline = Deadline(args.deadline)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    result = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
              "environment": environment(),
              "configs": {"ttft": SMALL, "store_io": STORE_IO, "ttft_big": BIG, "routes": ROUTES,
                          "gpu_8b": dict(GPU_8B, lengths=lengths, dims=args.dims, steps=args.steps,
                                         cold_reps=args.cold_reps, warm_reps=args.warm_reps,
                                         new_tokens=args.new_tokens, first_write_at=args.first_write_at)},
              "deadline_s": args.deadline, "results": {}, "errors": {}, "skipped": {}, "figures": {}, "goals": {}}

    def save():
        result["seconds"] = time.perf_counter() - start
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)  # a reader (or a kill) never sees half a file

    def publish_8b(out):
        result["results"]["gpu_8b"] = out
        result["figures"].update(b8.figures(out))
        result["goals"] = goals(result["figures"])
        for step, why in out.get("skipped", {}).items():
            result["skipped"][f"gpu_8b.{step}"] = why
        for step, err in out.get("errors", {}).items():
            result["errors"][f"gpu_8b.{step}"] = err
        save()

    def stop(signum, frame):  # the shell's timeout: keep what finished, say where it stopped
        result["stopped"] = f"signal {signum} after {time.perf_counter() - start:.0f} s"
        save()
        log(f"stopped by signal {signum}; figures: {json.dumps(result['figures'])}")
        os._exit(3)
    signal.signal(signal.SIGTERM, stop)
    log(f"environment: {json.dumps(result['environment'])}")
    save()
    jobs = {"limits": run_limits, "routes": lambda: run_routes(ROUTES),
            "gpu_8b": lambda: run_gpu_8b(args, deadline, publish_8b), "stages": lambda: run_stages(16384),
            "ttft": lambda: run_ttft(SMALL), "store_io": lambda: run_store_io(STORE_IO),
            "ttft_big": lambda: run_ttft(BIG)}
    for name in args.sections.split(","):
        left = deadline.left()
        if name == "ttft_big" and left < args.big_needs:
            result["skipped"][name] = f"only {left:.0f} s left of the {args.deadline:.0f} s budget"
            log(f"skip {name}: {result['skipped'][name]}")
            continue
        if left < 20:
            result["skipped"][name] = f"only {left:.0f} s left"
            log(f"skip {name}: {result['skipped'][name]}")
            continue
        log(f"section {name} ...")
        t0 = time.perf_counter()
        try:
            result["results"][name] = jobs[name]()
            result["results"][name]["section_seconds"] = time.perf_counter() - t0
            result["results"][name]["mlx_peak_memory_bytes"] = peak_memory()
            if name == "gpu_8b":
                publish_8b(result["results"][name])
            log(f"{name}: {json.dumps(result['results'][name])}")
        except Exception as e:
            result["errors"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"{name} FAILED: {traceback.format_exc()}")
        save()
    log(f"figures: {json.dumps(result['figures'])}")
    log(f"goals: {json.dumps(result['goals'])}")
    log(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
