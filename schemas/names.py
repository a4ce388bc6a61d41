"""Stored schema and codec names.

These strings are written into checkpoints, so they never change with the code
that reads them. A new layout gets a new name (``-v2``), never a new meaning
for an old one.
"""

from __future__ import annotations

__all__ = [
    "GEMMA_ASSISTANT_V1",
    "DEEPSPEC_CONTEXT_V1",
    "DFLASH_CONTEXT_V1",
    "DFLASH2_CONTEXT_V1",
    "QWEN_MTP_V1",
    "GLM52_NATIVE_MTP_V1",
    "STANDALONE_DRAFT_V1",
    "NGRAM_HISTORY_V1",
    "CACHE_CODECS_V1",
]

GEMMA_ASSISTANT_V1 = "gemma-assistant-v1"
DEEPSPEC_CONTEXT_V1 = "deepspec-context-v1"
DFLASH_CONTEXT_V1 = "dflash-context-v1"
DFLASH2_CONTEXT_V1 = "dflash2-context-v1"
QWEN_MTP_V1 = "qwen-mtp-v1"
GLM52_NATIVE_MTP_V1 = "glm52-native-mtp-v1"
STANDALONE_DRAFT_V1 = "standalone-draft-v1"
NGRAM_HISTORY_V1 = "ngram-history-v1"

#: ``metadata.cacheCodecs`` of attachments that carry per-layer cache headers.
CACHE_CODECS_V1 = "spec-cache-kv-v1"
