"""spec-cache's persistence layer: LMDB environment, record codec, prefix index, eviction, stats.

Never imports MLX: tensors cross this boundary as ``Tensor`` (dtype name, shape, buffer).
"""

from .candidates import Hit, Usable
from .codec import FORMAT_MAJOR as RECORD_FORMAT_MAJOR
from .codec import Record, decode_record, encode_record
from .env import STORE_FORMAT, STORE_MAJOR, STORE_MINOR
from .errors import (
    CorruptIndex,
    CorruptRecord,
    InvalidInput,
    NamespaceNotRegistered,
    StoreError,
    StoreFormatError,
    StoreFullError,
    StoreOpenError,
)
from .store import PutResult, Restored, Store, StoreMemo
from .tensors import LayerState, Tensor
from .values import Entry, NamespaceInfo, Node, Totals

__all__ = [
    "Store", "StoreMemo", "Hit", "Usable", "Restored", "PutResult", "LayerState", "Tensor", "Record",
    "encode_record", "decode_record", "StoreError", "StoreFormatError", "StoreOpenError", "StoreFullError",
    "CorruptRecord", "CorruptIndex", "InvalidInput", "NamespaceNotRegistered", "STORE_FORMAT", "STORE_MAJOR",
    "STORE_MINOR", "RECORD_FORMAT_MAJOR", "Node", "Entry", "NamespaceInfo", "Totals",
]
