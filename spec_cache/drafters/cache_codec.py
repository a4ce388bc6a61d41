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

Which cache class is which kind, and how each is written and read back, is the table of cache kinds'
(``spec_cache.state.cache_kinds``: ``encode`` / ``decode`` of the kinds with ``codec`` set); this module assembles
the headers. Restored caches hold the attachment's arrays bit for bit (``restore_kv_caches``). Which kinds a
drafter accepts is its schema's and provider's rule (projected contexts and Qwen MTP: ``kv`` only).

mlx-bun (the seed) writes the same tensors under its codec id ``mlx-cache-v3`` with slot objects instead of index
lists; ``spec_cache.convert.seed_codec.from_seed_attachment`` rewrites such an attachment into this codec (``kv`` and
``qkv`` layers; the kinds it refuses and why are listed there) and ``read_mlxkv`` reads them out of the seed's
``.mlxkv`` files. This codec itself refuses ``mlx-cache-v3`` (as the seed refuses ours): conversion is explicit.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import mlx.core as mx

from spec_cache.errors import RestoreRefused
from spec_cache.rows.protocol import to_mx
from spec_cache.schemas import CACHE_CODECS_V1, CheckpointAttachment, encode_cache_headers
from spec_cache.state.cache_kinds import CacheKindError, kind_named, kind_of, kinds

__all__ = ["capture_kv_attachment", "restore_kv_caches", "CODEC_KINDS", "codec_kinds"]


def codec_kinds() -> tuple[str, ...]:
    """The layer kinds this codec writes and reads: the table's kinds with ``codec`` set."""
    return tuple(kind.name for kind in kinds() if kind.codec)


#: the layer kinds this codec writes and reads (as the table had them at import)
CODEC_KINDS = codec_kinds()


def _layer(cache: Any, first: int) -> tuple[dict | None, list[mx.array]]:
    """One layer's header (tensor indices from ``first``) and tensors; ``(None, [])`` for an empty layer."""
    try:
        kind = kind_of(cache)
    except CacheKindError:
        kind = None
    if kind is None or not kind.codec:
        names = [k for k in kinds() if k.codec]
        raise NotImplementedError(f"cache codec {CACHE_CODECS_V1} writes {', '.join(k.name for k in names)} layers "
                                  f"({', '.join(k.cache_class for k in names)}), got {type(cache).__name__}")
    encoded = kind.encode(cache)
    if encoded is None:
        return None, []
    offset, fields, tensors = encoded
    return {"kind": kind.name, "offset": offset, "tensors": list(range(first, first + len(tensors))), **fields}, tensors


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
            caches.append(kind_named("kv").fresh())
            continue
        arrays = [to_mx(attachment.tensors[index]) for index in header["tensors"]]
        kind = header["kind"]
        try:
            entry = kind_named(kind)
        except CacheKindError:
            entry = None
        if entry is None or not entry.codec:
            raise RestoreRefused(f"cache codec {CACHE_CODECS_V1} cannot restore a {kind!r} layer")
        caches.append(entry.decode(header, arrays))
    return caches
