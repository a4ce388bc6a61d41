"""Typed errors for checkpoint validation.

Every refusal names the schema and the field that was wrong, so a caller (or a
person reading a log line) can tell which producer broke its contract without a
traceback from deep inside a validator.
"""

from __future__ import annotations

__all__ = ["SchemaError", "UnknownSchemaError"]


class SchemaError(ValueError):
    """A checkpoint or attachment does not match its schema.

    Attributes:
        schema: the attachment schema name being checked (``None`` when the
            problem is not tied to a schema, e.g. an unknown dtype).
        field: dotted path of the wrong field, e.g. ``"tensors[0].shape"``,
            ``"metadata.processedTokens"``, ``"metadata.cacheHeaders[2].offset"``.
        reason: the explanation without the schema/field prefix.
    """

    def __init__(self, schema: str | None, field: str, reason: str) -> None:
        self.schema = schema
        self.field = field
        self.reason = reason
        prefix = f"{schema}: {field}" if schema is not None else field
        super().__init__(f"{prefix}: {reason}")

    def __reduce__(self):
        return (type(self), (self.schema, self.field, self.reason))


class UnknownSchemaError(SchemaError):
    """The attachment names a schema this library does not know."""

    def __init__(self, schema: str, known: tuple[str, ...] | list[str] = ()) -> None:
        self.known = tuple(known)
        reason = f"unknown attachment schema {schema!r}; known: {', '.join(self.known) or '(none)'}"
        super().__init__(schema, "schema", reason)
        # The message is the reason itself: it already names the schema.
        self.args = (reason,)

    def __str__(self) -> str:
        return self.reason

    def __reduce__(self):
        return (type(self), (self.schema, self.known))
