"""``gemma-assistant-v1``: the Gemma "-assistant" drafter's last true target hidden.

The assistant borrows the target's attention (donor KV stays in target storage),
so its checkpoint is one hidden row and the token count it covers.
"""

from __future__ import annotations

from .attachment import CheckpointAttachment
from .checks import expect_count, expect_hidden, expect_processed_tokens
from .names import GEMMA_ASSISTANT_V1
from .spec import AttachmentSchema, MetadataKey

__all__ = ["GEMMA_ASSISTANT"]

ALIGNMENT = "invalid assistant checkpoint alignment"


def _check(schema: AttachmentSchema, attachment: CheckpointAttachment, processed_tokens: int) -> None:
    expect_processed_tokens(schema, attachment.metadata, processed_tokens, ALIGNMENT)
    tensors = attachment.tensors
    expect_count(schema, tensors, 1, "[hidden]")
    expect_hidden(schema, tensors, 0)


GEMMA_ASSISTANT = AttachmentSchema(
    name=GEMMA_ASSISTANT_V1,
    description="last true target hidden of a Gemma assistant drafter row",
    producer="Gemma '-assistant' drafter (KV-borrowing; donor attention stays in the target cache)",
    metadata_spec={"processedTokens": MetadataKey((int,), "tokens the row has processed")},
    tensors_doc="[hidden] with shape [1, 1, hiddenSize], float16/bfloat16/float32 (the target hidden dtype)",
    alignment_doc="metadata.processedTokens == checkpoint.processed_tokens",
    check=_check,
)
