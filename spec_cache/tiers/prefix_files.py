"""An uploaded mlx-lm prompt-cache file, read and checked whole against the model before anything is stored.

Why a module of its own: an import is the one place where outside bytes become state every later request of a
namespace restores. An entry that does not fit (a values head size, a token length, a ring buffer's parameters)
would fail the engine step of every row batched with it (issue 37), so each layer's kind, shapes, dtype, length and
cache parameters are checked here, and the token ids a file records are parsed strictly. ``cache_controls``
(``import_prefix``) and ``spec_cache.convert.interop`` (``import_mlx_lm``) both call it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np

from spec_cache.errors import InvalidRequest

__all__ = ["BadPrefixFile", "read_prefix_file", "token_ids", "check_fits", "is_array"]


class BadPrefixFile(InvalidRequest):
    """An uploaded prompt-cache file that is unreadable or does not fit the model or the tokens."""


def read_prefix_file(data: bytes):
    """``(caches, metadata)`` of an mlx-lm prompt-cache file given as bytes; ``BadPrefixFile`` if unreadable."""
    from mlx_lm.models.cache import load_prompt_cache

    with tempfile.TemporaryDirectory(prefix="spec-cache-import-") as tmp:
        path = os.path.join(tmp, "prefix.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        try:
            caches, metadata = load_prompt_cache(path, return_metadata=True)
        except Exception as exc:  # mlx raises plain RuntimeError/ValueError (and others) for unreadable files
            raise BadPrefixFile(f"not an mlx-lm prompt-cache file ({type(exc).__name__}: {_line(exc)})") from None
        except RecursionError:  # a deeply nested metadata tree (tree_unflatten recurses)
            raise BadPrefixFile("not an mlx-lm prompt-cache file (its metadata nests too deeply)") from None
    if not isinstance(metadata, dict):
        metadata = {}
    return list(caches), metadata


def _line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit`` characters (a file's text never floods a reply)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "…"


def token_ids(raw: Any, vocab_size: int | None, what: str = "the file's spec_cache_tokens metadata") -> list[int]:
    """Token ids a file records (a JSON list of ints, text or already parsed): each an int in ``0..vocab_size - 1``
    (no vocabulary: a non-negative 32-bit id). ``BadPrefixFile`` otherwise, a nested or unparsable list included:
    a file's ids decide which prefix every later request restores, so nothing is coerced (``int(3.7)`` is not 3)."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            raise BadPrefixFile(f"{what} is not a JSON list of token ids") from None
    if not isinstance(raw, list) or not raw or not all(_is_int(t) for t in raw):
        raise BadPrefixFile(f"{what} is not a non-empty list of token ids")
    top = (vocab_size if vocab_size is not None else 2**32) - 1
    if any(t < 0 or t > top for t in raw):
        raise BadPrefixFile(f"{what}: token ids must be in 0..{top}")
    return [int(t) for t in raw]


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_fits(target, caches, length: int, *, quantized: bool = False, plan: Any = None) -> None:
    """``BadPrefixFile`` unless ``caches`` are single-row caches of exactly ``length`` tokens this target continues
    from: one per layer, of the layer's kind (``TargetModel.check_restored``), and per K/V layer an integer offset
    equal to ``length``, keys and values ``(1, kv_heads, T, head_dim)`` / ``(..., value_dim)`` of the model's dtype
    with ``T`` the tokens the cache holds, a rotating layer's ``max_size``/``keep``/ring index as the model makes
    them, a quantized layer's bits and group size as the engine's KV plan (``plan``) has them."""
    if not isinstance(length, int) or length < 1:
        raise BadPrefixFile("the file must cover at least one token")
    for layer, c in enumerate(caches):
        offset = getattr(c, "offset", None)
        if hasattr(c, "keys") and (not _is_int(offset) or offset != length):  # None, inf, 2.5: never int() it
            raise BadPrefixFile(f"the file's layer {layer} holds {offset!r} tokens; {length} token ids were given")
    try:
        target.check_restored("the file", caches, length, quantized=quantized or plan is not None)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadPrefixFile(_line(exc)) from None
    for layer, c in enumerate(caches):
        _check_layer(target, layer, c, length, plan)


def _check_layer(target, layer: int, c, length: int, plan: Any) -> None:
    from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache

    where = f"the file's layer {layer}"
    if isinstance(c, ArraysCache):
        if not all(a is None or (is_array(a) and a.ndim >= 1 and a.shape[0] == 1) for a in c.cache):
            raise BadPrefixFile(f"{where}: recurrent state is not one row of arrays")
        return
    heads, head_dim = target.kv_geometry(layer)
    value_dim = _value_dim(target, layer, heads, head_dim)
    if isinstance(c, QuantizedKVCache):
        _check_quantized(where, c, layer, length, heads, head_dim, value_dim, plan)
        return
    low, high = length, None  # a KVCache's buffer: at least the offset (mlx-lm pads it to a multiple of 256)
    if isinstance(c, RotatingKVCache):
        low, high = _check_ring(target, where, c, layer, length)
    for name, a, dim in (("keys", c.keys, head_dim), ("values", c.values, value_dim)):
        if not is_array(a) or a.ndim != 4 or tuple(a.shape[:2]) != (1, heads) or a.shape[3] != dim or not (
                low <= a.shape[2] and (high is None or a.shape[2] <= high)):
            want = f">={low}" if high is None else f"{low}..{high}"
            raise BadPrefixFile(f"{where} {name} have shape {_shape(a)}; this model's are (1, {heads}, {want}, {dim})")
        if a.dtype != target.dtype:
            raise BadPrefixFile(f"{where} {name} are {a.dtype}; this model's are {target.dtype}")
    if c.keys.shape[2] != c.values.shape[2]:
        raise BadPrefixFile(f"{where}: keys hold {c.keys.shape[2]} positions, values {c.values.shape[2]}")


def _check_ring(target, where: str, c, layer: int, length: int) -> tuple[int, int]:
    """A rotating layer's parameters as the model makes them; the range of positions its buffer may hold."""
    window = target.layer_window(layer)
    keep, max_size, idx = getattr(c, "keep", None), getattr(c, "max_size", None), getattr(c, "_idx", None)
    if not (_is_int(keep) and _is_int(max_size) and _is_int(idx)) or keep != 0 or max_size != window:
        raise BadPrefixFile(f"{where}: rotating cache with max_size {max_size!r}, keep {keep!r}; this model's "
                            f"layer has max_size {window}, keep 0")
    low, high = min(length, window), max(length, window)
    keys = c.keys
    if not is_array(keys) or keys.ndim != 4 or not 0 <= idx <= keys.shape[2]:
        raise BadPrefixFile(f"{where}: rotating cache index {idx!r} outside its buffer of {_shape(keys)}")
    return low, high


def _check_quantized(where: str, c, layer: int, length: int, heads: int, head_dim: int, value_dim: int,
                     plan: Any) -> None:
    bits, group = getattr(c, "bits", None), getattr(c, "group_size", None)
    quant = plan.layers[layer] if plan is not None and layer < len(plan.layers) else None
    if plan is not None and (quant is None or (bits, group) != (quant.bits, quant.group_size)):
        want = "full precision" if quant is None else f"{quant.bits}-bit, group {quant.group_size}"
        raise BadPrefixFile(f"{where} is quantized ({bits!r}-bit, group {group!r}); this server's KV plan: {want}")
    if not (_is_int(bits) and _is_int(group)) or bits <= 0 or group <= 0 or head_dim % group or value_dim % group:
        raise BadPrefixFile(f"{where}: quantized with bits {bits!r} and group size {group!r}")
    for name, parts, dim in (("keys", c.keys, head_dim), ("values", c.values, value_dim)):
        want = (dim * bits // 32, dim // group, dim // group)
        if not isinstance(parts, (tuple, list)) or len(parts) != 3 or not all(
                is_array(a) and a.ndim == 4 and tuple(a.shape[:2]) == (1, heads) and a.shape[2] >= length
                and a.shape[3] == w for a, w in zip(parts, want)):
            raise BadPrefixFile(f"{where} quantized {name} do not have this model's shape (1, {heads}, >={length}, "
                                f"{want})")


def _value_dim(target, layer: int, heads: int, head_dim: int) -> int:
    """The head size of ``layer``'s values: its ``v_proj``'s width per KV head (models whose values are as wide as
    their keys, or share them, have none of their own)."""
    from spec_cache.rows.ports import out_features

    attention = getattr(target._layers[layer], "self_attn", None)
    v_proj = getattr(attention, "v_proj", None)
    if v_proj is None or not heads:
        return head_dim
    return out_features(v_proj) // heads


def is_array(a: Any) -> bool:
    """Whether ``a`` is an MLX array (a file's loader may leave other objects where arrays belong)."""
    import mlx.core as mx

    return isinstance(a, mx.array)


def _shape(a: Any) -> Any:
    return tuple(a.shape) if is_array(a) else type(a).__name__
