"""The write path of ``SharedTier``: publish committed local checkpoints, all of one or none of it.

On the write-behind thread: the committed local checkpoint is read back from LMDB (and verified), the chunks the
server lacks are uploaded (``SET NX`` with an orphan TTL, batched), and one Lua script (``scripts.COMMIT``) checks
that every chunk is there and commits the entry, drafter records, manifest, node hashes and signature atomically.
A chunk evicted between upload and commit makes the script write nothing; it is uploaded once more, then the
checkpoint is given up (counted). On a cluster all of this goes to the checkpoint's group (one hash slot, see
``keys.py``); the namespace's signature set and the stats hash are updated after the commit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

from .. import keys as K
from ..errors import CorruptRecord, StoreError
from .records import Outgoing, read_chunks, read_outgoing, record_checksum

log = logging.getLogger("spec_cache.shared")

UPLOAD_BATCH_BYTES = 32 << 20
#: members a namespace's signature set may hold before a publish trims it (a namespace has one signature per
#: layer structure: a few). Trimmed: members that fail authentication or carry none (keyed formats; bare ones
#: came from older hosts, which add theirs again), members whose chain has no root node (unkeyed, one server)
SIG_SET_CAP = 64
TRIM_SCAN_COUNT = 1000  # members per SSCAN step (and per SREM) while trimming


@dataclass(frozen=True)
class PublishJob:
    entry_key: bytes
    drafters: tuple[str, ...]
    tenant: bytes = b""  # the tenant whose share of the queue it counts against (``SpecCache.tenant_of``)
    nbytes: int = 0


class PublishMixin:
    """``SharedTier``'s publishing (needs ``config``, ``keys``, ``health``, ``_write``, ``_commit``, ``_queue``,
    ``_shares``, ``_store``, ``host_id``, ``_redis`` and ``_failed`` from the tier).
    Records leave sealed by ``keys.auth``."""

    def enqueue(self, entry_key: bytes, drafters: Iterable[str], nbytes: int, tenant: bytes = b"") -> bool:
        """Queue a committed local checkpoint for publishing; never blocks. False if dropped.

        A full queue drops what it is offered, unless the offering ``tenant`` is within its share of the cap (the
        cap divided by the tenants with something queued, itself included) while another holds more than that:
        then that tenant's oldest queued checkpoints are dropped instead (each counted as ``dropped_full``;
        ``store.background.TenantShares``), so one tenant's flood of checkpoints pays its own back-pressure and
        never keeps another's from the fleet (issue 37, ninth attacker pass: A's checkpoints filled the queue
        while Redis lagged, and B's were dropped).
        One tenant alone: exactly as before."""
        if self._queue is None:
            return False
        if not self.health.available():
            self.health.add("dropped_down")
            return False
        job = PublishJob(entry_key, tuple(drafters), tenant, nbytes)
        queued, dropped = self._shares.offer(self._queue, job, nbytes, tenant, lambda j: j.tenant)
        for _ in range(dropped):
            self.health.add("dropped_full")
        if queued:
            self.health.add("queued")
            return True
        self.health.add("dropped_full")
        return False

    def _publish(self, job: PublishJob) -> None:
        try:
            self._publish_one(job)
        finally:
            self._shares.finished(job.tenant, job.nbytes)

    def _publish_one(self, job: PublishJob) -> None:
        if not self.health.available():
            self.health.add("dropped_down")
            return
        try:
            out = read_outgoing(self._store, job.entry_key, job.drafters)
        except CorruptRecord as exc:
            self.health.add("corrupt")
            log.warning("shared tier: local checkpoint not published, a record is corrupt: %s", exc)
            return
        except StoreError as exc:
            self.health.add("publish_failed")
            log.warning("shared tier: local checkpoint could not be read for publishing: %s", exc)
            return
        if out is None:
            self.health.add("dropped_gone")
            return
        try:
            self.publish(out)
        except self._failures as exc:
            self.health.add("publish_failed")
            self._failed(exc, "a publish", None)

    def publish(self, out: Outgoing) -> bool:
        """Upload what the server lacks and commit the checkpoint atomically (worker thread; raises RedisError)."""
        chunk_keys = out.chain[1:]
        group = self.keys.group_of(out.chain)
        for attempt in range(2):
            missing = chunk_keys
            if chunk_keys:
                pipe = self._write.pipeline(transaction=False)
                for key in chunk_keys:
                    pipe.exists(self.keys.chunk(key, group))
                missing = [key for key, there in zip(chunk_keys, pipe.execute()) if not there]
            self.health.add("chunks_present", len(chunk_keys) - len(missing))
            if missing:
                try:
                    records = read_chunks(self._store, missing)
                except CorruptRecord as exc:
                    self.health.add("corrupt")
                    log.warning("shared tier: local chunk not published, it is corrupt: %s", exc)
                    return False
                if records is None:
                    self.health.add("dropped_gone")
                    return False
                self._upload(records, group)
            result = self._commit(keys=self._commit_keys(out, group), args=self._commit_args(out, group))
            if result and int(result[0]) == 1:
                members = int(result[1]) if len(result) > 1 else 0
                if self.keys.cluster:  # outside the script: other slots (a reader needs the signature first)
                    sigs = self.keys.sigs(out.ns)
                    pipe = self._write.pipeline(transaction=False)
                    pipe.sadd(sigs, self.keys.auth.sig_member(sigs, out.sig))
                    pipe.scard(sigs)
                    pipe.hincrby(self.keys.stats(), "checkpoints", 1)
                    pipe.hincrby(self.keys.stats(), "bytes", out.nbytes)
                    if self._fingerprint_field:
                        pipe.hincrby(self.keys.stats(), self._fingerprint_field, 1)
                    replies = pipe.execute(raise_on_error=False)
                    for i, reply in enumerate(replies):
                        if isinstance(reply, Exception) and i != 1:  # SCARD may be refused by an older ACL
                            raise reply
                    members = replies[1] if isinstance(replies[1], int) else 0
                if members > SIG_SET_CAP:
                    try:
                        self._trim_sigs(out.ns, out.sig)
                    except self._failures as exc:  # e.g. an ACL without +sscan/+srem: the commit stands
                        log.warning("shared tier: could not trim a signature set: %s", exc)
                self.health.add("published")
                self.health.add("bytes_published", out.nbytes)
                self.health.ok()
                return True
            self.health.add("publish_retried")  # chunks evicted between upload and commit: upload again
        self.health.add("publish_failed")
        return False

    @property
    def _fingerprint_field(self) -> str:
        """The ``stats`` field counting this secret's publishes (``fp:<fingerprint>``; '' without a secret)."""
        fp = self.keys.auth.fingerprint()
        return f"fp:{fp}" if fp else ""

    def _trim_sigs(self, ns: bytes, own: bytes) -> int:
        """Bring the namespace's signature set back under ``SIG_SET_CAP`` (publisher thread): remove the members a
        reader would never use first (``SIG_SET_CAP``'s comment). Why here: a reader considers at most
        ``MAX_SIGNATURES`` members, so a set flooded with garbage would cost every lookup the flood's transfer;
        the publisher, off the decoding path, holds the secret to tell members apart. Returns members removed."""
        name = self.keys.sigs(ns)
        auth = self.keys.auth
        keep = auth.sig_member(name, own)
        removed, batch = 0, []
        for member in self._write.sscan_iter(name, count=TRIM_SCAN_COUNT):
            if member != keep:
                batch.append(member)
            if len(batch) >= TRIM_SCAN_COUNT:
                removed += self._drop_members(ns, name, batch)
                batch = []
        if batch:
            removed += self._drop_members(ns, name, batch)
        if removed:
            log.warning("shared tier: removed %d unusable members from a namespace's signature set (over %d; "
                        "forged, or written by hosts without this fleet's secret)", removed, SIG_SET_CAP)
        return removed

    def _drop_members(self, ns: bytes, name: bytes, members: list[bytes]) -> int:
        """SREM those of ``members`` no reader would use (see ``SIG_SET_CAP``); one or two round trips."""
        auth = self.keys.auth
        if auth.keyed:
            doomed = [m for m in members if auth.sig_of(name, m)[1] != "ok"]
        elif self.keys.cluster:
            doomed = []  # a cluster's root nodes lie in the groups' slots: nothing cheap tells garbage apart
        else:
            pipe = self._write.pipeline(transaction=False)
            for member in members:
                pipe.exists(self.keys.node(K.root_key(ns, member)))
            doomed = [m for m, there in zip(members, pipe.execute()) if not there]
        return int(self._write.srem(name, *doomed)) if doomed else 0

    def _upload(self, records: dict[bytes, bytes], group: bytes | None = None) -> None:
        pipe, batch = self._write.pipeline(transaction=False), 0
        for key, raw in records.items():
            name = self.keys.chunk(key, group)
            pipe.set(name, self.keys.auth.seal(name, raw), nx=True, ex=self.config.orphan_ttl_s)
            batch += len(raw)
            self.health.add("chunks_uploaded")
            self.health.add("bytes_published", len(raw))
            if batch >= UPLOAD_BATCH_BYTES:
                pipe.execute()
                pipe, batch = self._write.pipeline(transaction=False), 0
        if batch:
            pipe.execute()

    def _commit_keys(self, out: Outgoing, group: bytes | None) -> list[bytes]:
        k = self.keys
        man = k.manifest(out.entry_key, group)
        index = [man, man] if k.cluster else [k.sigs(out.ns), k.stats()]  # a cluster's script stays in one slot
        return ([man, k.entry(out.entry_key, group), *index]
                + [k.draft(dkey, group) for _, dkey, _ in out.drafts]
                + [k.chunk(key, group) for key in out.chain[1:]]
                + [k.node(key, group) for key in out.chain])

    def _commit_args(self, out: Outgoing, group: bytes | None) -> list:
        k, auth = self.keys, self.keys.auth
        man = k.manifest(out.entry_key, group)
        pinned = auth.pin(man, b"sum", record_checksum(out.entry_record))
        fields = auth.manifest_fields(man, out.ns, out.length, out.minr, pinned, out.nbytes)
        args = [len(out.drafts), len(out.chain) - 1, auth.seal(k.entry(out.entry_key, group), out.entry_record),
                len(fields) // 2, out.minr, 1 if out.complete else 0, auth.sig_member(k.sigs(out.ns), out.sig),
                out.tail, self.host_id, time.time_ns() // 1_000_000, out.nbytes, 0 if k.cluster else 1,
                self._fingerprint_field, *fields]
        for dns, dkey, record in out.drafts:
            field = b"d:" + auth.drafter_id(dns).encode("utf-8")
            args += [field, auth.pin(man, field, record_checksum(record)), auth.seal(k.draft(dkey, group), record)]
        return args
