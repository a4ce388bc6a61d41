"""GPU benchmark driver for the lent H200 (run by tools/device/bench_gpu.sh there, never by CI).

Runs spec-cache's own benchmark code unchanged — ``spec_cache.bench.ttft.run`` and
``spec_cache.bench.store_io.bench_put_get`` — under MLX's CUDA backend and writes one JSON file, rewritten after
each section so that a run stopped at the device's time limit still returns what it measured.

Sections: ``ttft`` (hidden 1024, 8 layers, 1k/4k/16k tokens), ``store_io`` (256 MiB KV state put/get vs mlx-lm
save/load), ``ttft_big`` (hidden 4096, 16 layers, float32, 4k/16k tokens; skipped when less than
``--big-needs`` seconds are left before ``--deadline``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback

SMALL = {"lengths": [1024, 4096, 16384], "warm_reps": 5, "cold_reps": 3, "hidden": 1024, "layers": 8, "vocab": 32000}
BIG = {"lengths": [4096, 16384], "warm_reps": 5, "cold_reps": 3, "hidden": 4096, "layers": 16, "vocab": 32000}
STORE_IO = {"reps": 5, "tokens": 4096}


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
           "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip()}
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and hasattr(cuda, "is_available"):
        env["mlx_cuda_available"] = bool(cuda.is_available())
    if hasattr(mx, "device_info"):
        try:
            env["mlx_device_info"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                                      for k, v in mx.device_info().items()}
        except Exception as e:
            env["mlx_device_info"] = f"error: {e}"
    try:
        import mlx_lm
        env["mlx_lm"] = mlx_lm.__version__
    except Exception as e:
        env["mlx_lm"] = f"error: {e}"
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


def run_ttft(cfg: dict) -> dict:
    from spec_cache.bench import ttft

    return ttft.run(cfg["lengths"], warm_reps=cfg["warm_reps"], cold_reps=cfg["cold_reps"], hidden=cfg["hidden"],
                    layers=cfg["layers"], vocab=cfg["vocab"], progress=lambda m: log(m))


def run_store_io(cfg: dict) -> dict:
    from spec_cache.bench import store_io

    return store_io.bench_put_get(cfg["reps"], cfg["tokens"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file, rewritten after each section")
    p.add_argument("--sections", default="ttft,store_io,ttft_big")
    p.add_argument("--deadline", type=float, default=520.0, help="seconds from start this driver may use")
    p.add_argument("--big-needs", type=float, default=200.0, help="seconds ttft_big needs to be started")
    args = p.parse_args(argv)
    start = time.perf_counter()
    result = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv,
              "environment": environment(), "configs": {"ttft": SMALL, "store_io": STORE_IO, "ttft_big": BIG},
              "results": {}, "errors": {}, "skipped": {}}

    def save():
        result["seconds"] = time.perf_counter() - start
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    log(f"environment: {json.dumps(result['environment'])}")
    save()
    jobs = {"ttft": lambda: run_ttft(SMALL), "store_io": lambda: run_store_io(STORE_IO),
            "ttft_big": lambda: run_ttft(BIG)}
    for name in args.sections.split(","):
        left = args.deadline - (time.perf_counter() - start)
        if name == "ttft_big" and left < args.big_needs:
            result["skipped"][name] = f"only {left:.0f} s left of the {args.deadline:.0f} s budget"
            log(f"skip {name}: {result['skipped'][name]}")
            continue
        log(f"section {name} ...")
        t0 = time.perf_counter()
        try:
            result["results"][name] = jobs[name]()
            result["results"][name]["section_seconds"] = time.perf_counter() - t0
            result["results"][name]["mlx_peak_memory_bytes"] = peak_memory()
            log(f"{name}: {json.dumps(result['results'][name])}")
        except Exception as e:
            result["errors"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"{name} FAILED: {traceback.format_exc()}")
        save()
    log(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
