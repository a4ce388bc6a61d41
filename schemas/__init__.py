"""spec-cache attachment schemas: what a drafter checkpoint must look like.

Pure Python: never imports mlx or numpy. Tensors are read through ``.shape``
and ``.dtype`` only. See README.md in this package for every schema's layout.
"""

from .attachment import CheckpointAttachment, DraftRowCheckpoint, FrozenMetadata, MetadataValue
from .cache_headers import CacheHeader, check_every_tensor_referenced, decode_cache_headers, encode_cache_headers
from .dtypes import (
    DTYPE_FROM_SAFETENSORS,
    DTYPE_ITEMSIZE,
    DTYPE_NAMES,
    FLOAT_DTYPES,
    SAFETENSORS_DTYPE,
    dtype_name,
)
from .errors import SchemaError, UnknownSchemaError
from .names import (
    CACHE_CODECS_V1,
    DEEPSPEC_CONTEXT_V1,
    DFLASH2_CONTEXT_V1,
    DFLASH_CONTEXT_V1,
    GEMMA_ASSISTANT_V1,
    GLM52_NATIVE_MTP_V1,
    NGRAM_HISTORY_V1,
    QWEN_MTP_V1,
    STANDALONE_DRAFT_V1,
)
from .registry import SCHEMAS, describe_schemas, get_schema, validate_attachment, validate_checkpoint
from .spec import AttachmentSchema, MetadataKey
from .standalone import CACHE_KINDS

__all__ = [
    "CheckpointAttachment",
    "DraftRowCheckpoint",
    "FrozenMetadata",
    "MetadataValue",
    "SchemaError",
    "UnknownSchemaError",
    "dtype_name",
    "DTYPE_NAMES",
    "DTYPE_ITEMSIZE",
    "SAFETENSORS_DTYPE",
    "DTYPE_FROM_SAFETENSORS",
    "FLOAT_DTYPES",
    "AttachmentSchema",
    "MetadataKey",
    "SCHEMAS",
    "get_schema",
    "validate_checkpoint",
    "validate_attachment",
    "describe_schemas",
    "CacheHeader",
    "encode_cache_headers",
    "decode_cache_headers",
    "check_every_tensor_referenced",
    "CACHE_KINDS",
    "CACHE_CODECS_V1",
    "GEMMA_ASSISTANT_V1",
    "DEEPSPEC_CONTEXT_V1",
    "DFLASH_CONTEXT_V1",
    "DFLASH2_CONTEXT_V1",
    "QWEN_MTP_V1",
    "GLM52_NATIVE_MTP_V1",
    "STANDALONE_DRAFT_V1",
    "NGRAM_HISTORY_V1",
]
