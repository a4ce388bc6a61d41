"""The registry of stored attachment schemas and the validation entry points.

Every checkpoint passes :func:`validate_checkpoint` before it is stored or
restored, so a producer that breaks its layout is refused at the boundary with
a SchemaError naming the field, not discovered later as a shape error.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .assistant import GEMMA_ASSISTANT
from .attachment import CheckpointAttachment, DraftRowCheckpoint
from .errors import SchemaError, UnknownSchemaError
from .glm_mtp import GLM52_NATIVE_MTP
from .ngram import NGRAM_HISTORY
from .projected import DEEPSPEC_CONTEXT, DFLASH2_CONTEXT, DFLASH_CONTEXT
from .qwen_mtp import QWEN_MTP
from .spec import AttachmentSchema
from .standalone import STANDALONE_DRAFT

__all__ = ["SCHEMAS", "get_schema", "validate_checkpoint", "validate_attachment", "describe_schemas"]

#: Stored schema name -> its contract. Names never change; new layouts get new names.
SCHEMAS: Mapping[str, AttachmentSchema] = MappingProxyType({
    schema.name: schema
    for schema in (GEMMA_ASSISTANT, DEEPSPEC_CONTEXT, DFLASH_CONTEXT, DFLASH2_CONTEXT, QWEN_MTP, GLM52_NATIVE_MTP,
                   STANDALONE_DRAFT, NGRAM_HISTORY)
})


def get_schema(name: str) -> AttachmentSchema:
    """The schema registered as ``name``; raises UnknownSchemaError otherwise."""
    schema = SCHEMAS.get(name) if isinstance(name, str) else None
    if schema is None:
        raise UnknownSchemaError(name, tuple(SCHEMAS))
    return schema


def validate_attachment(attachment: CheckpointAttachment, processed_tokens: int) -> None:
    """Check ``attachment`` against its own schema for a row of ``processed_tokens``.

    Raises UnknownSchemaError for an unregistered schema, SchemaError for any
    other mismatch. Cost: metadata and shapes only; tensor data is never read.
    """
    if not isinstance(attachment, CheckpointAttachment):
        raise SchemaError(None, "attachment", f"expected a CheckpointAttachment, got {type(attachment).__name__}")
    get_schema(attachment.schema).validate(attachment, processed_tokens)


def validate_checkpoint(cp: DraftRowCheckpoint, expect_schema: str | None = None) -> None:
    """Check a drafter row checkpoint, optionally requiring a given schema.

    ``expect_schema`` is the schema the caller's drafter reads (e.g. a restore
    into an assistant drafter passes ``"gemma-assistant-v1"``); a checkpoint of
    another schema is refused with field ``"schema"``.
    Raises UnknownSchemaError (unregistered schema, also for ``expect_schema``)
    or SchemaError.
    """
    if not isinstance(cp, DraftRowCheckpoint):
        raise SchemaError(None, "checkpoint", f"expected a DraftRowCheckpoint, got {type(cp).__name__}")
    if expect_schema is not None:
        get_schema(expect_schema)
        if cp.attachment.schema != expect_schema:
            raise SchemaError(
                cp.attachment.schema, "schema",
                f"checkpoint has schema {cp.attachment.schema!r}, expected {expect_schema!r}",
            )
    validate_attachment(cp.attachment, cp.processed_tokens)


def describe_schemas() -> str:
    """Human-readable documentation of every registered schema."""
    return "\n\n".join(schema.doc for schema in SCHEMAS.values())
