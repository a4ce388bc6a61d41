"""``glm52-native-mtp-v1``: a GLM native multi-token-prediction head's MLA cache and pending hidden.

GLM's MTP layer is part of the target checkpoint and attends through an MLA cache (a compressed KV latent
plus a separate RoPE key). Unlike Qwen MTP, its history starts empty when a row starts speculating, so
``draftOffset`` (the MLA cache length) is independent of ``processedTokens``; only ``processedTokens`` is
aligned with the checkpoint. A cold row's hidden is zero-filled in float32 (as in mlx-bun).
"""

from __future__ import annotations

from .attachment import CheckpointAttachment
from .checks import expect_count, expect_float, expect_hidden, expect_processed_tokens, expect_rank
from .names import GLM52_NATIVE_MTP_V1
from .spec import AttachmentSchema, MetadataKey

__all__ = ["GLM52_NATIVE_MTP", "ALIGNMENT"]

ALIGNMENT = "invalid native GLM MTP checkpoint alignment"


def _check_mla_part(schema: AttachmentSchema, attachment: CheckpointAttachment, index: int, what: str,
                    draft_offset: int) -> str:
    shape = expect_rank(schema, attachment.tensors, index, 4, f"{what} [1, 1, draftOffset, width]")
    if shape[0] != 1 or shape[1] != 1 or shape[3] < 1:
        raise schema.error(f"tensors[{index}].shape",
                           f"expected {what} [1, 1, draftOffset, width > 0], got {list(shape)}")
    if shape[2] != draft_offset:
        raise schema.error(f"tensors[{index}].shape",
                           f"{ALIGNMENT}: {what} axis 2 must be draftOffset={draft_offset}, got {list(shape)}")
    return expect_float(schema, attachment.tensors, index)


def _check(schema: AttachmentSchema, attachment: CheckpointAttachment, processed_tokens: int) -> None:
    metadata = attachment.metadata
    expect_processed_tokens(schema, metadata, processed_tokens, ALIGNMENT)
    draft_offset = metadata["draftOffset"]
    if not 0 <= draft_offset <= processed_tokens:
        raise schema.error("metadata.draftOffset",
                           f"{ALIGNMENT}: draftOffset must be in [0, processedTokens={processed_tokens}], "
                           f"got {draft_offset}")
    tensors = attachment.tensors
    if draft_offset > 0:
        expect_count(schema, tensors, 3, "[latent, rope, hidden]",
                     prefix=f"{ALIGNMENT}: draftOffset={draft_offset} needs ")
        latent = _check_mla_part(schema, attachment, 0, "latent", draft_offset)
        rope = _check_mla_part(schema, attachment, 1, "rope", draft_offset)
        if latent != rope:
            raise schema.error("tensors[1].dtype", f"rope dtype {rope} differs from latent (tensors[0]) {latent}")
        hidden = 2
    else:
        expect_count(schema, tensors, 1, "[hidden]", prefix=f"{ALIGNMENT}: draftOffset=0 needs ")
        hidden = 0
    expect_hidden(schema, tensors, hidden)


GLM52_NATIVE_MTP = AttachmentSchema(
    name=GLM52_NATIVE_MTP_V1,
    description="GLM native MTP head MLA cache (latent + rope key) plus the pending hidden",
    producer="GLM native multi-token-prediction layer of the target itself (checked by target identity)",
    metadata_spec={
        "processedTokens": MetadataKey((int,), "tokens the row has processed"),
        "draftOffset": MetadataKey((int,), "tokens in the MTP head's own MLA cache (its history starts empty)"),
    },
    tensors_doc=(
        "[latent, rope, hidden] when draftOffset > 0: latent [1, 1, draftOffset, kvLoraRank] and rope "
        "[1, 1, draftOffset, ropeHeadDim], same float dtype; [hidden] when draftOffset == 0; hidden [1, 1, "
        "hiddenSize], float (float32 zeros for a cold row)"
    ),
    alignment_doc="metadata.processedTokens == checkpoint.processed_tokens; 0 <= draftOffset <= processedTokens",
    check=_check,
)
