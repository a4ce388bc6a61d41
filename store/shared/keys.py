"""Key names on the shared server: the LMDB store's 32-byte keys under a fleet prefix.

Every name below is ``<prefix><kind>:<hex>``; the hex is the same key LMDB uses (chain keys for chunks and nodes,
entry keys for entries and manifests, ``entry key + blake3(drafter namespace)[:16]`` for drafter parts), so a key
is namespace-scoped exactly as locally: chain keys hash the namespace key, which hashes the target identity, the
prefix namespace and the tenant salt. Hosts of another tenant or namespace compute other keys and never see these.

    <p>sigs:<ns>        SET   layer signatures stored under the namespace (roots of its chains)
    <p>node:<chain>     HASH  t:<tail> = 1 per entry tail hanging off the node; c = 1/0 every checkpoint through
                              the node was fully chunked; m = highest minimum reusable offset through it
    <p>man:<entry>      HASH  the checkpoint's manifest: v, ns, len, minr, sum (entry record checksum), bytes,
                              host, at, d:<drafter namespace> = that drafter record's checksum
    <p>entry:<entry>    STRING entry record (codec bytes)
    <p>chunk:<chain>    STRING chunk record (codec bytes)
    <p>draft:<entry+16> STRING drafter record (codec bytes)
    <p>stats            HASH  checkpoints / bytes published (cumulative, for ``shared-stats``)
"""

from __future__ import annotations


class KeyNames:
    """Builds server key names (bytes) under one prefix."""

    def __init__(self, prefix: str):
        self.prefix = prefix.encode("ascii")

    def _name(self, kind: bytes, key: bytes) -> bytes:
        return self.prefix + kind + b":" + key.hex().encode("ascii")

    def sigs(self, ns_key: bytes) -> bytes:
        return self._name(b"sigs", ns_key)

    def node(self, chain_key: bytes) -> bytes:
        return self._name(b"node", chain_key)

    def manifest(self, entry_key: bytes) -> bytes:
        return self._name(b"man", entry_key)

    def entry(self, entry_key: bytes) -> bytes:
        return self._name(b"entry", entry_key)

    def chunk(self, chain_key: bytes) -> bytes:
        return self._name(b"chunk", chain_key)

    def draft(self, draft_key: bytes) -> bytes:
        return self._name(b"draft", draft_key)

    def stats(self) -> bytes:
        return self.prefix + b"stats"
