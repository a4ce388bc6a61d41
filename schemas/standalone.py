"""``standalone-draft-v1``: the caches of a separate (two-model) draft model.

A standalone draft model keeps ordinary per-layer caches. Each layer is stored
through the ``spec-cache-kv-v1`` codec: a header names its kind, offset, the
indices of its tensors and kind-specific scalars (e.g. ``groupSize``/``bits``
for ``qkv``, ``maxSize``/``idx`` for ``rotating``); null is an empty layer.
"""

from __future__ import annotations

from .attachment import CheckpointAttachment
from .cache_headers import check_every_tensor_referenced, decode_cache_headers
from .checks import expect_pair, expect_processed_tokens
from .names import CACHE_CODECS_V1, STANDALONE_DRAFT_V1
from .projected import check_codecs
from .spec import AttachmentSchema, MetadataKey

__all__ = ["STANDALONE_DRAFT", "CACHE_KINDS"]

ALIGNMENT = "invalid standalone draft checkpoint alignment"

#: Layer kinds the ``spec-cache-kv-v1`` codec writes.
CACHE_KINDS = ("kv", "qkv", "rotating", "arrays")


def _check(schema: AttachmentSchema, attachment: CheckpointAttachment, processed_tokens: int) -> None:
    metadata = attachment.metadata
    expect_processed_tokens(schema, metadata, processed_tokens, ALIGNMENT)
    pending = metadata["pendingLast"]
    if pending is True or (not isinstance(pending, bool) and pending < 0):
        raise schema.error("metadata.pendingLast", f"expected a token id >= 0 or false, got {pending!r}")
    check_codecs(schema, attachment)
    tensors = attachment.tensors
    headers = decode_cache_headers(schema, metadata["cacheHeaders"], len(tensors), kinds=CACHE_KINDS, allow_extra=True)
    for header in headers:
        if header is None:
            continue
        field = f"metadata.cacheHeaders[{header.layer}]"
        if header.offset > processed_tokens:
            raise schema.error(
                f"{field}.offset", f"{ALIGNMENT}: layer offset {header.offset} > processedTokens={processed_tokens}"
            )
        if not header.tensors:
            raise schema.error(f"{field}.tensors", "a non-null layer needs at least one tensor (use null when empty)")
        if header.kind == "kv":
            if header.offset < 1:
                raise schema.error(f"{field}.offset", "a kv layer with offset 0 must be null")
            if len(header.tensors) != 2:
                raise schema.error(f"{field}.tensors", f"expected 2 indices [k, v], got {list(header.tensors)}")
            expect_pair(schema, tensors, header.tensors[0], header.tensors[1], header.offset)
    check_every_tensor_referenced(schema, headers, len(tensors))


STANDALONE_DRAFT = AttachmentSchema(
    name=STANDALONE_DRAFT_V1,
    description="per-layer caches of a standalone (two-model) draft model",
    producer="standalone draft model (two-model speculative decoding)",
    metadata_spec={
        "processedTokens": MetadataKey((int,), "tokens the row has processed"),
        "pendingLast": MetadataKey((int, bool), "last token not yet fed to the draft model (token id), or false"),
        "cacheCodecs": MetadataKey((str,), f"cache codec id, must be {CACHE_CODECS_V1!r}"),
        "cacheHeaders": MetadataKey(
            (str,),
            'JSON array, one entry per draft layer: {"kind":"kv"|"qkv"|"rotating"|"arrays","offset":N,'
            '"tensors":[indices],...kind-specific scalars}, or null for an empty layer',
        ),
    },
    tensors_doc=(
        "the layers' tensors, addressed by header indices; a kv layer is K then V, each [1, kvHeads, offset, headDim], "
        "same shape and float dtype; other kinds are checked for index coverage only"
    ),
    alignment_doc=(
        "metadata.processedTokens == checkpoint.processed_tokens; every layer offset <= processedTokens; "
        "kv axis 2 == offset; every tensor referenced by exactly one header"
    ),
    check=_check,
)
