"""The shared tier: prefixes shared by a fleet of hosts through Redis or Valkey; LMDB stays the local tier.

``SharedTier(config, store)`` reads through (lookup, fetch, verify; the caller promotes into LMDB) and writes
behind (a byte-capped queue and a background publisher). Needs the ``redis`` package (redis-py); never MLX.
The layout on the server is documented in ``keys.py`` and docs/SHARED_TIER.md.
"""

from .config import SharedConfig, redact
from .health import Health
from .tier import Incoming, SharedTier

__all__ = ["SharedTier", "SharedConfig", "Incoming", "Health", "redact"]
