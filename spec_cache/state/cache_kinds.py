"""One table of the mlx-lm cache kinds spec-cache keeps: the only place that checks a cache's class.

Why one file: it is the table; the kinds' operations call each other through ``kind_of`` (a merge looks up the
batch kind), and the claim that no other module checks a cache class holds only while they live together.

Every operation on a cache layer looks its kind up here (``kind_of(cache)`` for a cache object, ``kind_named(name)``
for a stored or held layer) and asks the kind; no other module tests a cache class
(``tests/library/test_cache_kind_table.py`` holds them to it, naming the few left in other rooms and why). The
protocol follows mlx-lm's ``state`` / ``from_state``, split the way each route needs it:

* **one row** (the store: ``cache_state.layer_state`` / ``from_layer_state``; the memory tier: ``_hold`` /
  ``_rebuild``): ``capture(cache) -> (meta, arrays)``, the arrays covering exactly the cache's offset (never the
  256-step padded buffer) and the scalars a rebuild needs (``meta`` is what the store writes: its keys, their
  order and the kind ``name`` are a public format, golden vectors in tests/golden, never to be changed);
  ``build(meta, arrays) -> cache``; ``tokens(cache)`` (its offset; None for a state with no token count);
  ``arrays(cache)`` (what ``mx.eval`` materializes); ``fresh(template)`` (an empty cache of the kind).
* **cut** (one rule per kind): ``cut(cache, tokens, held, window)`` is a new cache holding the first ``tokens`` of
  a row that holds ``held``, or None when this kind cannot serve that prefix (``row_caches.prefix_caches`` applies it
  to every layer of a row). ``prefix(arrays, length, held)`` is its array-level step (``token_axis``: slices; else
  exactly the held length), which the memory tier calls on held arrays after its own conversion-point check
  (``minimum_reusable``: the ``qkv`` rule, recorded per entry). ``token_axis`` is 2 when every array is
  ``[1, heads, tokens, ...]`` (trimmable: the store may share chunks of it), None when kept whole.
* **rows of a batch** (``spec_cache.rows``): every kind names the kind whose batch cache its rows join (``batch``:
  ``rotating`` rows join ``kv``'s ``BatchKVCache`` as their last window of keys); a batch kind makes, merges,
  splits, clones and joins its batch cache (``empty_batch``, ``merge``, ``split``, ``clone_batch``, ``join_batch``,
  ``batch_arrays``, ``start_round``, ``donor_kv``; the mechanics are ``spec_cache.state.batch_caches``').
* **drafter codec** (``spec-cache-kv-v1``, ``spec_cache.drafters.cache_codec``): ``encode(cache)`` /
  ``decode(header, arrays)`` for the kinds with ``codec = True``.

An operation a kind does not support raises ``KindCannot`` (named: the kind and the operation).

Kinds: ``KVCache`` -> ``kv`` (keys, values); ``QuantizedKVCache`` -> ``qkv`` (packed words, scales, biases of K
then V; group_size, bits and ``converted_at`` where the runtime recorded its conversion point: part of the layer
signature, so states converted at different offsets never share chunks); ``RotatingKVCache`` -> ``rotating`` (the
ring buffer whole, with offset/keep/max_size/idx); ``ArraysCache`` -> ``arrays`` (recurrent arrays whole, which
slots are present). A subclass of a listed class is that kind (its nearest listed ancestor).

**Adding a kind** is one ``CacheKind`` subclass and one entry in ``KINDS`` (or ``register(kind)`` at run time),
plus its tests (``tests/library/test_cache_kinds.py``'s ``SAMPLES``; ``test_cache_kind_table.py`` registers a toy
kind and runs it through every route).

mlx-lm is imported on first use, so importing this module (and the memory tier) does not import MLX.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Sequence

from spec_cache.errors import InvalidRequest, RestoreRefused, SpecCacheError, UnsupportedCombination

__all__ = ["CacheKind", "CacheKindError", "KINDS", "KindCannot", "UnknownCacheType", "UnknownLayerKind",
           "batch_kind_of", "cache_types", "kind_named", "kind_of", "kinds", "register", "unregister"]


class CacheKindError(SpecCacheError):
    """A cache layer whose kind this table does not know, or that its kind cannot handle."""


class UnknownCacheType(CacheKindError, UnsupportedCombination, TypeError):
    """A cache object of a class no kind covers (e.g. ``ChunkedKVCache``): this model's caches cannot be stored
    or held. Also a ``TypeError``, what callers caught before the table existed."""


class UnknownLayerKind(CacheKindError, RestoreRefused):
    """A stored or held layer whose kind name no kind carries (a newer writer's kind, or damage): run it cold."""


class KindCannot(CacheKindError, UnsupportedCombination, NotImplementedError):
    """An operation the layer's kind does not support (e.g. batching a kind with no batch cache, the drafter
    codec for ``rotating``). Also a ``NotImplementedError`` (what the codec raised before) and a ``ValueError``."""


class CacheKind:
    """One cache kind: the mlx-lm class it covers, the name stored records carry, and every operation on it."""

    name: ClassVar[str]              # LayerState.kind in stored records (and the codec's header kind)
    cache_class: ClassVar[str]       # the class's name in mlx_lm.models.cache (else override ``mlx_class``)
    token_axis: ClassVar[int | None] = None  # 2: token-sliceable (trimmable); None: kept whole, exact length
    holds_kv: ClassVar[bool] = True  # attention keys/values (a drafter may read them); False: recurrent state
    batch: ClassVar[str | None] = None  # the kind whose batch cache rows of this kind join; None: no batched rows
    codec: ClassVar[bool] = False    # the drafter codec spec-cache-kv-v1 writes it
    quantized: ClassVar[bool] = False  # K/V converted at a recorded point (``converted_at``): the KV plan's rows
    rows_noun: ClassVar[str] = ""    # a batch kind's rows in messages: "full-precision", "quantized", "recurrent"

    @property
    def trimmable(self) -> bool:
        return self.token_axis is not None

    def mlx_class(self) -> type:
        from mlx_lm.models import cache as mlx_cache

        return getattr(mlx_cache, self.cache_class)

    def _cannot(self, what: str) -> KindCannot:
        return KindCannot(f"the {self.name} cache kind ({self.cache_class}) does not support {what}")

    # -- one row --------------------------------------------------------------------------------------------------
    def capture(self, cache: Any) -> tuple[dict, list]:
        """``(meta, arrays)`` of one single-row cache, covering exactly its offset."""
        raise self._cannot("capture")

    def build(self, meta: dict, arrays: Sequence[Any]) -> Any:
        """A new cache object over ``arrays`` (as ``capture`` returned them, or a prefix of them when trimmable)."""
        raise self._cannot("build")

    def tokens(self, cache: Any) -> int | None:
        """The tokens a single-row cache holds (its offset); None for a state that carries no count."""
        return int(cache.offset)

    def arrays(self, cache: Any) -> list:
        """The arrays a single-row cache holds (what ``mx.eval`` materializes); [] for an empty one."""
        return [] if cache.keys is None else [cache.keys, cache.values]

    def fresh(self, template: Any = None) -> Any:
        """A new empty cache of this kind (``template``: a cache of the same layer, for the kind's scalars)."""
        return self.mlx_class()()

    def complete(self, cache: Any) -> bool:
        """Whether a restored cache holds all it should (a recurrent state: every array); a count-carrying kind's
        length is checked against ``tokens`` instead."""
        return True

    def serves(self, layer_batch: CacheKind, window: int | None, quantized: bool) -> bool:
        """Whether a restored cache of this kind can continue a layer whose batch kind is ``layer_batch``
        (``window``: the layer's sliding window; ``quantized``: the runtime runs a KV quantization plan)."""
        return self.batch == layer_batch.name

    # -- cut: one rule --------------------------------------------------------------------------------------------
    def prefix(self, arrays: Sequence[Any], length: int, held: int) -> list:
        """New array objects over the first ``length`` of ``held`` tokens (slices: views, never copies)."""
        if self.token_axis is None:
            if length != held:
                raise ValueError(f"a {self.name} layer is exact-length ({held} tokens), asked for {length}")
            return [a[...] for a in arrays]
        return [a[..., :length, :] for a in arrays]

    def cut(self, cache: Any, tokens: int, held: int, window: int | None = None) -> Any | None:
        """A new cache holding the first ``tokens`` of ``cache`` (a row holding ``held``; ``cache`` is only read),
        or None when this kind cannot serve that prefix. Trimmable kinds slice exactly; the others serve only
        their own length."""
        if self.token_axis is None:
            return self.build(*self.capture(cache)) if tokens == held else None
        if not tokens:
            return self.fresh(cache)
        meta, arrays = self.capture(cache)
        return self.build(meta, self.prefix(arrays, tokens, int(cache.offset)))

    # -- rows of a batch: the single-row side ---------------------------------------------------------------------
    def content(self, cache: Any, window: int | None, where: str) -> Any:
        """What a batched row needs from one restored single-row cache (the batch kind's ``merge`` takes it);
        None for an empty cache. RestoreRefused when this cache cannot join the layer (``where`` names it)."""
        raise self._cannot("batched rows")

    def from_content(self, content: Any, position: int, window: int | None, where: str) -> Any:
        """A single-row cache of this kind from a batched row's content (``split``): the row's state exactly."""
        raise self._cannot("batched rows")

    # -- rows of a batch: the batch cache (kinds with ``batch == name``) ------------------------------------------
    def empty_batch(self, template: Any, rows: int) -> Any:
        """An empty batch cache of ``rows`` rows for a layer whose single-row cache looks like ``template``."""
        raise self._cannot("batched rows")

    def merge(self, caches: Sequence[Any | None], positions: Sequence[int], template: Any, window: int | None,
              layer: int) -> Any:
        """One layer's batch cache from per-row single-row caches (None: an empty row), each row at its
        position. Each cache's own kind gives its content; a cache of a kind that joins another batch is
        RestoreRefused."""
        contents = []
        for row, cache in enumerate(caches):
            if cache is None:
                contents.append(None)
                continue
            where = f"row {row} layer {layer}"
            kind = kind_of(cache)
            if kind.batch != self.name:
                raise RestoreRefused(f"{where}: {type(cache).__name__} layers cannot join batched {self.rows_noun} "
                                     "rows")
            contents.append(kind.content(cache, window, where))
        return self._merge(contents, positions, template)

    def _merge(self, contents: Sequence[Any], positions: Sequence[int], template: Any) -> Any:
        raise self._cannot("batched rows")

    def split(self, batch: Any, row: int, position: int, window: int | None, *, ring: bool = True,
              where: str = "") -> Any:
        """Row ``row`` (holding ``position`` tokens) of a batch cache as an owned single-row cache; ``ring``: a
        sliding layer's row as the kind a sliding layer keeps (``rotating``), else its whole history."""
        raise self._cannot("batched rows")

    def clone_batch(self, batch: Any) -> Any:
        """A batch cache with its own array objects (``update_and_fetch`` and ``+=`` write in place)."""
        raise self._cannot("batched rows")

    def join_batch(self, first: Any, first_rows: int, second: Any, second_rows: int) -> Any:
        """``first``'s rows then ``second``'s in a new batch cache built from copies (neither is changed)."""
        joined = self.clone_batch(first)
        joined.extend(self.clone_batch(second))
        return joined

    def batch_arrays(self, batch: Any) -> list:
        """The arrays a batch cache holds (what ``mx.eval`` materializes)."""
        raise self._cannot("batched rows")

    def start_round(self, batch: Any, lengths: Sequence[int], padding: Sequence[int]) -> None:
        """Before a forward that appends ``lengths[row]`` tokens to each row (``padding[row]`` = the longest less
        that: right padding the row discards at ``finalize()``)."""
        batch.prepare(right_padding=padding)

    def donor_kv(self, batch: Any) -> tuple:
        """Full-precision keys and values of the filled positions of a K/V batch cache."""
        raise self._cannot("donor keys and values")

    # -- drafter codec --------------------------------------------------------------------------------------------
    def encode(self, cache: Any) -> tuple[int, dict, list] | None:
        """``(offset, header fields, tensors)`` of one layer for the drafter codec; None for an empty layer."""
        raise self._cannot("the drafter cache codec")

    def decode(self, header: dict, arrays: Sequence[Any]) -> Any:
        """The cache a codec header (``kind``, ``offset``, the fields ``encode`` wrote) and its arrays describe."""
        raise self._cannot("the drafter cache codec")


def _upto(a: Any, n: int) -> Any:
    """``a`` cut to ``n`` tokens on axis 2 (``a`` itself when it holds exactly ``n``)."""
    return a if a.shape[2] == n else a[..., :n, :]


def _mech():
    """The batch mechanics (``spec_cache.state.batch_caches``: imports MLX, so only on first use)."""
    from spec_cache.state import batch_caches

    return batch_caches


class _KV(CacheKind):
    name, cache_class, token_axis, batch, codec = "kv", "KVCache", 2, "kv", True
    rows_noun = "full-precision"

    def capture(self, cache):
        if cache.keys is None:
            raise InvalidRequest("cannot keep an empty KVCache (it holds no tokens)")
        n = cache.offset
        return {}, [_upto(cache.keys, n), _upto(cache.values, n)]

    def build(self, meta, arrays):
        c = self.mlx_class()()
        if arrays:
            c.keys, c.values = arrays
            c.offset = c.keys.shape[2]
        return c

    # rows: one BatchKVCache per layer, rows right-aligned behind left padding
    def content(self, cache, window, where):
        if cache.keys is None or cache.offset == 0:
            return None
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]

    def from_content(self, content, position, window, where):
        import mlx.core as mx

        keys, values = content
        if keys.shape[2] != position:
            raise ValueError(f"{where} holds {keys.shape[2]} of its {position} tokens")
        single = self.fresh()
        single.keys, single.values = mx.contiguous(keys), mx.contiguous(values)
        single.offset = position
        return single

    def empty_batch(self, template, rows):
        from mlx_lm.models.cache import BatchKVCache

        return BatchKVCache([0] * rows)

    def _merge(self, contents, positions, template):
        return _mech().merge_rows(contents, positions)

    def split(self, batch, row, position, window, *, ring=True, where=""):
        if window is None and batch._right_padding is None:
            # a full-attention row holds its last ``position`` keys up to ``_idx``: read off host-side counts, since
            # ``left_padding[row].item()`` waits for the queued round on a GPU (130 ms a checkpoint in issue 35's
            # H100 trace, on the scheduler thread)
            left = batch._idx - position
        else:
            left = int(batch.left_padding[row].item())
        keys = batch.keys[row : row + 1, :, left : batch._idx]
        values = batch.values[row : row + 1, :, left : batch._idx]
        into = _BY_NAME["rotating"] if window is not None and ring else self
        return into.from_content((keys, values), position, window, where or f"row {row}")

    def clone_batch(self, batch):
        return _mech().clone_batch_cache(batch)

    def batch_arrays(self, batch):
        arrays = [batch.offset, batch.left_padding]
        if batch.keys is not None:
            arrays += [batch.keys, batch.values]
        return arrays

    def donor_kv(self, batch):
        return batch.keys_and_values()

    # codec: K then V, each [1, kvHeads, offset, headDim]
    def encode(self, cache):
        offset = int(cache.offset)
        if offset == 0:
            return None
        return offset, {}, [cache.keys[..., :offset, :], cache.values[..., :offset, :]]

    def decode(self, header, arrays):
        cache = self.fresh()
        cache.keys, cache.values = arrays
        cache.offset = int(header["offset"])
        return cache


class _QuantizedKV(CacheKind):
    name, cache_class, token_axis, batch, codec, quantized = "qkv", "QuantizedKVCache", 2, "qkv", True, True
    rows_noun = "quantized"

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

    def arrays(self, cache):
        return [] if cache.keys is None else [*cache.keys, *cache.values]

    def serves(self, layer_batch, window, quantized):
        return quantized and window is None and layer_batch.name == _KV.name  # a full layer, converted

    def fresh(self, template=None):
        return self.mlx_class()(group_size=template.group_size, bits=template.bits)

    def cut(self, cache, tokens, held, window=None):
        """No prefix below the conversion point (a cold run holds full precision there), none at all when the
        cache does not record it."""
        point = getattr(cache, "converted_at", None)
        if point is None or tokens < point:
            return None
        meta, arrays = self.capture(cache)
        return self.build(meta, self.prefix(arrays, tokens, held) if tokens else [])

    # rows: one spec_cache BatchQuantizedKVCache per layer (mlx-lm has no batched quantized cache)
    def content(self, cache, window, where):
        return cache  # BatchQuantizedKVCache.merge checks bits and group size against the batch's

    def empty_batch(self, template, rows):
        return _mech().BatchQuantizedKVCache([0] * rows, group_size=template.group_size, bits=template.bits)

    def _merge(self, contents, positions, template):
        return _mech().BatchQuantizedKVCache.merge(contents, group_size=template.group_size, bits=template.bits)

    def split(self, batch, row, position, window, *, ring=True, where=""):
        return batch.extract(row)

    def clone_batch(self, batch):
        return batch.clone()

    def batch_arrays(self, batch):
        return batch.arrays()

    def donor_kv(self, batch):
        return batch.dequantized()

    # codec: K's (packed uint32 words, scales, biases) then V's, token axis 2 sliced to the offset
    def encode(self, cache):
        offset = int(cache.offset)
        if offset == 0 or cache.keys is None:
            return None
        fields = {"groupSize": int(cache.group_size), "bits": int(cache.bits)}
        if getattr(cache, "converted_at", None) is not None:
            fields["minimumReusableOffset"] = int(cache.converted_at)
        return offset, fields, [part[..., :offset, :] for part in (*cache.keys, *cache.values)]

    def decode(self, header, arrays):
        cache = self.mlx_class()(group_size=int(header["groupSize"]), bits=int(header["bits"]))
        cache.keys, cache.values = tuple(arrays[:3]), tuple(arrays[3:])
        cache.offset = int(header["offset"])
        if "minimumReusableOffset" in header:
            cache.converted_at = int(header["minimumReusableOffset"])
        return cache


class _Rotating(CacheKind):
    name, cache_class, batch = "rotating", "RotatingKVCache", "kv"

    def capture(self, cache):
        keys, values, offset, keep, max_size, idx = cache.state
        arrays = [] if keys is None else [keys, values]
        return {"offset": offset, "keep": keep, "max_size": max_size, "idx": idx}, arrays

    def build(self, meta, arrays):
        c = self.mlx_class()(max_size=meta["max_size"], keep=meta["keep"])
        keys, values = arrays if arrays else (None, None)
        c.state = (keys, values, meta["offset"], meta["keep"], meta["max_size"], meta["idx"])
        return c

    def fresh(self, template=None):
        return self.mlx_class()(max_size=template.max_size, keep=template.keep)

    def serves(self, layer_batch, window, quantized):
        return window is not None and super().serves(layer_batch, window, quantized)

    def cut(self, cache, tokens, held, window=None):
        """A ring snapshot loses its oldest key with every token it is cut by, so it serves ``tokens`` only while
        the keys it keeps still cover that position's window."""
        if cache.keys is None:
            return self.fresh(cache)
        size = window or cache.max_size
        keys, values = _mech().temporal(cache)
        kept_before = min(held, size)
        keys, values = keys[..., keys.shape[2] - kept_before :, :], values[..., values.shape[2] - kept_before :, :]
        kept = kept_before - (held - tokens)
        if kept < min(tokens, size - 1):
            return None
        keys, values = keys[..., :kept, :], values[..., :kept, :]
        snapshot = self.mlx_class()(max_size=cache.max_size, keep=0)
        if kept:
            snapshot.state = (keys, values, tokens, 0, cache.max_size, kept)
        return snapshot

    # rows: a sliding layer's row joins kv's BatchKVCache as its last window of keys (a window mask reads them)
    def content(self, cache, window, where):
        if window is None:
            raise RestoreRefused(f"{where}: a rotating cache for a full-attention layer")
        if cache.keep != 0 or cache.max_size != window:
            raise RestoreRefused(f"{where}: rotating cache (max_size {cache.max_size}, keep {cache.keep}) does not "
                                 f"match the layer's window {window}")
        if cache.keys is None or cache.offset == 0:
            return None
        keys, values = _mech().temporal(cache)
        held = min(int(cache.offset), window)
        return keys[..., -held:, :], values[..., -held:, :]

    def from_content(self, content, position, window, where):
        return _mech().rotating_snapshot(*content, position, window)


class _Arrays(CacheKind):
    name, cache_class, batch, holds_kv, codec = "arrays", "ArraysCache", "arrays", False, True
    rows_noun = "recurrent"

    def capture(self, cache):
        present = [a is not None for a in cache.cache]
        return {"size": len(cache.cache), "present": present}, [a for a in cache.cache if a is not None]

    def build(self, meta, arrays):
        c = self.mlx_class()(meta["size"])
        it = iter(arrays)
        c.cache = [next(it) if p else None for p in meta["present"]]
        return c

    def tokens(self, cache):
        return None  # a recurrent state carries no count: the row's K/V layers tell its length

    def arrays(self, cache):
        return [a for a in cache.cache if a is not None]

    def fresh(self, template=None):
        return self.mlx_class()(len(template.cache))

    def complete(self, cache):
        return all(a is not None for a in cache.cache)

    # rows: a batched ArraysCache per layer (rollback by replay: rows.target.HybridTargetRows)
    def content(self, cache, window, where):
        present = [a is not None for a in cache.cache]
        if not any(present):
            return None
        if not all(present):
            raise RestoreRefused(f"{where}: a recurrent state with some of its arrays missing: {present}")
        if any(a.shape[0] != 1 for a in cache.cache):
            raise RestoreRefused(f"{where}: a restored recurrent state must hold one row, "
                                 f"got {[a.shape for a in cache.cache]}")
        return list(cache.cache)

    def empty_batch(self, template, rows):
        return self.fresh(template)

    def _merge(self, contents, positions, template):
        return _mech().merge_states(contents, len(template.cache))

    def split(self, batch, row, position, window, *, ring=True, where=""):
        return _mech().split_state(batch, row)

    def clone_batch(self, batch):
        return _mech().clone_states(batch)

    def join_batch(self, first, first_rows, second, second_rows):
        return _mech().join_states(first, first_rows, second, second_rows)

    def batch_arrays(self, batch):
        return [a for a in batch.cache if a is not None]

    def start_round(self, batch, lengths, padding):
        batch.prepare(lengths=lengths)  # the recurrent state stops at each row's last token

    # codec: the present arrays whole, ``present`` a string of 0/1 flags; offset 0 (no token axis)
    def encode(self, cache):
        present = [array is not None for array in cache.cache]
        if not any(present):
            return None
        return 0, {"present": "".join("1" if p else "0" for p in present)}, [a for a in cache.cache if a is not None]

    def decode(self, header, arrays):
        present = header["present"]
        cache = self.mlx_class()(len(present))
        slots = iter(arrays)
        cache.cache = [next(slots) if flag == "1" else None for flag in present]
        return cache


#: the table: every kind spec-cache keeps (one entry per kind)
KINDS: tuple[CacheKind, ...] = (_KV(), _QuantizedKV(), _Rotating(), _Arrays())

_BY_NAME = {kind.name: kind for kind in KINDS}


def register(kind: CacheKind) -> CacheKind:
    """Add ``kind`` to the table (a kind defined outside this module, e.g. for a cache class of a newer mlx-lm or
    a test's toy kind); ValueError when its name or class is taken. Returns it."""
    global KINDS
    if kind.name in _BY_NAME or any(k.cache_class == kind.cache_class for k in KINDS):
        raise ValueError(f"the table already has a kind named {kind.name!r} or covering {kind.cache_class}")
    KINDS = (*KINDS, kind)
    _BY_NAME[kind.name] = kind
    _forget()
    return kind


def unregister(name: str) -> None:
    """Take the kind ``name`` out of the table again (what ``register`` added)."""
    global KINDS
    KINDS = tuple(k for k in KINDS if k.name != name)
    _BY_NAME.pop(name, None)
    _forget()


def _forget() -> None:
    _by_class.cache_clear()
    _kind_of_class.cache_clear()


def kinds() -> tuple[CacheKind, ...]:
    """The table now (``KINDS`` with what ``register`` added: read it through here, not a copy made at import)."""
    return KINDS


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


def batch_kind_of(cache: Any) -> CacheKind:
    """The kind whose batch cache holds the rows of a layer whose single-row cache is ``cache`` (e.g. a model's
    ``make_cache()``); ``KindCannot`` for a kind with no batched rows."""
    kind = kind_of(cache)
    if kind.batch is None:
        raise kind._cannot("batched rows")
    return kind_named(kind.batch)


def cache_types() -> tuple[type, ...]:
    """The mlx-lm cache classes the table lists (exactly these; subclasses map to them through ``kind_of``)."""
    return tuple(_by_class())
