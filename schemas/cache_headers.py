"""Per-layer cache headers stored as JSON inside ``metadata.cacheHeaders``.

Projected-context and standalone-draft attachments keep one header per drafter
layer: ``{"kind": ..., "offset": N, "tensors": [i, j, ...], ...scalars}`` where
``tensors`` are indices into ``attachment.tensors``, or ``null`` for a layer that
holds nothing yet. Metadata is flat, so the list travels as a JSON string; this
module writes it canonically and reads it back with field-precise errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Collection, Mapping, Sequence

from .spec import AttachmentSchema

__all__ = ["CacheHeader", "encode_cache_headers", "decode_cache_headers", "check_every_tensor_referenced"]

_REQUIRED = ("kind", "offset", "tensors")
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class CacheHeader:
    """One decoded layer header. ``extra`` holds the kind-specific scalars."""

    layer: int
    kind: str
    offset: int
    tensors: tuple[int, ...]
    extra: Mapping[str, Any]


def encode_cache_headers(headers: Sequence[Mapping[str, Any] | None]) -> str:
    """Canonical JSON for ``metadata.cacheHeaders`` (sorted keys, no spaces).

    Producers should use this so equal states give byte-equal metadata.
    Raises ValueError for non-finite floats, TypeError for non-JSON values.
    """
    return json.dumps(list(headers), separators=(",", ":"), sort_keys=True, allow_nan=False)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_cache_headers(
    schema: AttachmentSchema,
    text: str,
    tensor_count: int,
    kinds: Collection[str],
    allow_extra: bool,
) -> list[CacheHeader | None]:
    """Parse and check ``metadata.cacheHeaders`` for an attachment of ``tensor_count`` tensors.

    Checks: valid JSON array with at least one entry; each entry null or an
    object with a known ``kind``, an int ``offset >= 0`` and a list of tensor
    indices in range, none used twice; extra keys only when ``allow_extra``
    and only scalars. Whether every tensor is used is
    :func:`check_every_tensor_referenced`'s job.
    Raises SchemaError (fields ``metadata.cacheHeaders[...]`` or ``tensors[i]``).
    """
    base = "metadata.cacheHeaders"
    try:
        decoded = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        raise schema.error(base, f"not valid JSON ({error})") from None
    if not isinstance(decoded, list):
        raise schema.error(base, f"expected a JSON array of layer headers, got {type(decoded).__name__}")
    if not decoded:
        raise schema.error(base, "expected at least one layer header")

    owner: dict[int, int] = {}
    headers: list[CacheHeader | None] = []
    for layer, entry in enumerate(decoded):
        field = f"{base}[{layer}]"
        if entry is None:
            headers.append(None)
            continue
        if not isinstance(entry, dict):
            raise schema.error(field, f"expected an object or null, got {type(entry).__name__}")
        for key in _REQUIRED:
            if key not in entry:
                raise schema.error(f"{field}.{key}", "missing required key")
        kind, offset, indices = entry["kind"], entry["offset"], entry["tensors"]
        if not isinstance(kind, str) or kind not in kinds:
            raise schema.error(f"{field}.kind", f"expected one of {', '.join(sorted(kinds))}, got {kind!r}")
        if not _is_int(offset) or offset < 0:
            raise schema.error(f"{field}.offset", f"expected a non-negative int, got {offset!r}")
        if not isinstance(indices, list) or not all(_is_int(i) for i in indices):
            raise schema.error(f"{field}.tensors", f"expected a list of tensor indices, got {indices!r}")
        for index in indices:
            if not 0 <= index < tensor_count:
                raise schema.error(f"{field}.tensors", f"index {index} out of range for {tensor_count} tensor(s)")
            if index in owner:
                raise schema.error(f"{field}.tensors", f"tensor index {index} already used by layer {owner[index]}")
            owner[index] = layer
        extra = {key: value for key, value in entry.items() if key not in _REQUIRED}
        for key in sorted(extra):
            if not allow_extra:
                raise schema.error(f"{field}.{key}", f"unexpected key; allowed: {', '.join(_REQUIRED)}")
            if not isinstance(extra[key], _SCALARS):
                kind_name = type(extra[key]).__name__
                raise schema.error(f"{field}.{key}", f"kind-specific values must be scalars, got {kind_name}")
        headers.append(CacheHeader(layer, kind, offset, tuple(indices), MappingProxyType(extra)))
    return headers


def check_every_tensor_referenced(
    schema: AttachmentSchema, headers: Sequence[CacheHeader | None], tensor_count: int
) -> None:
    """Every tensor must belong to some layer header (call after the per-layer checks,
    so a missing layer is reported as that layer rather than as its orphaned tensors)."""
    owned = {index for header in headers if header is not None for index in header.tensors}
    for index in range(tensor_count):
        if index not in owned:
            raise schema.error(f"tensors[{index}]", "not referenced by any cache header")
