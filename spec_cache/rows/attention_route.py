"""Which attention a target layer runs for a few queries on MLX's CUDA backend: MLX's own ops, not a cuDNN plan.

Why: MLX's CUDA backend runs ``mx.fast.scaled_dot_product_attention`` for more than one query through cuDNN, and
caches cuDNN's execution plan under the call's exact shapes (``scaled_dot_product_attention.cpp``, MLX 0.32: the
key length and the mask's shape are in the key). A verify window (the pending token plus the drafted ones: 2-9
queries) meets a key length it never met before at every round, so every round builds plans on the host: ~22 ms a
shape class on a GB10 in lablup/mlxcel#1799, where routing 2-32 queries to MLX's ops instead took a drafter from
0.72x to 1.33x of plain decoding; a cuDNN plan build took 55-70 ms a shape in flashinfer#5245's measurements. For so
few queries the ops are cheap: the scores are ``[B, heads, queries, keys]`` (32 MB for 4 rows of 4 queries over
16k keys of an 8B-shaped model).

:func:`ops_attention` is the op sequence of MLX's own fallback (``fast.cpp``: scale, grouped-query reshape, matmul,
boolean mask to ``finfo.min``, precise softmax, matmul), so on the CPU (where MLX always runs that fallback) it
gives the same bits as ``mx.fast.scaled_dot_product_attention``. :func:`install` puts a router in place of
``scaled_dot_product_attention`` in the mlx-lm modules whose attention the target's layers run: calls with
``2..max_queries`` queries over full-precision keys take the ops, everything else goes on to mlx-lm's function.

``SPEC_CACHE_ATTENTION``: ``auto`` (default: routed on MLX's CUDA backend, 2-32 queries), ``mlx`` (never routed),
``ops`` (routed on any backend, every multi-query call: a test and benchmark switch).
``SPEC_CACHE_ATTENTION_MAX_QUERIES=N`` moves ``auto``'s limit (a GPU session's A/B of prefill chunks through the ops,
without a code change). Prefill chunks stay on cuDNN under ``auto`` (hundreds of queries: its fused kernel beats
materialized scores; whether a plan build per chunk still costs more is measured by
``tools/device/attention_probe.py``, not assumed).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import mlx.core as mx

__all__ = ["DEFAULT_MAX_QUERIES", "install", "max_queries", "mode", "ops_attention", "routed_modules"]

#: the most queries a routed call may have under ``auto`` (verify windows and the smallest prefill pieces)
DEFAULT_MAX_QUERIES = 32
_LOCK = threading.Lock()
_ROUTED: dict[str, tuple[Callable, int]] = {}  # module name -> (mlx-lm's function it replaced, max queries)


def mode(environ=os.environ) -> str:
    value = environ.get("SPEC_CACHE_ATTENTION", "auto").strip().lower() or "auto"
    if value not in ("auto", "mlx", "ops"):
        raise ValueError(f"SPEC_CACHE_ATTENTION must be auto, mlx or ops, not {value!r}")
    return value


def max_queries(environ=os.environ) -> int:
    """``auto``'s limit: the most queries a routed call may have."""
    text = environ.get("SPEC_CACHE_ATTENTION_MAX_QUERIES", "").strip()
    if not text:
        return DEFAULT_MAX_QUERIES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        raise ValueError(f"SPEC_CACHE_ATTENTION_MAX_QUERIES must be an integer >= 2, not {text!r}")
    return value


def ops_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)`` as MLX's fallback
    computes it (``queries [B, Hq, L, D]``, ``keys``/``values [B, Hkv, S, D]``, ``mask`` None, ``"causal"`` with the
    queries at the end of the keys, or an array broadcastable to ``[B, Hq, L, S]``, boolean or additive)."""
    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    repeats = heads // kv_heads
    q = mx.array(scale, queries.dtype) * queries
    k, v = keys, values
    if repeats > 1:
        q = q.reshape(batch, kv_heads, repeats, length, dim)
        k = mx.expand_dims(k, 2)
        v = mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    if mask is not None:
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"unknown mask mode {mask!r}")
            total = k.shape[-2]
            mask = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
        else:
            if mask.dtype != mx.bool_ and mask.dtype != queries.dtype:
                mask = mask.astype(queries.dtype)  # MLX casts an additive mask to the output type first
            mask = mx.broadcast_to(mask, (batch, heads, length, k.shape[-2]))  # and broadcasts it so
            if repeats > 1:
                mask = mask.reshape(batch, kv_heads, repeats, length, k.shape[-2])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = scores @ v
    if repeats > 1:
        out = out.reshape(batch, heads, length, dim)
    return out


def _router(original: Callable, max_queries: int | None) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        length = queries.shape[2]
        if (sinks is None and length > 1 and (max_queries is None or length <= max_queries)
                and not hasattr(cache, "bits") and isinstance(keys, mx.array)):
            return ops_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.spec_cache_routed = True
    return scaled_dot_product_attention


def install(layers: list, *, environ=os.environ, cuda: bool | None = None) -> list[str]:
    """Route the attention of the mlx-lm modules ``layers``' attention comes from (module doc), as the mode says;
    the names of the modules routed now or before. Idempotent; leaves a module alone that has no
    ``scaled_dot_product_attention`` of its own."""
    chosen = mode(environ)
    if chosen == "mlx":
        return []
    limit = None if chosen == "ops" else max_queries(environ)  # a bad value is refused on every backend
    if chosen == "auto":
        if cuda is None:
            from spec_cache.state.device_copy import is_cuda

            cuda = is_cuda()
        if not cuda:
            return []
    names = set()
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if attention is not None:
            names.add(type(attention).__module__)
    routed = []
    with _LOCK:
        for name in sorted(names):
            module = sys.modules.get(name)
            current = getattr(module, "scaled_dot_product_attention", None)
            if module is None or current is None:
                continue
            if getattr(current, "spec_cache_routed", False):
                if _ROUTED[name][1] == limit:
                    routed.append(name)
                    continue
                current = _ROUTED[name][0]
            module.scaled_dot_product_attention = _router(current, limit)
            _ROUTED[name] = (current, limit)
            routed.append(name)
    return routed


def routed_modules() -> dict[str, int | None]:
    """The modules routed in this process and each one's query limit (None: every multi-query call)."""
    with _LOCK:
        return {name: limit for name, (_, limit) in _ROUTED.items()}


def uninstall() -> None:
    """Put mlx-lm's functions back (tests)."""
    with _LOCK:
        for name, (original, _) in _ROUTED.items():
            module = sys.modules.get(name)
            if module is not None:
                module.scaled_dot_product_attention = original
        _ROUTED.clear()
