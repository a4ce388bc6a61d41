"""A warm turn's prefill in-process, three ways: the engine's ``TargetRows`` path (restored caches, the new tokens
prefilled with each row's last hidden evaluated, then the first token), the same with only the cache states
evaluated, and mlx-lm's ``generate_step`` on the same restored state.

Why: on the CPU bench (a 2-layer tiny llama), ``spec-cache serve``'s warm TTFT was ~0.5x ``mlx_lm.server``'s while
everything else on the request path measured a few ms. ``BatchRows.prefill`` evaluates the last hidden of every
row at each chunk (for drafters that need it), which makes MLX run the last layer's attention and MLP over the
whole chunk; mlx-lm's prefill evaluates the cache states only, so the last layer stops at its K/V projection.
That is half the prefill of a 2-layer model (~3% of a 30-layer one). With no drafter nothing reads that hidden.

    .venv/bin/python tools/bench_warm_prefill.py [--model DIR] [--restored 1600] [--new 180] [--reps 8]

Prints the median milliseconds of each, interleaved (alternating order) so they see the same machine load.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--restored", type=int, default=1600)
    p.add_argument("--new", type=int, default=180)
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args(argv)
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from spec_cache.rows.target import TargetModel, TargetRows

    model_dir = args.model
    if model_dir is None:
        from spec_cache.testing.tiny import write_tiny_target

        model_dir = write_tiny_target(tempfile.mkdtemp(prefix="warm-prefill-") + "/tiny")
    target = TargetModel.load(model_dir)
    vocab = min(target.vocab_size, 250)
    rng = random.Random(0)
    base = [rng.randrange(3, vocab) for _ in range(args.restored)]
    new = [rng.randrange(3, vocab) for _ in range(args.new)]
    held = TargetRows.from_row_caches(target, [None])
    held.prefill([base])
    restored = held.extract(0)  # what a memory-tier hit hands the row
    reference = make_prompt_cache(target.model)
    for _ in generate_step(mx.array(base), target.model, prompt_cache=reference, max_tokens=1):
        pass

    def first_token(rows) -> None:
        out = rows.append_ids(mx.array([[new[-1]]], dtype=mx.uint32))
        mx.argmax(out.logits[:, -1], axis=-1).tolist()

    def engine_path() -> None:
        rows = TargetRows.from_row_caches(target, [restored])
        rows.prefill([new[:-1]], step=512)
        first_token(rows)

    def states_only() -> None:
        rows = TargetRows.from_row_caches(target, [restored])
        caches = rows._ensure_caches()
        target.forward(mx.array([new[:-1]], dtype=mx.uint32), caches, with_logits=False)
        mx.eval(rows._arrays(caches))
        rows._lengths = [rows._lengths[0] + len(new) - 1]
        first_token(rows)

    def mlx_lm() -> None:
        cache = copy.deepcopy(reference)  # holds base (its generated token is never forwarded): the same state
        for _ in generate_step(mx.array(new), target.model, prompt_cache=cache, max_tokens=1):
            pass

    ways = {"engine (last hidden evaluated)": engine_path, "cache states only": states_only,
            "mlx-lm generate_step": mlx_lm}
    times: dict = {k: [] for k in ways}
    for rep in range(args.reps):
        for name in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
            began = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - began)
    print(f"restored {args.restored} tokens, {args.new} new; median ms over {args.reps}:")
    for name, values in times.items():
        print(f"  {name:32s} {statistics.median(values) * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
