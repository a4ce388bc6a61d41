"""``ngram-history-v1``: the token history an n-gram drafter looks up in."""

from __future__ import annotations

from .attachment import CheckpointAttachment
from .checks import dtype_of, expect_count, expect_rank
from .names import NGRAM_HISTORY_V1
from .spec import AttachmentSchema, MetadataKey

__all__ = ["NGRAM_HISTORY"]

MISMATCH = "ngram checkpoint does not match its token coverage or lookup policy"


def _check(schema: AttachmentSchema, attachment: CheckpointAttachment, processed_tokens: int) -> None:
    low, high = attachment.metadata["min"], attachment.metadata["max"]
    if low < 1:
        raise schema.error("metadata.min", f"{MISMATCH}: min must be >= 1, got {low}")
    if high < low:
        raise schema.error("metadata.max", f"{MISMATCH}: max must be >= min ({low}), got {high}")
    tensors = attachment.tensors
    expect_count(schema, tensors, 1, "[history]", prefix=f"{MISMATCH}: ")
    shape = expect_rank(schema, tensors, 0, 1, "[processedTokens]", prefix=f"{MISMATCH}: ")
    dtype = dtype_of(schema, tensors, 0)
    if dtype != "int32":
        raise schema.error("tensors[0].dtype", f"{MISMATCH}: history must be int32, got {dtype}")
    if shape[0] != processed_tokens:
        raise schema.error(
            "tensors[0].shape",
            f"{MISMATCH}: history holds {shape[0]} tokens, checkpoint processed_tokens={processed_tokens}",
        )


NGRAM_HISTORY = AttachmentSchema(
    name=NGRAM_HISTORY_V1,
    description="int32 token history of an n-gram (prompt lookup) drafter row",
    producer="n-gram drafter",
    metadata_spec={
        "max": MetadataKey((int,), "longest n-gram the lookup tries (>= min)"),
        "min": MetadataKey((int,), "shortest n-gram the lookup tries (>= 1)"),
    },
    tensors_doc="[history] with shape [processedTokens], int32",
    alignment_doc="tensors[0].shape[0] == checkpoint.processed_tokens; 1 <= min <= max",
    check=_check,
)
