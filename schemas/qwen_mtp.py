"""``qwen-mtp-v1``: a Qwen multi-token-prediction head's KV and pending hidden.

The MTP head lags the target by one token: after ``processed_tokens`` tokens its
own KV cache covers ``draftOffset = processed_tokens - 1`` of them, and the
pre-final-norm hidden of the last one waits to be fed.
"""

from __future__ import annotations

from .attachment import CheckpointAttachment
from .checks import expect_count, expect_hidden, expect_pair
from .names import QWEN_MTP_V1
from .spec import AttachmentSchema, MetadataKey

__all__ = ["QWEN_MTP"]

ALIGNMENT = "invalid paired Qwen MTP checkpoint alignment"


def _check(schema: AttachmentSchema, attachment: CheckpointAttachment, processed_tokens: int) -> None:
    draft_offset = attachment.metadata["draftOffset"]
    if draft_offset < 0:
        raise schema.error("metadata.draftOffset", f"{ALIGNMENT}: draftOffset must be >= 0, got {draft_offset}")
    if draft_offset != processed_tokens - 1:
        raise schema.error(
            "metadata.draftOffset",
            f"{ALIGNMENT}: draftOffset={draft_offset}, expected processed_tokens - 1 = {processed_tokens - 1}",
        )
    tensors = attachment.tensors
    if draft_offset > 0:
        expect_count(schema, tensors, 3, "[k, v, hidden]", prefix=f"{ALIGNMENT}: draftOffset={draft_offset} needs ")
        expect_pair(schema, tensors, 0, 1, draft_offset, prefix=f"{ALIGNMENT}: ")
        hidden = 2
    else:
        expect_count(schema, tensors, 1, "[hidden]", prefix=f"{ALIGNMENT}: draftOffset=0 needs ")
        hidden = 0
    expect_hidden(schema, tensors, hidden)


QWEN_MTP = AttachmentSchema(
    name=QWEN_MTP_V1,
    description="Qwen MTP head KV rows plus the pending pre-final-norm hidden",
    producer="Qwen multi-token-prediction (MTP) head paired with its target",
    metadata_spec={"draftOffset": MetadataKey((int,), "tokens in the MTP head's own KV cache")},
    tensors_doc=(
        "[k, v, hidden] when draftOffset > 0, k and v [1, kvHeads, draftOffset, headDim] (same shape and float "
        "dtype); [hidden] when draftOffset == 0; hidden [1, 1, hiddenSize], float"
    ),
    alignment_doc="metadata.draftOffset == checkpoint.processed_tokens - 1 (so processed_tokens >= 1)",
    check=_check,
)
