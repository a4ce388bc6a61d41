"""What bounds a warm chat turn of the serving bench on the CPU: the same forward in both servers (issue 35).

Why this tool: at one client, ``tools/bench_serve.py``'s defaults (1500-word system prompt, 150-word turns) give
``mlx_lm.server`` a hit in its in-RAM prompt cache on every warm turn, exactly as ``spec-cache serve`` hits its
memory tier (same cached token counts in the bench's table). Both then forward the same ~180 new tokens over the
same ~1.8k cached ones and one more token for the first reply token. This tool times that work in process, without
HTTP, on the bench's tiny float32 llama, three ways:

* ``mlx_lm``: mlx-lm's own path (``model(rest[:-1])`` into a ``KVCache``, cache states evaluated, then the last token
  and its argmax: what ``generate_step`` does after ``fetch_nearest_cache``);
* ``ours``: spec-cache's (``TargetRows.from_row_caches`` of the restored row, ``prefill`` without the LM head, the
  first round's one-token ``verify``);
* mlx-lm's path over an empty cache (the same new tokens attending to no history): the difference is what
  attending to the cached tokens costs;
* the parts of one attention call of that prefill's shapes, timed alone on random inputs (scores, softmax,
  weighted sum), to show which part of the attention costs most.

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        .venv/bin/python tools/cpu_warm_turn_bound.py [--cached 1771] [--new 180] [--reps 30] [--json OUT]

Prints JSON: medians in ms (the two turns run alternately) and ``ours_vs_mlx_lm`` (mlx-lm's time / ours: > 1 means
ours is faster); ``attention_*``: one layer's attention call over the same shapes and its parts, timed alone. On the
2-core VM MLX's CPU ``softmax`` (its ``exp``) is most of each layer's attention and the attention most of the turn.
It is the same operation in both servers, so no serving change moves this ratio far from 1.0: the warm-turn TTFT at
one client is bounded by the model's forward.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _paired_ms(first, second, reps: int) -> tuple[float, float]:
    """Medians of ``first`` and ``second`` run alternately (a busy machine's drift hits both alike)."""
    for _ in range(3):
        first(), second()
    times: tuple[list, list] = ([], [])
    for _ in range(reps):
        for fn, into in ((first, times[0]), (second, times[1])):
            began = time.perf_counter()
            fn()
            into.append(time.perf_counter() - began)
    return tuple(round(1e3 * statistics.median(t), 3) for t in times)


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return round(1e3 * statistics.median(times), 3)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cached", type=int, default=1771, help="tokens the restored row holds (the bench's turn 2)")
    p.add_argument("--new", type=int, default=180, help="tokens of the new turn (the last one gives the reply)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.cached < 1 or args.new < 2 or args.reps < 1:
        p.error("--cached >= 1, --new >= 2 and --reps >= 1")

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from spec_cache.rows.target import TargetModel, TargetRows
    from spec_cache.testing.tiny import write_tiny_target

    target = TargetModel.load(write_tiny_target(Path(tempfile.mkdtemp()) / "tiny"))
    model = target.model
    rng = random.Random(0)
    cached = [rng.randrange(target.vocab_size) for _ in range(args.cached)]
    new = [rng.randrange(target.vocab_size) for _ in range(args.new)]
    base = make_prompt_cache(model)
    model(mx.array(cached)[None], cache=base)
    mx.eval([c.state for c in base])

    def mlx_lm_turn() -> None:
        cache = copy.deepcopy(base)
        model(mx.array(new[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        logits = model(mx.array(new[-1:])[None], cache=cache)
        mx.argmax(logits[:, -1], axis=-1).item()

    def mlx_lm_turn_uncached() -> None:  # the same new tokens over an empty cache: what attends to no history
        cache = make_prompt_cache(model)
        model(mx.array(new[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        logits = model(mx.array(new[-1:])[None], cache=cache)
        mx.argmax(logits[:, -1], axis=-1).item()

    def our_turn() -> None:
        rows = TargetRows.from_row_caches(target, [base])
        rows.prefill([new[:-1]], need_hidden=False)
        out = rows.verify([[new[-1]]])
        mx.argmax(out.logits[:, -1], axis=-1).item()

    # one attention call of that prefill: the model's query heads over the cached + new keys (GQA as the model has it)
    attn = model.model.layers[0].self_attn
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    head_dim = target.kv_geometry(0)[1]
    keys = args.cached + args.new - 1
    q = mx.random.normal((1, heads, args.new - 1, head_dim))
    k = mx.random.normal((1, kv_heads, keys, head_dim))
    v = mx.random.normal((1, kv_heads, keys, head_dim))
    qg = q.reshape(1, kv_heads, (heads // kv_heads) * (args.new - 1), head_dim)
    scores = (qg * attn.scale) @ k.swapaxes(-1, -2)
    weights = mx.softmax(scores, axis=-1, precise=True)
    mx.eval(q, k, v, qg, scores, weights)

    mlx_lm_ms, ours_ms = _paired_ms(mlx_lm_turn, our_turn, args.reps)
    result = {
        "cached_tokens": args.cached, "new_tokens": args.new, "reps": args.reps,
        "model": "tiny float32 llama (spec_cache.testing.tiny)",
        "mlx_lm_ms": mlx_lm_ms, "ours_ms": ours_ms,
        "mlx_lm_uncached_ms": _median_ms(mlx_lm_turn_uncached, args.reps),
        "attention_ms": _median_ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(
            q, k, v, scale=attn.scale, mask="causal")), args.reps),
        "attention_scores_ms": _median_ms(lambda: mx.eval((qg * attn.scale) @ k.swapaxes(-1, -2)), args.reps),
        "attention_softmax_ms": _median_ms(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)), args.reps),
        "attention_weighted_sum_ms": _median_ms(lambda: mx.eval(weights @ v), args.reps),
        "layers": target.num_layers,
    }
    result["ours_vs_mlx_lm"] = round(result["mlx_lm_ms"] / result["ours_ms"], 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
