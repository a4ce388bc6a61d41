"""Key names on the shared server: the LMDB store's 32-byte keys under a fleet prefix, in one of four formats.

Format 1 (one server, default prefix ``sc:1:``): every name is ``<prefix><kind>:<hex>``. Format 2 (a Redis /
Valkey Cluster, default prefix ``sc:2:``): ``<prefix>{<tag>}<kind>:<hex>``, where the hash tag ``<tag>`` (16 hex
digits) names the checkpoint's *group*, so every key one commit touches lies in one hash slot and the commit
stays one atomic script. The hex is the same key LMDB uses (chain keys for chunks and nodes, entry keys for
entries and manifests, ``entry key + blake3(drafter namespace)[:16]`` for drafter parts), so a key is
namespace-scoped exactly as locally: chain keys hash the namespace key, which hashes the target identity, the
prefix namespace and the tenant salt. Hosts of another tenant or namespace compute other keys and never see these.

Formats 3 (one server, default prefix ``sc:3:``) and 4 (a cluster, ``sc:4:``) are formats 1 and 2 keyed by the
fleet secret (``auth.py``): the hex of every name is ``keyed_blake3(kind || key)[:16]`` (32 hex digits) and a
hash tag ``keyed_blake3("group" || group key)[:8]`` (16 hex digits), so names reveal no namespace key, chain key or
token hash; records are sealed and manifests carry a MAC (``v`` 3, no ``ns`` field: ``mac`` covers it). Without a
secret only formats 1 and 2 are written or read, and only on a trusted network.

    <p>sigs:<ns>        SET   layer signatures stored under the namespace (roots of its chains); formats 3 and 4:
                              each with its MAC (``auth.sig_member``), so forged members are told apart
    <p>node:<chain>     HASH  t:<tail> = 1 per entry tail hanging off the node; c = 1/0 every checkpoint through
                              the node was fully chunked; m = highest minimum reusable offset through it
    <p>man:<entry>      HASH  the checkpoint's manifest: v, ns, len, minr, sum (entry record checksum), bytes,
                              host, at, d:<drafter namespace> = that drafter record's checksum
    <p>entry:<entry>    STRING entry record (codec bytes)
    <p>chunk:<chain>    STRING chunk record (codec bytes)
    <p>draft:<entry+16> STRING drafter record (codec bytes)
    <p>stats            HASH  checkpoints / bytes published (cumulative, for ``shared-stats``); formats 3 and 4
                              also fp:<fingerprint> = checkpoints published with each secret (``auth.fingerprint``)

Groups (format 2): a checkpoint whose chain is root, chunk 1 .. chunk j belongs to the group of its chain key at
``min(j, spread)`` chunks (``spread``: ``SharedConfig.spread_chunks``; the root for a checkpoint shorter than one
chunk); its chunk, node, entry, manifest and drafter keys carry that group's tag. Group ``g`` at depth ``i <
spread`` holds only checkpoints of exactly ``i`` chunks; the group at depth ``spread`` holds every deeper one.
Chain keys hash the namespace and the tokens, so namespaces and conversations spread over the 16384 slots; with
``spread`` 1, chunks are stored once per first chunk, with a larger spread each group keeps its own copy of the
chunks it shares with others. The signature set is tagged by the namespace key and ``stats`` has no tag: both
are written after the commit, outside the script.
"""

from __future__ import annotations

from typing import Sequence

from .auth import PlainAuth

TAG_HEX = 16  # hex digits of a group key in a hash tag (a collision only puts two groups in one slot)


class KeyNames:
    """Builds server key names (bytes) under one prefix, format 1 (``cluster=False``) or 2 (hash-tagged)."""

    def __init__(self, prefix: str, cluster: bool = False, spread: int = 1, auth: PlainAuth | None = None):
        self.prefix = prefix.encode("ascii")
        self.cluster = cluster
        self.spread = spread
        self.auth = PlainAuth() if auth is None else auth

    def groups(self, chain: Sequence[bytes]) -> list[tuple[bytes | None, int]]:
        """For a prompt's chain (root, chunk 1 .. chunk K): ``(group, depth)`` of every group that may hold a
        prefix of it; the group at ``depth`` holds chains up to ``chain[:depth + 1]`` when ``depth`` is below the
        spread, the whole chain otherwise. Format 1 has one group (None) holding everything."""
        if not self.cluster:
            return [(None, len(chain) - 1)]
        top = min(len(chain) - 1, self.spread)
        return [(chain[i], i if i < self.spread else len(chain) - 1) for i in range(top + 1)]

    def group_of(self, chain: Sequence[bytes]) -> bytes | None:
        """The group a checkpoint on ``chain`` (root .. the node it hangs off) is published to."""
        return chain[min(len(chain) - 1, self.spread)] if self.cluster else None

    def _name(self, kind: bytes, key: bytes, group: bytes | None) -> bytes:
        if not self.cluster:
            return self.prefix + kind + b":" + self.auth.name_hex(kind, key)
        if group is None:
            raise ValueError(f"a cluster key name needs its group ({kind.decode()})")
        tag = self.auth.tag_hex(group)[:TAG_HEX]
        return self.prefix + b"{" + tag + b"}" + kind + b":" + self.auth.name_hex(kind, key)

    def sigs(self, ns_key: bytes) -> bytes:
        return self._name(b"sigs", ns_key, ns_key)

    def node(self, chain_key: bytes, group: bytes | None = None) -> bytes:
        return self._name(b"node", chain_key, group)

    def manifest(self, entry_key: bytes, group: bytes | None = None) -> bytes:
        return self._name(b"man", entry_key, group)

    def entry(self, entry_key: bytes, group: bytes | None = None) -> bytes:
        return self._name(b"entry", entry_key, group)

    def chunk(self, chain_key: bytes, group: bytes | None = None) -> bytes:
        return self._name(b"chunk", chain_key, group)

    def draft(self, draft_key: bytes, group: bytes | None = None) -> bytes:
        return self._name(b"draft", draft_key, group)

    def stats(self) -> bytes:
        return self.prefix + b"stats"
