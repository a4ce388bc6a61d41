"""Recurrent layers (mlx-lm ``ArraysCache``: conv state + recurrent state) in batched target rows.

A hybrid target (``qwen3_next``) mixes attention layers, whose K/V the rows hold as in ``TargetRows``, with
recurrent layers holding one fixed-size state per row. That state is never trimmable: a rejected draft cannot be
cut off it. Two ways back were weighed:

* keep the state after every position of the verify window: for Qwen3-Next-80B one layer's state is 32 heads x
  128 x 128 float32 = 2 MiB per row and position, x 36 recurrent layers x a 5-token window = 360 MiB per row per
  round;
* **replay** (chosen): keep the states from before the verify forward (no copy: MLX arrays are values) and each
  recurrent layer's mixer input for the window (``[B, L, H]``, a few KiB), and on rollback run only the
  recurrent mixers again over the kept prefix of the window, one batched call per layer with per-row lengths
  (``ArraysCache.lengths``, as mlx-lm's batched prefill masks right padding). Attention and MLPs are not re-run:
  a recurrent layer's input at a kept position does not depend on later positions. Rows that kept their whole
  window keep the verified state unchanged.

This module holds the per-row state operations (read, merge, join, clone, split an ``ArraysCache``) and
imports nothing of the rows; ``spec_cache.rows.target.HybridTargetRows`` runs the replay beside the ``TargetRows``
it extends (``target`` imports this module, never the other way round: they used to import each other).

Checkpoints hold the state exactly at their boundary (an exact-boundary entry the store never trims); a restored
state serves only its own length (``row_caches.prefix_caches`` answers None for anything shorter).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from spec_cache.errors import RestoreRefused

__all__ = ["state_content", "merge_states", "join_states", "clone_states", "split_state"]


def state_content(cache: Any, layer: int, row: int) -> list | None:
    """The arrays (``[1, ...]`` each) of one restored single-row ``ArraysCache``, None when it is empty."""
    where = f"row {row} layer {layer}"
    if not isinstance(cache, ArraysCache):
        raise RestoreRefused(f"{where}: a {type(cache).__name__} for a recurrent layer (expected ArraysCache)")
    present = [a is not None for a in cache.cache]
    if not any(present):
        return None
    if not all(present):
        raise RestoreRefused(f"{where}: a recurrent state with some of its arrays missing: {present}")
    if any(a.shape[0] != 1 for a in cache.cache):
        raise RestoreRefused(f"{where}: a restored recurrent state must hold one row, "
                             f"got {[a.shape for a in cache.cache]}")
    return list(cache.cache)


def merge_states(contents: Sequence[list | None], size: int) -> ArraysCache:
    """One batched ``ArraysCache`` from per-row arrays; an empty row gets zeros, which is exactly what the layer
    starts from when its state is None."""
    cache = ArraysCache(size)
    present = [c for c in contents if c is not None]
    if not present:
        return cache
    for i in range(size):
        sample = present[0][i]
        zeros = mx.zeros((1, *sample.shape[1:]), dtype=sample.dtype)
        cache.cache[i] = mx.concatenate([zeros if c is None else c[i] for c in contents], axis=0)
    return cache


def clone_states(cache: ArraysCache) -> ArraysCache:
    """A new ``ArraysCache`` over the same (immutable) arrays: mlx-lm assigns new arrays, never writes them."""
    clone = ArraysCache(len(cache.cache))
    clone.cache = list(cache.cache)
    return clone


def join_states(first: ArraysCache, first_rows: int, second: ArraysCache, second_rows: int) -> ArraysCache:
    """``first``'s rows then ``second``'s (zeros for a side that holds no state yet); neither is changed."""
    joined = ArraysCache(len(first.cache))
    for i, (a, b) in enumerate(zip(first.cache, second.cache)):
        if a is None and b is None:
            continue
        sample = a if a is not None else b
        if a is None:
            a = mx.zeros((first_rows, *sample.shape[1:]), dtype=sample.dtype)
        if b is None:
            b = mx.zeros((second_rows, *sample.shape[1:]), dtype=sample.dtype)
        joined.cache[i] = mx.concatenate([a, b], axis=0)
    return joined


def split_state(cache: ArraysCache, row: int) -> ArraysCache:
    """Row ``row`` as a single-row ``ArraysCache`` of owned contiguous arrays (mlx-lm's own layout)."""
    single = ArraysCache(len(cache.cache))
    single.cache = [None if a is None else mx.contiguous(a[row : row + 1]) for a in cache.cache]
    return single
