"""``SpecCache``: the runtime's view of a store — namespaces, save and restore of mlx-lm state.

It turns mlx-lm caches and drafter checkpoints into store records and back, and turns every storage
failure into a miss plus a warning: a cache may miss, it never takes the inference engine down.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from schemas import DraftRowCheckpoint, SchemaError
from store import InvalidInput, PutResult, Store, StoreError

from .cache_state import attachment_to_store, capture_caches, checkpoint_from_store, restore_caches
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
    """A store opened for inference. ``SpecCache.open(path, max_bytes=None)``; close() or use ``with``."""

    def __init__(self, store: Store):
        self.store = store
        self._registered: set[bytes] = set()

    @classmethod
    def open(cls, path, max_bytes: int | None = None, **kwargs) -> "SpecCache":
        return cls(Store.open(path, max_bytes=max_bytes, **kwargs))

    def close(self) -> None:
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def namespace(self, target_identity: str, prefix_namespace: str, tenant: str | bytes | None = None) -> bytes:
        """The store key for (target, prefix namespace, tenant), registered for ``ls``/``show``."""
        key = namespace_key(target_identity, prefix_namespace, tenant)
        if key not in self._registered:
            self.store.register_namespace(key, target=target_identity, prefix_namespace=prefix_namespace,
                                          tenant=tenant is not None)
            self._registered.add(key)
        return key

    def save(self, ns_key: bytes, tokens: Sequence[int], caches: Sequence[Any], *,
             drafter_namespace: str | None = None, draft_checkpoint: DraftRowCheckpoint | None = None,
             minimum_reusable: int = 0) -> PutResult | None:
        """Store a checkpoint; on any failure warn and return None (the request goes on)."""
        try:
            drafter = None
            if draft_checkpoint is not None and drafter_namespace is not None:
                if draft_checkpoint.processed_tokens != len(tokens):
                    raise InvalidInput(f"drafter checkpoint covers {draft_checkpoint.processed_tokens} tokens, "
                                       f"target state {len(tokens)}")
                drafter = (drafter_namespace, attachment_to_store(draft_checkpoint))
            return self.store.put(ns_key, tokens, capture_caches(caches), drafter=drafter,
                                  minimum_reusable=minimum_reusable)
        except (StoreError, SchemaError, TypeError, ValueError) as exc:
            warnings.warn(f"spec-cache: checkpoint of {len(tokens)} tokens not stored: {exc}", CacheWarning,
                          stacklevel=2)
            return None

    def restore(self, ns_key: bytes, tokens: Sequence[int], *, drafter_namespace: str | None = None,
                ) -> RestoredPrefix | None:
        """The longest usable stored prefix of ``tokens`` as mlx-lm caches (+ drafter row), or None."""
        notes: list[str] = []
        try:
            restored = self.store.fetch(ns_key, tokens, drafter=drafter_namespace, warnings=notes)
        except (StoreError, SchemaError, ValueError) as exc:
            warnings.warn(f"spec-cache: lookup failed, treated as a miss: {exc}", CacheWarning, stacklevel=2)
            return None
        for message in notes:
            warnings.warn(f"spec-cache: {message}", CacheWarning, stacklevel=2)
        if restored is None:
            return None
        try:
            caches = restore_caches(restored.layers)
            cp = None
            if restored.attachment is not None:
                cp = checkpoint_from_store(restored.length, restored.attachment)
        except (ValueError, TypeError, KeyError) as exc:
            warnings.warn(f"spec-cache: stored state could not be rebuilt, treated as a miss: {exc}", CacheWarning,
                          stacklevel=2)
            return None
        return RestoredPrefix(restored.length, caches, cp, list(restored.warnings))
