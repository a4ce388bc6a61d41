"""KV quantization as the runtime executes it: which layers convert, when, and how.

mlx-lm does not choose a quantized cache up front; it *converts*: after every prefill chunk and after every
decode step, ``maybe_quantize_kv_cache`` replaces each ``KVCache`` whose offset has reached
``quantized_kv_start`` with ``cache.to_quantized(group_size, bits)``. Every token forwarded after that point
attends to (and is stored as) affine-quantized K/V; every token before it was computed in full precision.
The output therefore depends on *where* the conversion happened, and this module pins that point down:

* :meth:`KVPlan.conversion_point` is the offset at which mlx-lm's ``generate_step`` converts a cold run of a
  prompt of ``n`` tokens with ``prefill_step_size`` ``step``: the first of its check points (the prefill chunk
  ends ``step, 2*step, ... < n - 1``, then ``n - 1``, ``n``, ``n + 1``, ...) that is ``>= start``. The runtime
  converts each row exactly there, whatever it restored and however it chunks, so speculative decoding and
  resumed rows reproduce ``generate_step(kv_bits=..., quantized_kv_start=...)``.
* A stored quantized state records that point (``QuantizedKVCache.converted_at``, stored in the layer
  metadata and as the entry's minimum reusable offset): it is reusable only by a request that converts at the
  same point (:func:`reusable`), and never below it.

Per-layer ``kv_config`` (mlx-bun's extension; mlx-lm has none) converts only the listed layers, each with its
own bits and group size, at one shared point; unlisted layers stay full precision. ``turbo_quant`` is part of
the namespace contract, but no TurboQuant codec exists here: asking to execute it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from spec_cache.errors import InvalidRequest, RestoreRefused, UnsupportedCombination
from spec_cache.state.cache_kinds import kind_of

__all__ = [
    "DEFAULT_QUANTIZED_KV_START",
    "LayerQuant",
    "KVPlan",
    "plan_kv",
    "converted_at",
    "reusable",
    "TURBO_QUANT_REFUSED",
]

#: mlx-lm's default ``quantized_kv_start`` for uniform ``kv_bits`` (``generate.DEFAULT_QUANTIZED_KV_START``);
#: a per-layer ``kv_config`` converts from 0 by default (mlx-bun's ``affineQuantizedKvStart``).
DEFAULT_QUANTIZED_KV_START = 5000
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
TURBO_QUANT_REFUSED = (
    "turbo_quant is part of the namespace contract, but spec-cache has no TurboQuant codec yet; "
    "executing it is refused (use kv_bits / kv_config for affine KV quantization)"
)


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's KV is quantized once converted."""

    bits: int
    group_size: int


@dataclass(frozen=True)
class KVPlan:
    """Resolved KV quantization: per layer a :class:`LayerQuant` (or None: stays full precision) and the
    ``start`` offset (mlx-lm's ``quantized_kv_start``)."""

    layers: tuple[LayerQuant | None, ...]
    start: int

    def quantizes(self, layer: int) -> bool:
        return self.layers[layer] is not None

    def conversion_point(self, prompt_tokens: int, step: int) -> int:
        """The offset at which ``generate_step(prompt, prefill_step_size=step)`` converts (see module doc)."""
        if prompt_tokens < 1 or step < 1:
            raise ValueError(f"need prompt_tokens >= 1 and step >= 1, got {prompt_tokens} and {step}")
        last_chunk_end = prompt_tokens - 1
        if self.start >= last_chunk_end:
            return max(self.start, 1)  # every offset from n - 1 on is a check point (none before the first forward)
        first = -(-max(self.start, 1) // step) * step  # the first chunk end k * step >= start, k >= 1
        return min(first, last_chunk_end)

    def convert(self, caches: Sequence[Any], at: int) -> list:
        """``caches`` (single-row ``KVCache`` per layer, all at offset ``at``) with the planned layers converted
        exactly as mlx-lm does (``KVCache.to_quantized``); each converted cache records ``converted_at``."""
        converted = []
        for layer, (cache, quant) in enumerate(zip(caches, self.layers)):
            if quant is None:
                converted.append(cache)
                continue
            if int(cache.offset) != at:
                raise ValueError(f"layer {layer} holds {cache.offset} tokens; conversion happens at {at}")
            quantized = cache.to_quantized(group_size=quant.group_size, bits=quant.bits)
            quantized.converted_at = at
            converted.append(quantized)
        return converted


def plan_kv(options: Any, num_layers: int, head_dims: Sequence[int], windows: Sequence[int | None] = ()) -> KVPlan | None:
    """The :class:`KVPlan` of captured ``KVOptions`` for a model, or None when nothing is quantized.

    ``head_dims[layer]`` is the K/V head size of each layer, ``windows[layer]`` its sliding window (None: full
    attention). Raises NotImplementedError for ``turbo_quant`` and for a target with sliding-window layers
    (mlx-lm's ``RotatingKVCache`` cannot be quantized either), ValueError for unsupported bits, group sizes,
    layer indices or a head size the group size does not divide.
    """
    if options is None:
        return None
    if getattr(options, "turbo_quant", None) is not None:
        raise NotImplementedError(TURBO_QUANT_REFUSED)
    from spec_cache.naming.namespace import check_runnable

    options = check_runnable(options)  # a layer named twice, group size 0, ... refused here too (engine built directly)
    kv_bits = getattr(options, "kv_bits", None)
    group_default = getattr(options, "kv_group_size", None) or 64
    start = getattr(options, "quantized_kv_start", None)
    entries = tuple(getattr(options, "kv_config", ()) or ())
    layers: list[LayerQuant | None] = [None] * num_layers
    if entries:
        for entry in entries:
            if entry.layer_idx >= num_layers:
                raise UnsupportedCombination(f"kv_config lists layer {entry.layer_idx}; the target has {num_layers} layers")
            bits = entry.bits if entry.bits is not None else kv_bits
            if bits is None:
                raise InvalidRequest(f"kv_config layer {entry.layer_idx} has no bits and no kv_bits is set")
            group = entry.group_size if entry.group_size is not None else group_default
            layers[entry.layer_idx] = LayerQuant(bits, group)
        start = 0 if start is None else start
    elif kv_bits is not None:
        layers = [LayerQuant(kv_bits, group_default)] * num_layers
        start = DEFAULT_QUANTIZED_KV_START if start is None else start
    else:
        return None
    windows = list(windows) or [None] * num_layers
    if any(window is not None for window in windows):
        raise NotImplementedError(
            "KV quantization of a target with sliding-window layers is not supported: mlx-lm's RotatingKVCache "
            "cannot be quantized ('RotatingKVCache Quantization NYI', generate_step raises too) and quantized rows "
            "roll back with the caches' own trim, which a wrapped ring cannot do")
    for layer, quant in enumerate(layers):
        if quant is None:
            continue
        where = f"layer {layer}"
        if quant.bits not in SUPPORTED_BITS:
            raise UnsupportedCombination(f"{where}: {quant.bits}-bit KV is not supported (supported: {SUPPORTED_BITS})")
        if quant.group_size not in SUPPORTED_GROUP_SIZES:
            raise UnsupportedCombination(f"{where}: KV group size {quant.group_size} is not supported "
                                         f"(supported: {SUPPORTED_GROUP_SIZES})")
        if head_dims[layer] % quant.group_size:
            raise UnsupportedCombination(f"{where}: head size {head_dims[layer]} is not a multiple of the KV group size "
                                         f"{quant.group_size}")
    return KVPlan(tuple(layers), start)


def converted_at(caches: Sequence[Any]) -> int | None:
    """The offset at which ``caches`` were converted, None when no layer is quantized.

    Raises ValueError when quantized layers disagree or one does not record its conversion point (a
    ``QuantizedKVCache`` that did not come from this runtime or the store cannot be checked).
    """
    points = set()
    for layer, cache in enumerate(caches):
        if kind_of(cache).quantized:
            point = getattr(cache, "converted_at", None)
            if point is None:
                raise RestoreRefused(f"quantized layer {layer} does not record where it was converted")
            points.add(int(point))
    if len(points) > 1:
        raise RestoreRefused(f"quantized layers were converted at different offsets: {sorted(points)}")
    return points.pop() if points else None


def reusable(length: int, conversion: int | None, wanted: int) -> bool:
    """Whether a stored state of ``length`` tokens, converted at ``conversion`` (None: full precision), equals
    what a cold run that converts at ``wanted`` holds after ``length`` tokens."""
    if conversion is None:
        return length <= wanted
    return conversion == wanted and length >= conversion
