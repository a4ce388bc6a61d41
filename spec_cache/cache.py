"""``SpecCache``: the runtime's view of a store — namespaces, save and restore of mlx-lm state.

It turns mlx-lm caches and drafter checkpoints into store records and back, and turns every storage
failure into a miss plus a warning: a cache may miss, it never takes the inference engine down.

With ``shared=`` (a Redis/Valkey URL) the store is the local tier of a fleet: a checkpoint saved here is queued
for publishing (write-behind, never blocking), and a lookup that the local store cannot serve in full asks the
shared tier for a longer prefix, verifies it, uses it at once and promotes it into LMDB in the background
(see docs/SHARED_TIER.md).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from spec_cache.schemas import DraftRowCheckpoint, SchemaError
from spec_cache.store import InvalidInput, PutResult, Store, StoreError
from spec_cache.store.keys import pack_tokens

from .cache_state import (attachment_to_store, capture_caches, checkpoint_from_store, restore_caches,
                          restore_concat)
from .namespace import namespace_key

log = logging.getLogger("spec_cache")


class CacheWarning(UserWarning):
    """A stored entry could not be used or written; the request went on without it."""


@dataclass
class RestoredPrefix:
    """What a lookup gave back: ``length`` tokens of target state and, if stored, this drafter's row."""

    length: int
    caches: list[Any]
    draft_checkpoint: DraftRowCheckpoint | None
    warnings: list[str] = field(default_factory=list)


class SpecCache:
    """A store opened for inference. ``SpecCache.open(path, max_bytes=None, shared=None)``; close() or ``with``."""

    def __init__(self, store: Store, shared=None):
        self.store = store
        self.shared = shared  # a store.shared.SharedTier, or None
        self._registered: dict[bytes, tuple[str, str, bool]] = {}  # key -> what register_namespace was told
        self._promoter = None
        if shared is not None:  # promotion off the request's path: the restored state is used at once
            from spec_cache.store.shared.queue import WriteBehind

            self._promoter = WriteBehind(shared.config.queue_bytes, self._promote, name="spec-cache-promote")

    @classmethod
    def open(cls, path, max_bytes: int | None = None, *, shared=None, shared_options: dict | None = None,
             **kwargs) -> "SpecCache":
        """Open the local store at ``path``; ``shared`` is a Redis/Valkey URL (or a ``SharedConfig``).

        ``shared_options`` overrides ``SharedConfig`` fields (``timeout_s``, ``queue_bytes``, ``prefix``, ...).
        A bad URL raises ``StoreError`` here; a server that is down is not an error (lookups miss until it is up).
        """
        store = Store.open(path, max_bytes=max_bytes, **kwargs)
        if shared is None:
            return cls(store)
        try:
            from spec_cache.store.shared import SharedConfig, SharedTier

            tier = SharedTier(SharedConfig.of(shared, **(shared_options or {})), store)
        except BaseException:
            store.close()
            raise
        return cls(store, tier)

    def close(self) -> None:
        if self.shared is not None:
            self._promoter.close(self.shared.config.close_timeout_s)
            self.shared.close()  # publishes what is queued first (bounded by close_timeout_s)
        self.store.close()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until background promotions and publishes are done; True if nothing is left."""
        if self.shared is None:
            return True
        return self._promoter.drain(timeout) and self.shared.drain(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def shared_status(self) -> dict | None:
        """The shared tier's state and counters as this process sees them (None without a shared tier)."""
        return None if self.shared is None else self.shared.status()

    def namespace(self, target_identity: str, prefix_namespace: str, tenant: str | bytes | None = None) -> bytes:
        """The store key for (target, prefix namespace, tenant), registered for ``ls``/``show``."""
        key = namespace_key(target_identity, prefix_namespace, tenant)
        if key not in self._registered:
            self.store.register_namespace(key, target=target_identity, prefix_namespace=prefix_namespace,
                                          tenant=tenant is not None)
            self._registered[key] = (target_identity, prefix_namespace, tenant is not None)
        return key

    def save(self, ns_key: bytes, tokens: Sequence[int], caches: Sequence[Any], *,
             drafter_namespace: str | None = None, draft_checkpoint: DraftRowCheckpoint | None = None,
             minimum_reusable: int = 0) -> PutResult | None:
        """Store a checkpoint (and queue it for the shared tier); on any failure warn and return None."""
        try:
            drafter = None
            if draft_checkpoint is not None and drafter_namespace is not None:
                if draft_checkpoint.processed_tokens != len(tokens):
                    raise InvalidInput(f"drafter checkpoint covers {draft_checkpoint.processed_tokens} tokens, "
                                       f"target state {len(tokens)}")
                drafter = (drafter_namespace, attachment_to_store(draft_checkpoint))
            layers = capture_caches(caches)
            try:
                result = self.store.put(ns_key, tokens, layers, drafter=drafter, minimum_reusable=minimum_reusable)
            except InvalidInput as exc:
                if ns_key not in self._registered or "not registered" not in str(exc):
                    raise
                # gc (or another process's repair) dropped the namespace row since we registered it
                target, prefix, tenant = self._registered[ns_key]
                self.store.register_namespace(ns_key, target=target, prefix_namespace=prefix, tenant=tenant)
                result = self.store.put(ns_key, tokens, layers, drafter=drafter, minimum_reusable=minimum_reusable)
        except (StoreError, SchemaError, TypeError, ValueError) as exc:
            warnings.warn(f"spec-cache: checkpoint of {len(tokens)} tokens not stored: {exc}", CacheWarning,
                          stacklevel=2)
            return None
        if self.shared is not None:
            nbytes = sum(layer.nbytes for layer in layers)
            if drafter is not None:
                nbytes += sum(t.nbytes for t in drafter[1].tensors)
            self.shared.enqueue(result.entry, [drafter[0]] if drafter is not None else [], nbytes)
        return result

    def restore(self, ns_key: bytes, tokens: Sequence[int], *, drafter_namespace: str | None = None,
                ) -> RestoredPrefix | None:
        """The longest usable stored prefix of ``tokens`` as mlx-lm caches (+ drafter row), or None.

        With a shared tier: when the local store does not cover every token, the shared tier is asked for a
        longer prefix; one found there is verified and returned, and promoted into the local store in the
        background (``drain()`` waits for that). Anything wrong with the shared tier falls back to the local store.
        """
        if self.shared is not None:
            local = 0
            try:
                hit = self.store.lookup(ns_key, tokens, drafter=drafter_namespace)
                local = 0 if hit is None else hit.length
            except (StoreError, ValueError) as exc:
                warnings.warn(f"spec-cache: local lookup failed, asking the shared tier: {exc}", CacheWarning,
                              stacklevel=2)
            if local < len(tokens):
                restored = self._restore_shared(ns_key, tokens, drafter_namespace, local)
                if restored is not None:
                    return restored
        return self._restore_local(ns_key, tokens, drafter_namespace)

    def _restore_local(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None,
                       ) -> RestoredPrefix | None:
        notes: list[str] = []
        try:
            restored = self.store.fetch(ns_key, tokens, drafter=drafter_namespace, warnings=notes,
                                        concat=restore_concat())
        except (StoreError, SchemaError, ValueError) as exc:
            warnings.warn(f"spec-cache: lookup failed, treated as a miss: {exc}", CacheWarning, stacklevel=3)
            return None
        for message in notes:
            warnings.warn(f"spec-cache: {message}", CacheWarning, stacklevel=3)
        if restored is None:
            return None
        return self._rebuild(restored.length, restored.layers, restored.attachment, list(restored.warnings))

    def _restore_shared(self, ns_key: bytes, tokens: Sequence[int], drafter_namespace: str | None, floor: int,
                        ) -> RestoredPrefix | None:
        """A prefix longer than ``floor`` from the shared tier, promoted into the local store; None otherwise."""
        notes: list[str] = []
        try:
            packed = pack_tokens(tokens)
        except StoreError as exc:
            warnings.warn(f"spec-cache: lookup failed, treated as a miss: {exc}", CacheWarning, stacklevel=3)
            return None
        try:
            got = self.shared.restore(ns_key, packed, chunk_tokens=self.store.chunk_tokens,
                                      drafter=drafter_namespace, floor=floor, warnings=notes)
        except Exception as exc:  # the last line of defence: a value from the network must never stop a request
            log.exception("spec-cache: shared tier lookup failed unexpectedly")
            self.shared.health.add("errors")
            notes.append(f"shared tier lookup failed unexpectedly ({type(exc).__name__}: {exc}), treated as a miss")
            got = None
        for message in notes:
            warnings.warn(f"spec-cache: {message}", CacheWarning, stacklevel=3)
        if got is None:
            return None
        restored = self._rebuild(got.length, got.layers, got.attachment, notes)
        if restored is not None:
            job = (ns_key, packed[:got.length], got, drafter_namespace)
            if not self._promoter.offer(job, got.nbytes):
                self.shared.health.add("promote_dropped")
        return restored

    def _promote(self, job) -> None:
        """Background: store a prefix restored from the shared tier through the store's own write path."""
        ns_key, packed, got, drafter_namespace = job
        drafter = (drafter_namespace, got.attachment) if got.attachment is not None else None
        try:
            self.store.put(ns_key, packed, got.layers, drafter=drafter, minimum_reusable=got.minimum_reusable)
            self.shared.health.add("promoted")
        except (StoreError, SchemaError, TypeError, ValueError) as exc:
            self.shared.health.add("promote_failed")
            log.warning("spec-cache: prefix from the shared tier used but not stored locally: %s", exc)

    @staticmethod
    def _rebuild(length: int, layers, attachment, notes: list[str]) -> RestoredPrefix | None:
        try:
            caches = restore_caches(layers)
            cp = None
            if attachment is not None:
                cp = checkpoint_from_store(length, attachment)
        except (ValueError, TypeError, KeyError) as exc:
            warnings.warn(f"spec-cache: stored state could not be rebuilt, treated as a miss: {exc}", CacheWarning,
                          stacklevel=4)
            return None
        return RestoredPrefix(length, caches, cp, notes)
