"""spec-cache's persistence layer: LMDB environment, record codec, prefix index, eviction, stats.

Never imports MLX: tensors cross this boundary as ``Tensor`` (dtype name, shape, buffer).
"""

from .codec import FORMAT_MAJOR as RECORD_FORMAT_MAJOR, Record, decode_record, encode_record
from .env import STORE_FORMAT, STORE_MAJOR, STORE_MINOR
from .errors import (CorruptIndex, CorruptRecord, InvalidInput, StoreError, StoreFormatError, StoreFullError,
                     StoreOpenError)
from .store import Hit, PutResult, Restored, Store, StoreMemo
from .tensors import LayerState, Tensor

__all__ = [
    "Store", "StoreMemo", "Hit", "Restored", "PutResult", "LayerState", "Tensor", "Record",
    "encode_record", "decode_record", "StoreError", "StoreFormatError", "StoreOpenError", "StoreFullError",
    "CorruptRecord", "CorruptIndex", "InvalidInput", "STORE_FORMAT", "STORE_MAJOR", "STORE_MINOR",
    "RECORD_FORMAT_MAJOR",
]
