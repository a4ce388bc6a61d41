"""spec-cache's persistence layer: LMDB environment, record codec, prefix index, eviction, stats.

Never imports MLX: tensors cross this boundary as ``Tensor`` (dtype name, shape, buffer).

One checkpoint, top to bottom:

* ``store.py``: ``Store``, the public API (``put``, ``lookup``, ``fetch``, ``pin``, namespaces, batched counters);
* ``write.py``: a put's first half, the checkpoint checked, keyed (``keys.py``) and encoded (``codec.py``);
  drafter records cut into shared, content-addressed pieces (``pieces.py``, store format 1.2); entry tails and
  chunks cut into shared target pieces where earlier tails wrote them (``spans.py``, store format 1.3);
* ``index.py``: ``Index``, the one owner of nodes, entries, LRU rows and counters inside a transaction
  (``values.py``: those rows typed, and their fixed bytes on disk); ``expected_bookkeeping``, its invariants;
* ``env.py``: the LMDB environment, its transactions and map growth;
* ``lookup.py`` + ``candidates.py``: the longest prefix the caller's ``usable(hit)`` accepts, one ranking for
  both tiers;
* ``read.py``: verified record reads and layer assembly, for both tiers;
* ``background.py``: ``WriteBehind``, the byte-bounded background queue under the shared tier's publisher and
  the runtime's lossless checkpoint writer (``offer`` refuses when full; the caller decides);
* ``maintenance.py``, ``verify.py``, ``gc.py``, ``repair.py``, ``structure.py``: operator work;
* ``shared/``: the Redis/Valkey tier behind the local store.
"""

from .background import WriteBehind
from .candidates import Hit, Usable
from .codec import FORMAT_MAJOR as RECORD_FORMAT_MAJOR
from .codec import Record, decode_record, encode_record
from .env import STORE_FORMAT, STORE_MAJOR, STORE_MINOR
from .errors import (
    ChunkNotCopied,
    CorruptIndex,
    CorruptRecord,
    InvalidInput,
    NamespaceNotRegistered,
    StoreDamaged,
    StoreError,
    StoreFormatError,
    StoreFullError,
    StoreOpenError,
    StoreUnavailable,
    StoreUnsafe,
)
from .store import PutResult, Restored, Store, StoreMemo
from .tensors import LayerState, Tensor
from .values import Entry, NamespaceInfo, Node, Totals

__all__ = [
    "Store", "StoreMemo", "Hit", "Usable", "Restored", "PutResult", "LayerState", "Tensor", "Record",
    "encode_record", "decode_record", "StoreError", "StoreFormatError", "StoreOpenError", "StoreDamaged",
    "StoreUnavailable", "StoreUnsafe", "StoreFullError", "CorruptRecord", "CorruptIndex", "InvalidInput",
    "NamespaceNotRegistered", "ChunkNotCopied", "STORE_FORMAT",
    "STORE_MAJOR", "STORE_MINOR", "RECORD_FORMAT_MAJOR", "Node", "Entry", "NamespaceInfo", "Totals", "WriteBehind",
]
