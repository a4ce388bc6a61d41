"""What a schema is: a name, its metadata keys, its documentation and a check.

Schemas are data (one :class:`AttachmentSchema` value per stored name), not a
class hierarchy; the per-family rules live in a plain function each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from .attachment import CheckpointAttachment
from .errors import SchemaError

__all__ = ["MetadataKey", "AttachmentSchema"]


@dataclass(frozen=True)
class MetadataKey:
    """One required metadata key: its accepted types and what it means.

    ``types`` lists builtin types; ``int`` never accepts ``bool`` unless
    ``bool`` is listed too.
    """

    types: tuple[type, ...]
    doc: str

    @property
    def type_names(self) -> str:
        return " | ".join(t.__name__ for t in self.types)

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool):
            return bool in self.types
        return isinstance(value, self.types)


@dataclass(frozen=True)
class AttachmentSchema:
    """The contract of one stored attachment schema.

    ``check(schema, attachment, processed_tokens)`` holds the family rules; it
    runs after the envelope and metadata keys have been checked, so it may read
    every key in ``metadata_spec`` with its declared type.
    """

    name: str
    description: str
    producer: str
    metadata_spec: Mapping[str, MetadataKey]
    tensors_doc: str
    alignment_doc: str
    check: Callable[["AttachmentSchema", CheckpointAttachment, int], None] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata_spec", MappingProxyType(dict(self.metadata_spec)))

    @property
    def doc(self) -> str:
        """Human-readable description: producer, tensors, metadata, alignment."""
        lines = [
            f"{self.name}: {self.description}",
            f"  producer:  {self.producer}",
            f"  tensors:   {self.tensors_doc}",
        ]
        lines.append("  metadata:")
        for key, spec in self.metadata_spec.items():
            lines.append(f"    {key} ({spec.type_names}): {spec.doc}")
        lines.append(f"  alignment: {self.alignment_doc}")
        return "\n".join(lines)

    def error(self, field: str, reason: str) -> SchemaError:
        """A SchemaError for this schema (validators ``raise schema.error(...)``)."""
        return SchemaError(self.name, field, reason)

    def validate(self, attachment: CheckpointAttachment, processed_tokens: int) -> None:
        """Check ``attachment`` against this schema for a row of ``processed_tokens``.

        Returns None; raises SchemaError naming the wrong field (schema name,
        token count, metadata keys and types, then the family's tensor and
        alignment rules).
        """
        if not isinstance(attachment, CheckpointAttachment):
            raise self.error("attachment", f"expected a CheckpointAttachment, got {type(attachment).__name__}")
        if attachment.schema != self.name:
            raise self.error("schema", f"attachment has schema {attachment.schema!r}, expected {self.name!r}")
        if isinstance(processed_tokens, bool) or not isinstance(processed_tokens, int) or processed_tokens < 0:
            raise self.error("processed_tokens", f"expected a non-negative int, got {processed_tokens!r}")
        self._check_metadata_keys(attachment.metadata)
        self.check(self, attachment, processed_tokens)

    def _check_metadata_keys(self, metadata: Mapping[str, Any]) -> None:
        for key, spec in self.metadata_spec.items():
            if key not in metadata:
                raise self.error(f"metadata.{key}", f"missing required key ({spec.type_names})")
            value = metadata[key]
            if not spec.accepts(value):
                raise self.error(
                    f"metadata.{key}", f"expected {spec.type_names}, got {type(value).__name__} {value!r}"
                )
        extra = sorted((key for key in metadata if key not in self.metadata_spec), key=str)
        if extra:
            raise self.error(
                f"metadata.{extra[0]}", f"unexpected key; allowed: {', '.join(self.metadata_spec)}"
            )
