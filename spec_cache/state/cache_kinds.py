"""One table of the mlx-lm cache kinds spec-cache keeps: the only place that checks a cache's class.

Every route that keeps a cache layer goes through this table: the store (``cache_state.layer_state`` /
``from_layer_state``: arrays copied to host ``Tensor``s and back) and the memory tier (``memory_tier._hold`` /
``_rebuild``: the arrays held as they are, new cache objects over slices of them). The protocol follows mlx-lm's
``state`` / ``from_state``, split the way both routes need it:

* ``capture(cache) -> (meta, arrays)``: the arrays covering exactly the cache's offset (never the 256-step padded
  buffer) and the scalars a rebuild needs. ``meta`` is what the store writes: its keys, their order and the kind
  ``name`` are a public format (golden vectors in tests/golden), never to be changed.
* ``build(meta, arrays) -> cache``: a new cache object over the given arrays (its offset read from them).
* ``token_axis``: 2 when every array is ``[1, heads, tokens, ...]``, so any prefix may be cut off and stored
  chunks shared (trimmable); None when the arrays are kept whole and serve exactly their length.

Kinds: ``KVCache`` -> ``kv`` (keys, values); ``QuantizedKVCache`` -> ``qkv`` (packed words, scales, biases of K
then V; group_size, bits and ``converted_at`` where the runtime recorded its conversion point: part of the layer
signature, so states converted at different offsets never share chunks); ``RotatingKVCache`` -> ``rotating`` (the
ring buffer whole, with offset/keep/max_size/idx); ``ArraysCache`` -> ``arrays`` (recurrent arrays whole, which
slots are present). A subclass of a listed class is that kind (its nearest listed ancestor). Adding a kind is one
``CacheKind`` subclass and one entry in ``KINDS``.

mlx-lm is imported on first use, so importing this module (and the memory tier) does not import MLX.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Sequence

from spec_cache.errors import InvalidRequest, RestoreRefused, SpecCacheError, UnsupportedCombination

__all__ = ["CacheKind", "CacheKindError", "KINDS", "UnknownCacheType", "UnknownLayerKind", "cache_types",
           "kind_named", "kind_of"]


class CacheKindError(SpecCacheError):
    """A cache layer whose kind this table does not know."""


class UnknownCacheType(CacheKindError, UnsupportedCombination, TypeError):
    """A cache object of a class no kind covers (e.g. ``ChunkedKVCache``): this model's caches cannot be stored
    or held. Also a ``TypeError``, what callers caught before the table existed."""


class UnknownLayerKind(CacheKindError, RestoreRefused):
    """A stored or held layer whose kind name no kind carries (a newer writer's kind, or damage): run it cold."""


class CacheKind:
    """One cache kind: the mlx-lm class it covers, the name stored records carry, and how to take and rebuild."""

    name: ClassVar[str]              # LayerState.kind in stored records
    cache_class: ClassVar[str]       # the class's name in mlx_lm.models.cache
    token_axis: ClassVar[int | None] = None  # 2: token-sliceable (trimmable); None: kept whole, exact length

    @property
    def trimmable(self) -> bool:
        return self.token_axis is not None

    def capture(self, cache: Any) -> tuple[dict, list]:
        """``(meta, arrays)`` of one single-row cache, covering exactly its offset."""
        raise NotImplementedError

    def build(self, meta: dict, arrays: Sequence[Any]) -> Any:
        """A new cache object over ``arrays`` (as ``capture`` returned them, or a prefix of them when trimmable)."""
        raise NotImplementedError

    def prefix(self, arrays: Sequence[Any], length: int, held: int) -> list:
        """New array objects over the first ``length`` of ``held`` tokens (slices: views, never copies)."""
        if self.token_axis is None:
            if length != held:
                raise ValueError(f"a {self.name} layer is exact-length ({held} tokens), asked for {length}")
            return [a[...] for a in arrays]
        return [a[..., :length, :] for a in arrays]

    def mlx_class(self) -> type:
        from mlx_lm.models import cache as mlx_cache

        return getattr(mlx_cache, self.cache_class)


def _upto(a: Any, n: int) -> Any:
    """``a`` cut to ``n`` tokens on axis 2 (``a`` itself when it holds exactly ``n``)."""
    return a if a.shape[2] == n else a[..., :n, :]


class _KV(CacheKind):
    name, cache_class, token_axis = "kv", "KVCache", 2

    def capture(self, cache):
        if cache.keys is None:
            raise InvalidRequest("cannot keep an empty KVCache (it holds no tokens)")
        n = cache.offset
        return {}, [_upto(cache.keys, n), _upto(cache.values, n)]

    def build(self, meta, arrays):
        c = self.mlx_class()()
        c.keys, c.values = arrays
        c.offset = c.keys.shape[2]
        return c


class _QuantizedKV(CacheKind):
    name, cache_class, token_axis = "qkv", "QuantizedKVCache", 2

    def capture(self, cache):
        n = cache.offset
        arrays = [] if cache.keys is None else [a[..., :n, :] for a in (*cache.keys, *cache.values)]
        meta = {"group_size": cache.group_size, "bits": cache.bits}
        if getattr(cache, "converted_at", None) is not None:
            meta["converted_at"] = int(cache.converted_at)
        return meta, arrays

    def build(self, meta, arrays):
        c = self.mlx_class()(group_size=meta["group_size"], bits=meta["bits"])
        if meta.get("converted_at") is not None:
            c.converted_at = int(meta["converted_at"])
        if arrays:
            c.keys, c.values = tuple(arrays[:3]), tuple(arrays[3:])
            c.offset = arrays[0].shape[2]
        return c


class _Rotating(CacheKind):
    name, cache_class = "rotating", "RotatingKVCache"

    def capture(self, cache):
        keys, values, offset, keep, max_size, idx = cache.state
        arrays = [] if keys is None else [keys, values]
        return {"offset": offset, "keep": keep, "max_size": max_size, "idx": idx}, arrays

    def build(self, meta, arrays):
        c = self.mlx_class()(max_size=meta["max_size"], keep=meta["keep"])
        keys, values = arrays if arrays else (None, None)
        c.state = (keys, values, meta["offset"], meta["keep"], meta["max_size"], meta["idx"])
        return c


class _Arrays(CacheKind):
    name, cache_class = "arrays", "ArraysCache"

    def capture(self, cache):
        present = [a is not None for a in cache.cache]
        return {"size": len(cache.cache), "present": present}, [a for a in cache.cache if a is not None]

    def build(self, meta, arrays):
        c = self.mlx_class()(meta["size"])
        it = iter(arrays)
        c.cache = [next(it) if p else None for p in meta["present"]]
        return c


#: the table: every kind spec-cache keeps (one entry per kind)
KINDS: tuple[CacheKind, ...] = (_KV(), _QuantizedKV(), _Rotating(), _Arrays())

_BY_NAME = {kind.name: kind for kind in KINDS}


def kind_named(name: str) -> CacheKind:
    """The kind a stored or held layer names, else ``UnknownLayerKind``."""
    kind = _BY_NAME.get(name)
    if kind is None:
        raise UnknownLayerKind(f"unknown stored layer kind {name!r} (known: {', '.join(_BY_NAME)})")
    return kind


@functools.cache
def _by_class() -> dict[type, CacheKind]:
    return {kind.mlx_class(): kind for kind in KINDS}


@functools.cache
def _kind_of_class(cls: type) -> CacheKind | None:
    table = _by_class()
    return next((table[c] for c in cls.__mro__ if c in table), None)


def kind_of(cache: Any) -> CacheKind:
    """The kind of a cache object (its class's nearest listed ancestor), else ``UnknownCacheType``."""
    kind = _kind_of_class(type(cache))
    if kind is None:
        known = ", ".join(k.cache_class for k in KINDS)
        raise UnknownCacheType(f"cache class {type(cache).__name__} is not a kind spec-cache can keep "
                               f"(known: {known})")
    return kind


def cache_types() -> tuple[type, ...]:
    """The mlx-lm cache classes the table lists (exactly these; subclasses map to them through ``kind_of``)."""
    return tuple(_by_class())
