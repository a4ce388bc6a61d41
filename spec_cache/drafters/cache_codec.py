"""The drafter-side cache codec ``spec-cache-kv-v1``: single-row mlx-lm caches <-> one checkpoint attachment.

Each layer is one header in ``metadata.cacheHeaders`` (``schemas.cache_headers``) naming its kind, offset and
the indices of its tensors in ``attachment.tensors``; an empty layer is ``null``. Kinds (mlx-bun's codecs round
trip the same set on the drafter side):

* ``kv`` (``KVCache``): K then V, each ``[1, kvHeads, offset, headDim]``, sliced to the offset;
* ``qkv`` (``QuantizedKVCache``): K's (packed uint32 words, scales, biases) then V's, token axis 2 sliced to the
  offset; scalars ``groupSize``, ``bits`` and, for a cache that records where it was converted
  (``converted_at``), ``minimumReusableOffset``;
* ``arrays`` (``ArraysCache``, recurrent/SSM state): the present arrays whole, ``present`` a string of ``0``/``1``
  flags per slot; ``offset`` 0 (a recurrent state has no token axis: it is an exact-boundary snapshot whose
  coverage is the checkpoint's ``processedTokens``; never trimmed).

Restored caches hold the attachment's arrays bit for bit (``restore_kv_caches``). Which kinds a drafter accepts
is its schema's and provider's rule (projected contexts and Qwen MTP: ``kv`` only).

mlx-bun (the seed) writes the same tensors under its codec id ``mlx-cache-v3`` with slot objects instead of index
lists; ``spec_cache.convert.seed_codec.from_seed_attachment`` rewrites such an attachment into this codec (``kv`` and
``qkv`` layers; the kinds it refuses and why are listed there) and ``read_mlxkv`` reads them out of the seed's
``.mlxkv`` files. This codec itself refuses ``mlx-cache-v3`` (as the seed refuses ours): conversion is explicit.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from spec_cache.errors import RestoreRefused
from spec_cache.rows.protocol import to_mx
from spec_cache.schemas import CACHE_CODECS_V1, CheckpointAttachment, encode_cache_headers

__all__ = ["capture_kv_attachment", "restore_kv_caches", "CODEC_KINDS"]

#: the layer kinds this codec writes and reads
CODEC_KINDS = ("kv", "qkv", "arrays")


def _layer(cache: Any, first: int) -> tuple[dict | None, list[mx.array]]:
    """One layer's header (tensor indices from ``first``) and tensors; ``(None, [])`` for an empty layer."""
    if isinstance(cache, QuantizedKVCache):
        offset = int(cache.offset)
        if offset == 0 or cache.keys is None:
            return None, []
        tensors = [part[..., :offset, :] for part in (*cache.keys, *cache.values)]
        header = {"kind": "qkv", "offset": offset, "tensors": list(range(first, first + 6)),
                  "groupSize": int(cache.group_size), "bits": int(cache.bits)}
        if getattr(cache, "converted_at", None) is not None:
            header["minimumReusableOffset"] = int(cache.converted_at)
        return header, tensors
    if type(cache) is KVCache:
        offset = int(cache.offset)
        if offset == 0:
            return None, []
        return ({"kind": "kv", "offset": offset, "tensors": [first, first + 1]},
                [cache.keys[..., :offset, :], cache.values[..., :offset, :]])
    if isinstance(cache, ArraysCache):
        present = [array is not None for array in cache.cache]
        if not any(present):
            return None, []
        tensors = [array for array in cache.cache if array is not None]
        return ({"kind": "arrays", "offset": 0, "tensors": list(range(first, first + len(tensors))),
                 "present": "".join("1" if p else "0" for p in present)}, tensors)
    raise NotImplementedError(f"cache codec {CACHE_CODECS_V1} writes {', '.join(CODEC_KINDS)} layers "
                              f"(KVCache, QuantizedKVCache, ArraysCache), got {type(cache).__name__}")


def capture_kv_attachment(schema: str, caches: Sequence[Any], metadata: dict) -> CheckpointAttachment:
    """An attachment of ``schema`` holding ``caches`` (one per layer) through the ``spec-cache-kv-v1`` codec,
    with ``metadata`` plus ``cacheCodecs``/``cacheHeaders``. Tensors are evaluated views of the caches' arrays."""
    tensors: list[mx.array] = []
    headers: list[dict | None] = []
    for cache in caches:
        header, arrays = _layer(cache, len(tensors))
        headers.append(header)
        tensors += arrays
    mx.eval(tensors)
    full = dict(metadata, cacheCodecs=CACHE_CODECS_V1, cacheHeaders=encode_cache_headers(headers))
    return CheckpointAttachment(schema, full, tuple(tensors))


def restore_kv_caches(attachment: CheckpointAttachment) -> list[Any]:
    """The mlx-lm caches of a validated ``spec-cache-kv-v1`` attachment (a null header: an empty ``KVCache``)."""
    caches: list[Any] = []
    for header in json.loads(attachment.metadata["cacheHeaders"]):
        if header is None:
            caches.append(KVCache())
            continue
        arrays = [to_mx(attachment.tensors[index]) for index in header["tensors"]]
        kind = header["kind"]
        if kind == "kv":
            cache = KVCache()
            cache.keys, cache.values = arrays
            cache.offset = int(header["offset"])
        elif kind == "qkv":
            cache = QuantizedKVCache(group_size=int(header["groupSize"]), bits=int(header["bits"]))
            cache.keys, cache.values = tuple(arrays[:3]), tuple(arrays[3:])
            cache.offset = int(header["offset"])
            if "minimumReusableOffset" in header:
                cache.converted_at = int(header["minimumReusableOffset"])
        elif kind == "arrays":
            present = header["present"]
            cache = ArraysCache(len(present))
            slots = iter(arrays)
            cache.cache = [next(slots) if flag == "1" else None for flag in present]
        else:
            raise RestoreRefused(f"cache codec {CACHE_CODECS_V1} cannot restore a {kind!r} layer")
        caches.append(cache)
    return caches
