"""Where a warm TTFT goes on the lent H200 (run by tools/device/bench_gpu.sh --profile there, never by CI).

Builds the same model as ``spec_cache.apps.bench.ttft`` (random weights), stores the prompt-boundary checkpoint of one
prompt, reopens the store, then times the stages of a warm ``Generator.generate`` separately: ``Store.fetch``
(LMDB read + record decode), ``SpecCache.restore`` (fetch + ``mx.array`` + eval on the device), the whole
``Generator._restore``, and the whole ``generate``; then prints a cProfile of one warm ``generate``. Figures are
medians of ``--reps`` runs; one JSON line per length goes to stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile

import numpy as np

from spec_cache.apps.bench.timing import median_time as timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="cProfile rows printed (by cumulative time)")
    args = p.parse_args(argv)

    import mlx.core as mx

    from spec_cache.decode.generator import Generator
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
    from spec_cache.tiers.cache import SpecCache

    work = tempfile.mkdtemp(prefix="profile-warm-")
    h = args.hidden
    target = write_tiny_target(os.path.join(work, "target"), hidden_size=h, num_layers=args.layers,
                               num_heads=h // 64, num_kv_heads=max(1, h // 256), head_dim=64,
                               intermediate_size=int(h * 2.75), vocab_size=args.vocab, tokenizer=False)
    drafter = write_tiny_drafter(os.path.join(work, "assistant"), "assistant", target, seed=1)
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()}, model hidden {h}, {args.layers} layers", flush=True)
    for n in [int(x) for x in args.lengths.split(",")]:
        prompt = rng.integers(3, args.vocab, n).tolist()
        store_dir = os.path.join(work, f"store-{n}")
        with SpecCache.open(store_dir) as cache:
            Generator.load(target, drafter, cache=cache).generate([prompt], max_tokens=1)
        with SpecCache.open(store_dir) as cache:
            gen = Generator.load(target, drafter, cache=cache)
            gen.generate([prompt], max_tokens=1)  # warm-up
            key = prompt[:n - 1]
            dn = gen.drafter_namespace
            fetched = cache.store.fetch(gen.ns_key, key, drafter=dn)
            stored_bytes = sum(np.asarray(t.data).nbytes for layer in fetched.layers for t in layer.tensors)
            row = {"tokens": n, "stored_layer_bytes": stored_bytes,
                   "lookup_s": timed(lambda: cache.store.lookup(gen.ns_key, key, drafter=dn), args.reps),
                   "store_fetch_s": timed(lambda: cache.store.fetch(gen.ns_key, key, drafter=dn), args.reps),
                   "cache_restore_s": timed(lambda: cache.restore(gen.ns_key, key, drafter_namespace=dn), args.reps),
                   "generator_restore_s": timed(lambda: gen._restore(prompt), args.reps),
                   "generate_s": timed(lambda: gen.generate([prompt], max_tokens=1), args.reps)}
            warm = [gen.generate([prompt], max_tokens=1)[0] for _ in range(args.reps)]
            row["ttft_s"] = statistics.median(r.ttft_s for r in warm)
            row["cached_tokens"] = warm[0].cached_tokens
            print(json.dumps(row), flush=True)
            prof = cProfile.Profile()
            prof.enable()
            gen.generate([prompt], max_tokens=1)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
            print(s.getvalue(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
