"""The two checkpoint types every part of spec-cache passes around.

A drafter owns its schema and its alignment rule; storage owns the immutable
tensor snapshots. These types only make sure the envelope is well formed (flat
scalar metadata, a tuple of tensor-like objects, a non-negative token count);
whether the contents fit the named schema is :mod:`schemas.registry`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import SchemaError

__all__ = ["CheckpointAttachment", "DraftRowCheckpoint", "FrozenMetadata", "MetadataValue"]

MetadataValue = str | int | float | bool

# Metadata ints must fit a signed 64-bit slot in the stored record.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


class FrozenMetadata(dict):
    """A read-only ``dict`` of flat metadata scalars.

    Still a real ``dict`` (so ``json.dumps``, msgpack and ``==`` work), but it
    cannot be changed after the attachment that holds it is built.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("checkpoint metadata is read-only; build a new CheckpointAttachment")

    __setitem__ = __delitem__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenMetadata({dict.__repr__(self)})"


def _metadata_value(schema: str, key: str, value: Any) -> MetadataValue:
    """Plain builtin copy of one metadata value, or SchemaError."""
    field = f"metadata.{key}"
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise SchemaError(schema, field, f"int {value} does not fit in 64 bits")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaError(schema, field, f"float must be finite, got {value!r}")
        return float(value)
    if isinstance(value, str):
        return str(value)
    raise SchemaError(
        schema, field,
        f"metadata values must be flat scalars (str, int, float, bool), got {type(value).__name__}; "
        "store nested data as a JSON string",
    )


def _freeze_metadata(schema: str, metadata: Any) -> FrozenMetadata:
    if not isinstance(metadata, Mapping):
        raise SchemaError(schema, "metadata", f"expected a mapping, got {type(metadata).__name__}")
    plain: dict[str, MetadataValue] = {}
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise SchemaError(schema, "metadata", f"keys must be str, got {type(key).__name__} {key!r}")
        plain[str(key)] = _metadata_value(schema, key, value)
    return FrozenMetadata(plain)


def _freeze_tensors(schema: str, tensors: Any) -> tuple:
    # Only lists and tuples: iterating an array would silently split it into rows.
    if not isinstance(tensors, (list, tuple)):
        raise SchemaError(schema, "tensors", f"expected a list or tuple of tensors, got {type(tensors).__name__}")
    for index, tensor in enumerate(tensors):
        for attribute in ("shape", "dtype"):
            try:
                present = hasattr(tensor, attribute)
            except Exception:
                present = False
            if not present:
                raise SchemaError(
                    schema, f"tensors[{index}]",
                    f"expected a tensor-like object with .shape and .dtype, got {type(tensor).__name__}",
                )
    return tuple(tensors)


@dataclass(frozen=True)
class CheckpointAttachment:
    """A drafter's state at an exact prefix boundary.

    schema: stored schema name, e.g. ``"gemma-assistant-v1"``; never changes
        meaning once written (a new layout gets a new ``-vN`` name).
    metadata: flat scalars only (str, finite float, 64-bit int, bool); nested
        data such as cache headers is a JSON string. Stored read-only.
    tensors: tensor-like objects with ``.dtype`` and ``.shape`` (``mx.array``,
        ``store.Tensor``, numpy arrays); a list is converted to a tuple.

    Raises SchemaError when the envelope is malformed. It does not check the
    schema's own rules; call :func:`schemas.validate_attachment` for that.
    """

    schema: str
    metadata: Mapping[str, MetadataValue]
    tensors: tuple

    def __post_init__(self) -> None:
        if not isinstance(self.schema, str) or not self.schema:
            raise SchemaError(None, "schema", f"expected a non-empty str, got {self.schema!r}")
        object.__setattr__(self, "schema", str(self.schema))
        object.__setattr__(self, "metadata", _freeze_metadata(self.schema, self.metadata))
        object.__setattr__(self, "tensors", _freeze_tensors(self.schema, self.tensors))


@dataclass(frozen=True)
class DraftRowCheckpoint:
    """One speculative row's drafter state after ``processed_tokens`` tokens.

    Raises SchemaError when processed_tokens is not a non-negative int (bool is
    refused) or attachment is not a CheckpointAttachment.
    """

    processed_tokens: int
    attachment: CheckpointAttachment

    def __post_init__(self) -> None:
        schema = self.attachment.schema if isinstance(self.attachment, CheckpointAttachment) else None
        count = self.processed_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise SchemaError(schema, "processed_tokens", f"expected a non-negative int, got {count!r}")
        if count > _INT_MAX:
            raise SchemaError(schema, "processed_tokens", f"int {count} does not fit in 64 bits")
        if not isinstance(self.attachment, CheckpointAttachment):
            raise SchemaError(
                None, "attachment", f"expected a CheckpointAttachment, got {type(self.attachment).__name__}"
            )
        object.__setattr__(self, "processed_tokens", int(count))
