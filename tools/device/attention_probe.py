"""Where a prefill step's attention time goes on MLX CUDA (issue 35's slow agent turns), in one short device call.

Two parts, each printing a line per case and writing one JSON (``--json``):

* ``sdpa``: ``mx.fast.scaled_dot_product_attention`` alone at the 8B shape (32 query heads, 8 KV heads, D 128,
  bf16; keys and values sliced out of a 256-step buffer as ``BatchKVCache`` hands them over), for chunks of
  ``--chunks`` tokens over ``--contexts`` keys already held, four routes: ``causal`` (one row, mlx-lm's
  ``KVCache`` path and, since this commit, an unpadded batch's), ``array1`` (one row, the batch cache's own boolean
  mask: what every batched prefill passed before), ``array2`` (two rows, the second left-padded by 600 keys: a
  cohort of rows of different lengths), ``ops1`` (one row, causal, through ``attention_route.ops_attention``: MLX's
  own ops, the route few-query calls take on CUDA since this commit). Per case: the first call (a new shape: cuDNN
  builds a graph, NVRTC may compile) and the median of ``--repeats`` calls after it. The difference is what each
  step of a new shape pays.
* ``forward`` (with ``--model``): the target's whole forward through ``TargetRows`` over one row that holds
  ``--prefix`` tokens, for each chunk length twice over (a new shape, then the same shape again), with the mask the
  runtime picks (``causal``), with the array mask forced (``array``) and with every multi-query attention through
  MLX's ops (``ops``, ``SPEC_CACHE_ATTENTION=ops``): the A/B of both changes in a real forward.

Usage on the lent machine (MLX CUDA installed as ``serve_8b_shaped.sh`` does; ``serve_issue35.sh PART=probe``):
``python3 tools/device/attention_probe.py --json OUT.json [--model /tmp/serve-8b/model]``. On the CPU (a check of
the script, not a figure): ``--contexts 64 --chunks 8,16 --repeats 2 --heads 4 --kv-heads 2 --head-dim 16``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

MODES = ("causal", "array1", "array2", "ops1")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _timed(fn) -> float:
    started = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - started) * 1000


def sdpa_case(mode: str, context: int, chunk: int, *, heads: int, kv_heads: int, head_dim: int,
              repeats: int, dtype) -> dict:
    from mlx_lm.models.base import create_causal_mask

    rows = 2 if mode == "array2" else 1
    pad = 600 if mode == "array2" else 0
    keys_n = context + chunk + pad
    capacity = -(-keys_n // 256) * 256
    q = mx.random.normal((rows, heads, chunk, head_dim)).astype(dtype)
    k_buf = mx.random.normal((rows, kv_heads, capacity, head_dim)).astype(dtype)
    v_buf = mx.random.normal((rows, kv_heads, capacity, head_dim)).astype(dtype)
    mx.eval(q, k_buf, v_buf)
    keys, values = k_buf[..., :keys_n, :], v_buf[..., :keys_n, :]
    if mode in ("causal", "ops1"):
        mask = "causal"
    else:
        left = mx.array([pad, 0][:rows]) if rows == 2 else mx.array([0])
        mask = create_causal_mask(chunk, offset=keys_n - chunk, left_padding=left)
    scale = head_dim ** -0.5

    def run():
        if mode == "ops1":
            from spec_cache.rows.attention_route import ops_attention

            return ops_attention(q, keys, values, scale, mask)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)

    first = _timed(run)
    later = [_timed(run) for _ in range(repeats)]
    return {"mode": mode, "context": context, "chunk": chunk, "rows": rows, "keys": keys_n,
            "first_ms": round(first, 3), "repeat_ms": round(statistics.median(later), 3)}


def forward_cases(model_dir: str, prefix: int, chunks: list[int], step: int) -> list[dict]:
    import spec_cache.rows.ports as ports
    from spec_cache.rows import attention_route
    from spec_cache.rows.target import TargetModel, TargetRows

    target = TargetModel.load(model_dir)
    attention_route.uninstall()  # each mode below says its own route
    vocab = 200  # inside any vocabulary (the tiny CPU check model has 256 ids)
    rows = TargetRows.from_row_caches(target, [None])
    rows.prefill([[1 + (i * 7) % vocab for i in range(prefix)]], step=step)
    real = ports.DecoderPort._masks
    out = []

    def forced(self, h, caches, unpadded):
        return real(self, h, caches, False)

    for chunk in chunks:
        tokens = [[2 + (i * 11) % vocab for i in range(chunk)]]
        for attempt in ("new", "again"):
            for mode in ("causal", "array", "ops"):
                ports.DecoderPort._masks = forced if mode == "array" else real
                if mode == "ops":
                    attention_route.install(target._layers, environ={"SPEC_CACHE_ATTENTION": "ops"})
                try:
                    started = time.perf_counter()
                    rows.prefill(tokens, step=step, need_hidden=False)
                    mx.synchronize()
                    ms = (time.perf_counter() - started) * 1000
                finally:
                    ports.DecoderPort._masks = real
                    attention_route.uninstall()
                rows.discard_last(chunk)
                out.append({"mode": mode, "prefix": prefix, "chunk": chunk, "shape": attempt, "ms": round(ms, 2)})
                print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2500,8200,12000,12600,14000,16000")
    parser.add_argument("--chunks", default="4,9,545,593,1524")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--model", help="the 8B-shaped model directory: also time whole forwards (A/B of the mask)")
    parser.add_argument("--prefix", type=int, default=12000)
    parser.add_argument("--step", type=int, default=2048)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    report: dict = {"device": str(mx.default_device()), "mlx": mx.__version__, "sdpa": [], "forward": []}
    try:
        for context in _ints(args.contexts):
            for chunk in _ints(args.chunks):
                for mode in MODES:
                    case = sdpa_case(mode, context, chunk, heads=args.heads, kv_heads=args.kv_heads,
                                     head_dim=args.head_dim, repeats=args.repeats, dtype=dtype)
                    report["sdpa"].append(case)
                    print(json.dumps(case), flush=True)
        if args.model:
            report["forward"] = forward_cases(args.model, args.prefix, _ints(args.chunks), args.step)
    except Exception as exc:  # a device error mid-way still leaves the cases before it
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(report["error"], file=sys.stderr)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
