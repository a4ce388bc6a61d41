"""``deepspec-context-v1``, ``dflash-context-v1`` and ``dflash2-context-v1``: projected drafter context rows.

DeepSpec, DFlash/DSpark and DFlash 2 drafters project target hiddens into their own
per-layer K/V context (post-norm, post-RoPE). Every drafter layer covers the
same tokens, so each layer holds K and V of ``[1, kvHeads, processedTokens,
headDim]``; before any token, every layer header is null and there are no
tensors. mlx-bun never checked this alignment on restore; we do.
"""

from __future__ import annotations

from .attachment import CheckpointAttachment
from .cache_headers import check_every_tensor_referenced, decode_cache_headers
from .checks import expect_pair, expect_processed_tokens
from .names import CACHE_CODECS_V1, DEEPSPEC_CONTEXT_V1, DFLASH2_CONTEXT_V1, DFLASH_CONTEXT_V1
from .spec import AttachmentSchema, MetadataKey

__all__ = ["DEEPSPEC_CONTEXT", "DFLASH_CONTEXT", "DFLASH2_CONTEXT", "check_codecs"]

ALIGNMENT = "invalid projected context checkpoint alignment"


def check_codecs(schema: AttachmentSchema, attachment: CheckpointAttachment) -> None:
    """``metadata.cacheCodecs`` must name the codec this library writes."""
    codecs = attachment.metadata["cacheCodecs"]
    if codecs != CACHE_CODECS_V1:
        raise schema.error(
            "metadata.cacheCodecs", f"companion cache codec mismatch: got {codecs!r}, expected {CACHE_CODECS_V1!r}"
        )


def _check(schema: AttachmentSchema, attachment: CheckpointAttachment, processed_tokens: int) -> None:
    expect_processed_tokens(schema, attachment.metadata, processed_tokens, ALIGNMENT)
    check_codecs(schema, attachment)
    tensors = attachment.tensors
    headers = decode_cache_headers(
        schema, attachment.metadata["cacheHeaders"], len(tensors), kinds=("kv",), allow_extra=False
    )
    for layer, header in enumerate(headers):
        field = f"metadata.cacheHeaders[{layer}]"
        if header is None:
            if processed_tokens:
                raise schema.error(
                    field, f"{ALIGNMENT}: layer has no context rows but processedTokens={processed_tokens}"
                )
            continue
        if processed_tokens == 0:
            raise schema.error(field, f"{ALIGNMENT}: must be null when processedTokens=0")
        if header.offset != processed_tokens:
            raise schema.error(
                f"{field}.offset", f"{ALIGNMENT}: layer offset {header.offset}, processedTokens={processed_tokens}"
            )
        if len(header.tensors) != 2:
            raise schema.error(f"{field}.tensors", f"expected 2 indices [k, v], got {list(header.tensors)}")
        expect_pair(schema, tensors, header.tensors[0], header.tensors[1], processed_tokens, prefix=f"{ALIGNMENT}: ")
    check_every_tensor_referenced(schema, headers, len(tensors))


def _projected(name: str, producer: str) -> AttachmentSchema:
    return AttachmentSchema(
        name=name,
        description="projected per-layer K/V context rows of a block drafter",
        producer=producer,
        metadata_spec={
            "processedTokens": MetadataKey((int,), "tokens every drafter layer covers"),
            "cacheCodecs": MetadataKey((str,), f"cache codec id, must be {CACHE_CODECS_V1!r}"),
            "cacheHeaders": MetadataKey(
                (str,),
                'JSON array, one entry per drafter layer: {"kind":"kv","offset":N,"tensors":[k,v]} '
                "(indices into tensors), or null while processedTokens is 0",
            ),
        },
        tensors_doc=(
            "per drafter layer K then V, each [1, kvHeads, processedTokens, headDim], same shape and float dtype "
            "within a layer; no tensors when processedTokens is 0"
        ),
        alignment_doc=(
            "metadata.processedTokens == checkpoint.processed_tokens == every layer's offset == K/V axis 2; "
            "every tensor referenced by exactly one header"
        ),
        check=_check,
    )


DEEPSPEC_CONTEXT = _projected(DEEPSPEC_CONTEXT_V1, "DeepSpec projected drafter (Gemma 4 target taps)")
DFLASH_CONTEXT = _projected(DFLASH_CONTEXT_V1, "DFlash / DSpark projected drafter (Gemma 4 target taps)")
DFLASH2_CONTEXT = _projected(DFLASH2_CONTEXT_V1,
                             "DFlash 2 projected block drafter (config.json; projections quantized at load)")
