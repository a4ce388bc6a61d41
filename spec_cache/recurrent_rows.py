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

Checkpoints hold the state exactly at their boundary (an exact-boundary entry the store never trims); a restored
state serves only its own length (``row_caches.prefix_caches`` answers None for anything shorter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from spec_cache.errors import RestoreRefused
from spec_cache.rows import PreparedStateChange, check_per_row
from spec_cache.target import DonorView, ForwardOutput, TargetRows

__all__ = ["HybridTargetRows", "state_content", "merge_states", "join_states", "clone_states", "split_state"]


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


@dataclass
class _Replay:
    """What the last verify forward left for a rollback: each recurrent layer's state before it and its mixer
    inputs ``[B, width, H]``."""

    before: dict
    inputs: dict
    width: int


class HybridTargetRows(TargetRows):
    """``TargetRows`` for a target with recurrent layers: verify keeps what a rollback needs to replay.

    Rollback reaches only into the last verify window (the states before it are all that is kept); a rollback
    of more tokens than that, or without a verify since the last prefill or membership change, is refused.
    """

    _holds_recurrent_state = True

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._recurrent = model.recurrent_layers
        self._replay: _Replay | None = None

    def prefill(self, tokens_per_row, step: int = 512, *, tap_layers: Sequence[int] = ()):
        self._replay = None
        return super().prefill(tokens_per_row, step, tap_layers=tap_layers)

    def verify(self, window: Sequence[Sequence[int]], *, tap_layers: Sequence[int] = ()) -> ForwardOutput:
        lengths = self._check_rows(window)
        if len(set(lengths)) != 1 or lengths[0] == 0:
            raise ValueError(f"verify windows must be non-empty and of equal length, got lengths {lengths}")
        caches = self._ensure_caches()
        before = {layer: list(caches[layer].cache) for layer in self._recurrent}
        inputs: dict = {}
        out = self.model.forward(mx.array([list(w) for w in window], dtype=mx.uint32), caches, tap_layers=tap_layers,
                                 recurrent_inputs=inputs)
        self._lengths = [n + lengths[0] for n in self._lengths]
        self._replay = _Replay(before, inputs, lengths[0])
        return out

    def rollback(self, rejected: Sequence[int]) -> None:
        """Drop the last ``rejected[row]`` tokens of each row: K/V as ``TargetRows`` does, recurrent state by
        replaying the kept part of the last verify window from the state before it."""
        rejected = [int(r) for r in rejected]
        check_per_row(rejected, self.row_count, "rollback count")
        replay = self._replay
        if not any(rejected):
            self._replay = None
            return
        if replay is None or any(r > replay.width for r in rejected):
            width = 0 if replay is None else replay.width
            raise ValueError(f"recurrent state is never trimmable: a rollback reaches only into the last verify "
                             f"window ({width} tokens), asked for {rejected}")
        super().rollback(rejected)
        self._replay = None
        kept = [replay.width - r for r in rejected]
        span = max(kept)
        changed = mx.array([r > 0 for r in rejected])
        for layer in self._recurrent:
            cache = self._caches[layer]
            verified = list(cache.cache)
            cache.cache = [mx.zeros_like(v) if b is None else b for b, v in zip(replay.before[layer], verified)]
            if span:
                cache.lengths = mx.array(kept)
                try:
                    self.model.recurrent_mixer(layer)(replay.inputs[layer][:, :span], cache.make_mask(span), cache)
                finally:
                    cache.lengths = None
            cache.cache = [mx.where(changed.reshape(-1, *([1] * (v.ndim - 1))), r, v)
                           for r, v in zip(cache.cache, verified)]
        self.materialize()

    def prepare_append(self, other: "TargetRows") -> PreparedStateChange:
        self._replay = None
        return super().prepare_append(other)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._replay = None
        super().filter_rows(keep)

    def donors(self, layer: int) -> DonorView:
        if self.model.layer_kind(layer) == "recurrent":
            raise ValueError(f"layer {layer} is recurrent: it holds no K/V to donate")
        return super().donors(layer)
