"""TTFT of a cold prefill vs a restore from the store, through the public ``Generator`` API.

Model: llama, hidden 1024, 8 layers, 16 heads / 4 KV heads (head_dim 64), intermediate 2816, vocab 32000,
float32, random weights written locally; drafter: the assistant (its row is restored too). Cold = no cache;
warm = the same prompt again after a first run stored its prompt-boundary checkpoint (store reopened, page
cache warm). Median of N warm runs; cold runs are few because a 4k prefill takes tens of seconds on 2 cores.

Usage: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python tools/bench_ttft.py [--lengths 1024 4096]
       [--warm-reps 5] [--cold-reps 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def blas_in_use() -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    return "openblas (LD_PRELOAD)" if "openblas" in preload else "mlx bundled reference BLAS"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--warm-reps", type=int, default=5)
    p.add_argument("--cold-reps", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from spec_cache.cache import SpecCache
    from spec_cache.generator import Generator
    from spec_cache.tiny import write_tiny_drafter, write_tiny_target

    work = tempfile.mkdtemp(prefix="bench-ttft-")
    target = write_tiny_target(os.path.join(work, "target"), hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256), head_dim=64,
                               intermediate_size=int(args.hidden * 2.75), vocab_size=32000, tokenizer=False)
    drafter = write_tiny_drafter(os.path.join(work, "assistant"), "assistant", target, seed=1)
    rng = np.random.default_rng(0)
    result = {"blas": blas_in_use(), "model": f"llama hidden {args.hidden}, {args.layers} layers, float32",
              "drafter": "assistant"}
    cold_gen = Generator.load(target, drafter)
    for n in args.lengths:
        prompt = rng.integers(3, 32000, n).tolist()
        cold = [cold_gen.generate([prompt], max_tokens=1)[0] for _ in range(args.cold_reps)]
        store_dir = os.path.join(work, f"store-{n}")
        with SpecCache.open(store_dir) as cache:
            Generator.load(target, drafter, cache=cache).generate([prompt], max_tokens=1)
        with SpecCache.open(store_dir) as cache:
            gen = Generator.load(target, drafter, cache=cache)
            warm = [gen.generate([prompt], max_tokens=1)[0] for _ in range(args.warm_reps)]
        assert all(w.cached_tokens == n - 1 and w.restored_drafter for w in warm)
        assert all(w.tokens == cold[0].tokens for w in warm)
        c = statistics.median(r.ttft_s for r in cold)
        w = statistics.median(r.ttft_s for r in warm)
        key = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        result[f"ttft_cold_s_{key}"] = c
        result[f"ttft_warm_s_{key}"] = w
        result[f"restore_vs_prefill_{key}"] = c / w
        if not args.json:
            print(f"{n:6d} tokens: cold {c:8.3f} s   warm {w * 1e3:8.1f} ms   {c / w:7.1f}x", flush=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"blas: {result['blas']}; {result['model']}; drafter row restored too")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
