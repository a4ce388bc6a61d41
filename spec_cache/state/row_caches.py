"""A row's single-row mlx-lm caches, layer by layer through the table of cache kinds: their length and their cuts.

A checkpoint holds one row as mlx-lm's own single-sequence caches (``KVCache``; ``RotatingKVCache`` for a
sliding-window layer; ``QuantizedKVCache`` for a converted layer; ``ArraysCache`` for a recurrent one). Every
per-layer decision is the layer's kind's (``spec_cache.state.cache_kinds``): this module only walks a row's layers.
The batch mechanics (``merge_rows``, ``rotating_snapshot``) live in ``spec_cache.state.batch_caches`` and are
re-exported here for their old import path.
"""

from __future__ import annotations

from typing import Any, Sequence

from spec_cache.errors import RestoreRefused
from spec_cache.state.batch_caches import merge_rows, rotating_snapshot
from spec_cache.state.cache_kinds import kind_of

__all__ = ["row_position", "row_content", "merge_rows", "rotating_snapshot", "prefix_caches"]


def row_position(layers: Sequence[Any], row: int = 0) -> int:
    """The token count of one row's restored caches (every layer that carries a count must agree; a recurrent
    ``ArraysCache`` carries none), else RestoreRefused."""
    positions = {kind_of(cache).tokens(cache) for cache in layers} - {None}
    if not positions:
        raise RestoreRefused(f"row {row}: restored caches have no K/V layer to tell their length")
    if len(positions) != 1:
        raise RestoreRefused(f"row {row}: restored caches disagree on their length: {sorted(positions)}")
    return positions.pop()


def row_content(cache: Any, window: int | None, layer: int, row: int) -> Any:
    """What a batched row needs from one restored single-row cache (its kind's ``content``): a K/V layer's keys and
    values (a sliding one's last ``min(offset, window)``), a recurrent layer's arrays. None for an empty cache."""
    return kind_of(cache).content(cache, window, f"row {row} layer {layer}")


def prefix_caches(caches: Sequence[Any], tokens: int, windows: Sequence[int | None]) -> list | None:
    """New single-row caches holding the first ``tokens`` of ``caches`` (which are only read), or None when
    that state cannot be rebuilt from them: every layer's kind's ``cut``, the one prefix rule.

    Full-precision KV slices exactly. A sliding-window snapshot loses its oldest key with every token it is
    cut by, so it serves ``tokens`` only while the keys it keeps still cover that position's window. A quantized
    layer serves no prefix below its conversion point (a cold run holds full precision there). A recurrent
    state (``ArraysCache``) serves only its own length.
    """
    out = []
    whole = row_position(caches)
    for cache, window in zip(caches, windows):
        kind = kind_of(cache)
        held = kind.tokens(cache)
        held = whole if held is None else held
        if held < tokens:
            raise ValueError(f"cannot take {tokens} tokens of caches holding {held}")
        cut = kind.cut(cache, tokens, held, window)
        if cut is None:
            return None
        out.append(cut)
    return out
