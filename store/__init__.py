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
  the runtime's lossless checkpoint writer (``offer`` refuses when full; the caller decides); ``TenantShares``,
  how tenants share such a buffer's cap;
* ``eviction.py``: the eviction policy, one table for every path that removes entries (a put's budget and
  tenant quotas, a full map, an operator's ``evict``, continuation records); ``tenants.py``: the bytes each
  tenant holds;
* ``maintenance.py``, ``verify.py``, ``gc.py``, ``repair.py``, ``structure.py``: operator work;
* ``shared/``: the Redis/Valkey tier behind the local store.

The face: the runtime (``spec_cache``) and the CLI import only the names in ``__all__`` below, and two named
sub-APIs: ``spec_cache.store.maintenance`` (operator work on a store: list, stats, evict, pin, verify, gc,
compact, repair) and ``spec_cache.store.shared`` (the shared tier; its own ``__all__``, imported only when a
shared tier is configured). Keys, cursors, record rows and the other modules are the store's own
(``tests/store/test_store_face.py`` holds the runtime to it; benchmarks of internals, ``spec_cache/apps/bench``,
may reach inside).
"""

from . import maintenance  # a sub-API: operator work over Store
from .background import TenantShares, WriteBehind
from .candidates import Hit, Usable
from .codec import FORMAT_MAJOR as RECORD_FORMAT_MAJOR
from .codec import Record, decode_record, encode_record
from .continuations import MAX_BYTES as CONTINUATION_MAX_BYTES
from .continuations import MAX_RECORDS as CONTINUATION_MAX_RECORDS
from .continuations import Continuation, ContinuationTable, continuation_key, continuation_params
from .directory import default_budget
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
from .eviction import TenantPolicy, fair_victim_tenant
from .keys import pack_tokens, tenant_id
from .store import PutResult, Restored, Store, StoreMemo
from .tensors import LayerState, Tensor, numpy_dtype
from .values import Entry, NamespaceInfo, Node, Totals

__all__ = [
    "Store", "StoreMemo", "Hit", "Usable", "Restored", "PutResult", "LayerState", "Tensor", "Record",
    "encode_record", "decode_record", "StoreError", "StoreFormatError", "StoreOpenError", "StoreDamaged",
    "StoreUnavailable", "StoreUnsafe", "StoreFullError", "CorruptRecord", "CorruptIndex", "InvalidInput",
    "NamespaceNotRegistered", "ChunkNotCopied", "STORE_FORMAT",
    "STORE_MAJOR", "STORE_MINOR", "RECORD_FORMAT_MAJOR", "Node", "Entry", "NamespaceInfo", "Totals", "WriteBehind",
    # how tenants share one capped buffer (the shared tier's publish and promote queues, the prefetch handoff)
    "TenantShares",
    # the language a caller speaks to the store in: tokens as the store packs them, a tenant's label, dtypes
    "pack_tokens", "tenant_id", "numpy_dtype",
    # continuation records (a request's output past its prompt checkpoint), written in a checkpoint's commit
    "Continuation", "ContinuationTable", "continuation_key", "continuation_params", "CONTINUATION_MAX_BYTES",
    "CONTINUATION_MAX_RECORDS",
    # the store directory: serve's default byte budget
    "default_budget",
    # the eviction rules the memory tier shares with the store (a tenant's quota, the fair-share victim)
    "TenantPolicy", "fair_victim_tenant",
    # operator work on a store (a sub-API)
    "maintenance",
]
