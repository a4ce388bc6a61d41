"""The read path of ``SharedTier``: find the longest usable prefix on the server in bounded round trips.

Why one file: the read path's steps share one time budget, the signatures already seen and one way of checking
replies; split, each step would have to hand the deadline and that state across modules.

On the caller's thread, every socket read bounded by ``timeout_s`` and all of them together by the lookup's
budget (``lookup_budget_s``, or the caller's earlier deadline: ``deadline.py``):

1. one pipeline: the namespace's layer signatures and, for the signatures this process already knows, the node
   hash of every full chunk of the prompt (chain keys are computed locally, so nothing is scanned); a signature
   seen for the first time costs one more pipeline;
2. candidates ranked as the local store ranks them (``store/candidates.py``), then one MULTI/EXEC: the
   manifests of the longest few entry candidates plus every record of the longest one not yet
   in hand, read as one consistent snapshot; a candidate that turns out stale, evicted or corrupt costs one more
   MULTI for the next (``max_attempts`` in all).

Chunks the local store already holds (content-addressed: the same chain key is the same record) are read from
LMDB instead of the server; only what the local store lacks crosses the network.

On a cluster (format 2 key names, ``keys.py``) a prompt's prefixes may sit in several groups (one hash slot
each); step 1 reads the node hashes of each, step 2's MULTI stays inside the candidate's group.

With a fleet secret every record is opened (authenticated and decrypted, ``auth.py``) and every manifest's MAC
checked before anything else looks at it; a value that fails is a miss, counted ``unauthenticated``, warned about
once per cause, and removed from the server if unchanged. Every record is then verified (checksum, structure,
kind, the key it names, its tokens against the prompt's) and the entry and drafter records must carry the
checksums their manifest pins. A corrupt value is removed from
the server if it still holds exactly what was read, and the lookup goes on with a shorter prefix. A key that
vanished between the two steps (server eviction) is a miss, not an error.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np

from spec_cache.schemas import CheckpointAttachment

from .. import keys as K
from ..candidates import Hit, Level, Usable, chain_candidates, longest_first
from ..errors import CorruptRecord, StoreError
from ..index import draft_key
from ..tensors import LayerState
from .auth import Unauthentic
from .records import assemble, attachment_of, local_chunks, record_checksum

log = logging.getLogger("spec_cache.shared")

MAX_SIGNATURES = 16  # signatures considered per namespace (a garbage set cannot make lookups unbounded)
MAX_PRUNE = 1000     # forged signature set members one lookup removes (the publisher trims the rest)


@dataclass
class Incoming:
    """A prefix restored from the shared tier: verified layers (+ drafter attachment) of ``length`` tokens."""

    length: int
    layers: list[LayerState]
    attachment: CheckpointAttachment | None
    minimum_reusable: int
    nbytes: int


@dataclass
class _Seen:
    """What one lookup learned so far: manifests read, chunk records in hand, keys missing or corrupt."""

    manifests: dict = field(default_factory=dict)      # entry key -> parsed manifest, or None if unusable
    chunks: dict = field(default_factory=dict)         # chunk key -> record bytes (from the server or LMDB)
    unusable: set = field(default_factory=set)         # record keys found missing or corrupt
    local: set = field(default_factory=set)            # chunk keys whose record in ``chunks`` came from LMDB
    local_bad: set = field(default_factory=set)        # chunk keys whose LMDB record failed verification
    wire: dict = field(default_factory=dict)           # key name -> the value as stored (sealed), for removal
    unauthentic: set = field(default_factory=set)      # key names whose value failed authentication
    loose: bool = False  # a read was not one snapshot (its slot was migrating): a mismatch is a miss, not corrupt


@dataclass(frozen=True)
class _Candidate:
    length: int
    is_entry: bool
    chain: tuple[bytes, ...]   # root .. the node the prefix ends in or hangs off
    entry_key: bytes | None
    minimum_reusable: int = 0  # a chunk boundary's (its node's ``m``); an entry's is in its manifest
    group: bytes | None = None  # the cluster group (hash tag) holding it; None on one server

    def hit(self, manifests: dict, drafter: str | None) -> Hit | None:
        """The candidate as a ``Hit`` for the caller's ``usable``; None while its manifest is not read yet.
        ``drafter``: the drafter's id in manifests (``auth.drafter_id``)."""
        if not self.is_entry:
            return Hit(self.length, False, None, self.chain, self.minimum_reusable)
        man = manifests.get(self.entry_key)
        if man is None:
            return None
        return Hit(self.length, bool(drafter) and drafter in man["drafters"], self.entry_key, self.chain,
                   man["minr"])


class LookupMixin:
    """``SharedTier``'s lookups (needs ``config``, ``keys``, ``health``, ``_read``, ``_delete_if_unchanged``,
    ``_sigs``, ``_redis`` and ``_failed`` from the tier)."""

    def restore(self, ns_key: bytes, tokens, *, chunk_tokens: int, drafter: str | None = None, floor: int = 0,
                warnings: list[str] | None = None, usable: Usable | None = None,
                deadline: float | None = None) -> Incoming | None:
        """The longest prefix of ``tokens`` longer than ``floor`` tokens that ``usable(hit)`` accepts (any when
        None; the same predicate as ``Store.fetch``), fetched and verified; or None. A candidate the predicate
        rejects is skipped without fetching when its manifest is already in hand.

        All of it ends by ``lookup_budget_s`` from now, or by ``deadline`` (``time.monotonic()``) if earlier: past
        it, the lookup is a miss (counted ``over_budget``). Never raises for a server problem (down, slow,
        garbage, unauthenticated): that is a miss, noted in ``warnings``.
        """
        warnings = [] if warnings is None else warnings
        if not self.health.available():
            self.health.add("skipped")
            return None
        packed = K.pack_tokens(tokens)
        start = time.perf_counter()
        until = time.monotonic() + self.config.lookup_budget_s
        if deadline is not None:
            if deadline <= time.monotonic():  # the caller waited too long already: a miss, not the server's fault
                self.health.add("over_budget")
                return None
            until = min(until, deadline)
        self.health.add("lookups")
        outer, self._budget.deadline = self._budget.deadline, until
        try:
            got = self._restore(ns_key, packed, chunk_tokens, drafter, floor, warnings, usable)
        except self._failures as exc:
            if time.monotonic() >= until:
                self.health.add("over_budget")
            self._failed(exc, "a lookup", warnings)
            got = None
        else:
            self.health.ok()
        finally:
            self._budget.deadline = outer
        self.health.timed(time.perf_counter() - start)
        self.health.add("hits" if got is not None else "misses")
        return got

    def _restore(self, ns_key, packed, C, drafter, floor, warnings, usable) -> Incoming | None:
        candidates = self._candidates(ns_key, packed, C, floor, warnings)
        did = self.keys.auth.drafter_id(drafter) if drafter else None
        seen = _Seen()
        attempts = 0
        for cand in candidates:
            if attempts >= self.config.max_attempts:
                break
            if cand.entry_key is not None and seen.manifests.get(cand.entry_key, True) is None:
                continue  # known to have no usable manifest
            if cand.entry_key in seen.unusable or any(k in seen.unusable for k in cand.chain[1:]):
                continue  # needs a record known to be missing or corrupt
            hit = cand.hit(seen.manifests, did)
            if hit is not None and usable is not None and not usable(hit):
                continue  # the caller cannot use it: no round trip
            attempts += 1
            probe = [c.entry_key for c in candidates if c.entry_key is not None and c.entry_key not in seen.manifests
                     and c.group == cand.group]  # one MULTI stays in one hash slot
            got = self._attempt(ns_key, packed, C, drafter, cand, probe[:self.config.max_candidates], seen, warnings,
                                usable)
            if got is not None:
                return got
        return None

    def _candidates(self, ns_key: bytes, packed: np.ndarray, C: int, floor: int, warnings: list[str],
                    ) -> list[_Candidate]:
        """Entry and chunk-boundary candidates longer than ``floor``, longest first (1-2 round trips)."""
        n = len(packed)
        known = self._sigs.get(ns_key, [])
        chains = {sig: self._chain(ns_key, sig, packed, C) for sig in known}
        pipe = self._read.pipeline(transaction=False)
        pipe.smembers(self.keys.sigs(ns_key))
        wanted = [node for sig in known for node in self._nodes(chains[sig])]
        for group, key in wanted:
            pipe.hgetall(self.keys.node(key, group))
        res = pipe.execute(raise_on_error=False)
        sigs_now = res[0]
        if _failed_reply(sigs_now) or not isinstance(sigs_now, (set, list)):
            self._corrupt_key(self.keys.sigs(ns_key), None, "signature set is not a set", warnings, "set")
            sigs_now = set()
        sigs_now, trusted = self._usable_sigs(ns_key, [s for s in sigs_now if isinstance(s, bytes)], known,
                                              warnings)
        nodes: dict[tuple, dict] = dict(zip(wanted, res[1:]))
        new = [s for s in sigs_now if s not in chains]
        if new:
            pipe = self._read.pipeline(transaction=False)
            wanted = []
            for sig in new:
                chains[sig] = self._chain(ns_key, sig, packed, C)
                wanted += self._nodes(chains[sig])
            for group, key in wanted:
                pipe.hgetall(self.keys.node(key, group))
            nodes.update(zip(wanted, pipe.execute(raise_on_error=False)))
        # remembered for the next lookup's first pipeline: authenticated signatures, and others only where a node
        # of this prompt was found under them (a garbage member remembered would come first in every lookup)
        self._sigs[ns_key] = [s for s in sigs_now
                              if s in trusted or any(nodes.get(w) for w in self._nodes(chains[s]))]
        chains_here, group_of = [], {}
        for sig in sigs_now:
            for group, depth in self.keys.groups(chains[sig]):
                chain = chains[sig][:depth + 1]

                def level(j: int, chain=chain, group=group) -> Level | None:
                    return self._level(chain[j], nodes.get((group, chain[j])), j * C, warnings, group)
                found = list(chain_candidates(chain, level, n, C, floor))
                group_of.update((id(c), group) for c in found)
                chains_here.append(found)
        ranked, seen = [], set()
        for c in longest_first(chains_here):  # the store's one ranking: longest first, entries first
            if (c.length, c.is_entry, c.chain) not in seen:  # a chunk boundary held by several groups: once
                seen.add((c.length, c.is_entry, c.chain))
                ranked.append(c)
        entries = [c for c in ranked if c.is_entry][:self.config.max_candidates]
        ranked = [c for c in ranked if not c.is_entry or c in entries]  # every chunk boundary stays: no hashing
        # entry keys only for the candidates kept (one blake3 over the tail tokens each)
        return [_Candidate(c.length, c.is_entry, c.chain,
                           K.entry_key(c.chain[-1], packed[c.tail_start(C):c.length]) if c.is_entry else None,
                           c.minimum_reusable, group_of[id(c)])
                for c in ranked]

    def _usable_sigs(self, ns_key: bytes, members: list[bytes], known: list[bytes], warnings: list[str],
                     ) -> tuple[list[bytes], set[bytes]]:
        """The signatures to follow, at most ``MAX_SIGNATURES``, from the members of the namespace's set, and
        those of them that are authenticated (with a fleet secret).

        Why not simply the first 16: anyone who can write the server could add members that sort first and hide
        the namespace from every host for good. With a fleet secret, members carry a MAC (``auth.sig_member``):
        the authenticated ones come first, bare ones (hosts before the MAC) after them, and forged ones are never
        followed and are removed (one SREM; counted ``unauthenticated``). Without a secret nothing tells members
        apart: signatures this process found roots under come first, the rest in random order, so a garbage set
        costs misses, never the namespace for good (publishers trim it: ``publish.SIG_SET_CAP``)."""
        name = self.keys.sigs(ns_key)
        auth = self.keys.auth
        good, bare, forged = [], [], []
        for member in members:
            sig, how = auth.sig_of(name, member)
            (good if how == "ok" else bare if how == "bare" else forged).append(member if how == "forged" else sig)
        if forged:
            self.health.add("unauthenticated", len(forged))
            self._warn_once("unauthentic signature", f"shared tier {self.config.safe_url}: {len(forged)} members of "
                            "a namespace's signature set failed authentication (tampered with, or written with "
                            "another secret); ignored and removed (warned once per cause)", warnings)
            try:
                self._read.srem(name, *forged[:MAX_PRUNE])
            except self._failures as exc:
                log.warning("shared tier: could not prune a signature set: %s", exc)
        if auth.keyed:
            ordered = sorted(set(good)) + sorted(set(bare) - set(good))
        else:
            members_now = set(good)
            first = [s for s in known if s in members_now]
            rest = sorted(members_now - set(first))
            random.shuffle(rest)
            ordered = first + rest
        return ordered[:MAX_SIGNATURES], (set(good) if auth.keyed else set())

    def _nodes(self, chain: list[bytes]) -> list[tuple[bytes | None, bytes]]:
        """``(group, chain key)`` of every node hash to read for a prompt's chain (one group on one server)."""
        return [(group, key) for group, depth in self.keys.groups(chain) for key in chain[:depth + 1]]

    def _level(self, key: bytes, node, base: int, warnings: list[str], group: bytes | None = None) -> Level | None:
        """What a node hash says: its entries' tail lengths (``t:<n>`` fields), ``c`` (complete), ``m`` (minr)."""
        if _failed_reply(node):
            self._corrupt_key(self.keys.node(key, group), None, "node is not a hash", warnings, "hash")
            return None
        if not node:
            return None
        tails = set()
        for name in node:
            if isinstance(name, bytes) and name.startswith(b"t:"):
                try:
                    t = int(name[2:])
                except ValueError:
                    continue
                if t >= 0:
                    tails.add(t)
        return Level(sorted(tails, reverse=True), node.get(b"c") == b"1", _int(node.get(b"m"), base + 1))

    @staticmethod
    def _chain(ns_key: bytes, sig: bytes, packed: np.ndarray, C: int) -> list[bytes]:
        root = K.root_key(ns_key, sig)
        return K.chain(root, packed, C) if sig else [root]  # no chunked layers: entries hang off the root

    def _attempt(self, ns_key, packed, C, drafter, cand: _Candidate, probe: list[bytes], seen: "_Seen",
                 warnings: list[str], usable: Usable | None = None) -> Incoming | None:
        """One MULTI: manifests of ``probe`` (and of the candidate) plus the candidate's records not yet in hand;
        then the candidate checked against its manifest, verified and assembled."""
        ek = cand.entry_key
        dkey = draft_key(ek, drafter) if (ek is not None and drafter) else None
        g = cand.group
        did = self.keys.auth.drafter_id(drafter) if drafter else None
        entry_raw, draft_raw, _fetched = self._read_candidate(ns_key, cand, dkey, probe, seen, warnings)
        if any(key in seen.unusable for key in cand.chain[1:]):
            self.health.add("vanished")  # evicted between the index read and this one: try a shorter prefix
            return None
        if ek is not None and ek in seen.unusable:
            return None  # the entry record failed authentication
        records = {key: seen.chunks[key] for key in cand.chain[1:]}
        man = None
        if ek is not None:
            man = self._usable_manifest(cand, entry_raw, seen, did, usable, warnings)
            if man is None:
                return None
            records[ek] = entry_raw
        try:
            layers = assemble(packed=packed, length=cand.length, chunk_tokens=C, chain=cand.chain, records=records,
                              entry=ek)
        except CorruptRecord as exc:
            seen.chunks.pop(exc.key, None)
            if exc.key in seen.local:  # our own LMDB copy is bad: the next attempt fetches the server's
                seen.local.discard(exc.key)
                seen.local_bad.add(exc.key)
                self.health.add("corrupt")
                message = f"shared tier: local chunk {(exc.key or b'').hex()[:16]} failed verification: {exc}"
                log.warning(message)
                warnings.append(message)
                return None
            name = self.keys.entry(ek, g) if exc.key == ek else self.keys.chunk(exc.key or b"", g)
            self._corrupt_key(name, seen.wire.get(name), str(exc), warnings)
            seen.unusable.add(exc.key)
            return None
        want = man["drafters"].get(did) if (man is not None and did) else None
        man_name = self.keys.manifest(ek, g) if ek is not None else b""
        field = b"d:" + did.encode("utf-8") if did else b""
        if seen.loose and isinstance(draft_raw, bytes) and self._pin(man_name, field, draft_raw) != want:
            want = None  # not one snapshot: the drafter record may have been replaced meanwhile (target part only)
        if dkey is not None and self.keys.draft(dkey, g) in seen.unauthentic:
            want = None  # the drafter record failed authentication: the target part still serves
        attachment = (self._attachment(dkey, draft_raw, want, cand.length, warnings, g, man_name, field, seen)
                      if want is not None else None)
        # the restored records' size (fetched or read locally): what promoting them into LMDB writes
        nbytes = sum(len(raw) for raw in records.values()) + (len(draft_raw) if attachment is not None else 0)
        return Incoming(cand.length, layers, attachment, man["minr"] if man is not None else 0, nbytes)

    def _read_candidate(self, ns_key, cand: _Candidate, dkey: bytes | None, probe: list[bytes], seen: "_Seen",
                        warnings: list[str]):
        """The MULTI of ``_attempt``: manifests go to ``seen.manifests``, chunk records to ``seen.chunks`` (or
        ``seen.unusable``); returns ``(entry record, drafter record, bytes fetched)``."""
        ek = cand.entry_key
        if ek is not None and ek not in probe:
            probe = [ek] + probe
        g = cand.group
        self._local_chunks([key for key in cand.chain[1:] if key not in seen.chunks and key not in seen.local_bad],
                           seen)
        fetch = [key for key in cand.chain[1:] if key not in seen.chunks]

        def read(transaction: bool) -> list:
            pipe = self._read.pipeline(transaction=transaction)
            for key in probe:
                pipe.hgetall(self.keys.manifest(key, g))
            for key in fetch:
                pipe.get(self.keys.chunk(key, g))
            if ek is not None:
                pipe.get(self.keys.entry(ek, g))
            if dkey is not None:
                pipe.get(self.keys.draft(dkey, g))
            return pipe.execute(raise_on_error=False)
        try:
            res = read(True)
        except (self._redis.exceptions.AskError, self._redis.exceptions.TryAgainError):
            # the group's slot is migrating between cluster nodes: a MULTI cannot follow ASK; read the same keys
            # command by command (redis-py follows ASK), and treat a record / manifest mismatch as a miss
            self.health.add("migrating")
            seen.loose = True
            res = read(False)
        for raw in res:
            if isinstance(raw, Exception) and not _wrong_type(raw):
                raise raw  # the server failed (down, moved away, out of memory): the breaker handles it
        for key, raw in zip(probe, res):
            seen.manifests[key] = self._manifest(ns_key, key, raw, warnings, g)
        res = res[len(probe):]
        fetched, res = res[:len(fetch)], res[len(fetch):]
        entry_raw = res[0] if ek is not None else None
        draft_raw = res[1] if dkey is not None else None
        nbytes = sum(len(r) for r in (*fetched, entry_raw, draft_raw) if isinstance(r, bytes))
        self.health.add("bytes_fetched", nbytes)
        for key, raw in zip(fetch, fetched):
            if raw is None:
                seen.unusable.add(key)
            elif not isinstance(raw, bytes):
                self._corrupt_key(self.keys.chunk(key, g), None, "chunk is not a string", warnings)
                seen.unusable.add(key)
            else:
                plain = self._open(self.keys.chunk(key, g), raw, "chunk", seen, warnings)
                if plain is None:
                    seen.unusable.add(key)
                else:
                    seen.chunks[key] = plain
        if ek is not None and isinstance(entry_raw, bytes):
            entry_raw = self._open(self.keys.entry(ek, g), entry_raw, "entry", seen, warnings)
            if entry_raw is None:
                seen.unusable.add(ek)
        if dkey is not None and isinstance(draft_raw, bytes):
            draft_raw = self._open(self.keys.draft(dkey, g), draft_raw, "drafter", seen, warnings)
        return entry_raw, draft_raw, nbytes

    def _open(self, name: bytes, raw: bytes, what: str, seen: "_Seen", warnings: list[str]):
        """The record in a server value (``keys.auth.open``); None, counted, warned about once per cause and
        removed from the server if unchanged, when it fails authentication."""
        try:
            plain = self.keys.auth.open(name, raw)
        except Unauthentic as exc:
            seen.unauthentic.add(name)
            self._unauthentic(name, raw, f"{what} record", str(exc), warnings)
            return None
        seen.wire[name] = raw
        return bytes(plain) if not isinstance(plain, bytes) else plain

    def _unauthentic(self, name: bytes, raw, what: str, reason: str, warnings: list[str] | None,
                     kind: str = "string") -> None:
        """A value that failed the fleet secret's check: a miss, never used or promoted. Removed (if unchanged)
        so that the fleet republishes it: only a writer holding this secret computes this key name."""
        self.health.add("unauthenticated")
        self._warn_once(f"unauthentic {what}",
                        f"shared tier {self.config.safe_url}: {what} failed authentication ({reason}): tampered "
                        f"with, or written without this fleet's secret; treated as a miss and removed (warned once "
                        f"per cause; see the 'unauthenticated' counter)", warnings)
        digest = hashlib.sha1(raw).hexdigest() if isinstance(raw, bytes) else ""
        try:
            self._delete_if_unchanged(keys=[name], args=[kind, digest])
        except self._failures as exc:
            log.warning("shared tier: could not remove %s: %s", name[:60], exc)

    def _pin(self, man_name: bytes, field: bytes, record) -> bytes | None:
        """What a manifest pins for ``record`` under ``field`` (``sum`` or ``d:<id>``)."""
        return self.keys.auth.pin(man_name, field, record_checksum(record)) if isinstance(record, bytes) else None

    def _local_chunks(self, keys: list[bytes], seen: "_Seen") -> None:
        """Chunk records of ``keys`` the local store holds, into ``seen.chunks`` (verified when assembled)."""
        if self._store is None or not keys:
            return
        try:
            found = local_chunks(self._store, keys)
        except StoreError as exc:  # the local store cannot be read: fetch everything from the server
            log.warning("shared tier: local chunks not readable, fetching them: %s", exc)
            return
        seen.chunks.update(found)
        seen.local.update(found)
        self.health.add("chunks_local", len(found))
        self.health.add("bytes_local", sum(len(raw) for raw in found.values()))

    def _usable_manifest(self, cand: _Candidate, entry_raw, seen: "_Seen", drafter: str | None,
                         usable: Usable | None, warnings: list[str]) -> dict | None:
        # ``drafter``: the drafter's id in manifests; ``entry_raw``: the entry record, opened
        """The candidate entry's manifest if it serves at this length, the caller can use it and the entry record
        carries the checksum it pins; else None (a mismatching record is dropped from the server)."""
        ek, manifests = cand.entry_key, seen.manifests
        man = manifests.get(ek)
        if man is None:
            self.health.add("vanished")  # a node still lists the tail, the checkpoint was evicted
            return None
        if man["len"] != cand.length or man["minr"] > cand.length:
            manifests[ek] = None  # not usable at this length
            return None
        if usable is not None and not usable(cand.hit(manifests, drafter)):
            return None  # the caller cannot use it; a shorter candidate may serve
        if entry_raw is None:
            self.health.add("vanished")
            manifests[ek] = None
            return None
        man_name = self.keys.manifest(ek, cand.group)
        if seen.loose and isinstance(entry_raw, bytes) and self._pin(man_name, b"sum", entry_raw) != man["sum"]:
            self.health.add("vanished")  # not one snapshot: the record may have been replaced meanwhile
            manifests[ek] = None
            return None
        if not isinstance(entry_raw, bytes) or self._pin(man_name, b"sum", entry_raw) != man["sum"]:
            name = self.keys.entry(ek, cand.group)
            self._corrupt_key(name, seen.wire.get(name, entry_raw), "entry record does not match its manifest",
                              warnings)
            seen.unusable.add(ek)
            return None
        return man

    def _attachment(self, dkey: bytes, draft_raw, pinned: bytes, length: int, warnings: list[str],
                    group: bytes | None, man_name: bytes, field: bytes, seen: "_Seen") -> CheckpointAttachment | None:
        """The drafter part if its record is there and carries the checksum its manifest pins; else None (the
        target part still serves)."""
        name = self.keys.draft(dkey, group)
        wire = seen.wire.get(name, draft_raw)
        if draft_raw is None:
            self.health.add("vanished")
        elif not isinstance(draft_raw, bytes) or self._pin(man_name, field, draft_raw) != pinned:
            self._corrupt_key(name, wire, "drafter record does not match its manifest", warnings)
        else:
            try:
                return attachment_of(dkey, draft_raw, length, warnings)
            except CorruptRecord as exc:
                self._corrupt_key(name, wire, str(exc), warnings)
        return None

    def _manifest(self, ns_key: bytes, key: bytes, raw, warnings: list[str], group: bytes | None = None) -> dict | None:
        """A parsed, checked manifest; None if missing or bad (a bad one is removed from the server)."""
        if isinstance(raw, dict) and not raw:
            return None
        name = self.keys.manifest(key, group)
        try:
            if not isinstance(raw, dict):
                raise CorruptRecord("not a hash")
            self.keys.auth.check_manifest(name, ns_key, raw)
            length, minr, total = int(raw[b"len"]), int(raw[b"minr"]), int(raw[b"bytes"])
            checksum = raw[b"sum"]
            if len(checksum) != 32 or length < 1 or not 0 <= minr <= length or total < 0:
                raise CorruptRecord("fields out of range")
            drafters = {}
            for name, value in raw.items():
                if name.startswith(b"d:"):
                    if len(value) != 32:
                        raise CorruptRecord("bad drafter checksum")
                    drafters[name[2:].decode("utf-8")] = value
        except Unauthentic as exc:
            self._unauthentic(name, None, "manifest", str(exc), warnings, "hash")
            return None
        # damaged: a check failed (CorruptRecord), a field is missing, no number or not UTF-8
        except (CorruptRecord, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            self._corrupt_key(name, None, f"manifest is unreadable ({exc})", warnings, "hash")
            return None
        return {"len": length, "minr": minr, "sum": checksum, "drafters": drafters, "bytes": total}

    def _corrupt_key(self, name: bytes, raw, reason: str, warnings: list[str] | None, kind: str = "string") -> None:
        """Count a corrupt server value and remove it if it still holds what was read (``kind``: its proper type)."""
        self.health.add("corrupt")
        message = f"shared tier: dropping corrupt {name.decode('ascii', 'replace')[:60]}: {reason}"
        log.warning(message)
        if warnings is not None:
            warnings.append(message)
        digest = hashlib.sha1(raw).hexdigest() if isinstance(raw, bytes) else ""
        try:
            self._delete_if_unchanged(keys=[name], args=[kind, digest])
        except self._failures as exc:
            log.warning("shared tier: could not remove %s: %s", name[:60], exc)


def _wrong_type(reply) -> bool:
    """Whether a pipeline reply is the error of a key holding another type (a damaged value, not a failure)."""
    return isinstance(reply, Exception) and "WRONGTYPE" in str(reply)


def _failed_reply(reply) -> bool:
    """True for a WRONGTYPE error reply (the caller treats the value as corrupt); any other error is raised."""
    if isinstance(reply, Exception):
        if _wrong_type(reply):
            return True
        raise reply
    return False


def _int(raw, default: int) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default
