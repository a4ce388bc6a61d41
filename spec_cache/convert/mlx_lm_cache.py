"""A persistent, verified prompt cache for ``mlx_lm.server``: ``LRUPromptCache``'s interface over ``SpecCache``.

``mlx_lm.server`` keeps its prompt cache in an in-RAM ``LRUPromptCache``; :class:`SpecCachePromptCache` is a
subclass with the same methods, signatures and return shapes (checked against the pinned mlx-lm 0.32.2):

* ``fetch_nearest_cache(model_key, tokens) -> (cache | None, rest_tokens)``: the longest stored prefix of
  ``tokens[:-1]`` from the memory tier, the local LMDB store (verified on read) or the shared tier, as fresh
  mlx-lm cache objects (new array objects over the held ones: whatever the server does to them, stored state
  never changes); ``rest_tokens`` are the tokens the caller still has to prefill, never empty (mlx-lm's
  ``generate_step`` refuses an empty prompt, and its own cache trims a longer entry to ``len(tokens) - 1`` too).
  While LMDB can hold nothing the memory tier lacks (no shared tier, the namespace empty in LMDB when this process
  first met it, no memory-tier entry evicted, demoted or refused since), the memory tier alone answers: no LMDB
  lookup, so a fetch never waits for the write-behind thread's commit (it holds the store's lock). Otherwise
  (after a restart, an eviction) a hit on a whole memory-tier entry (the conversation's previous turn) is served
  without LMDB while a write is queued or committing; a partial hit (a shared system prompt) asks LMDB.
* ``insert_cache(model_key, tokens, prompt_cache, *, cache_type=...)``: the checkpoint enters the memory tier at
  once and is written to LMDB behind the request (``SpecCache.save(..., background=True)``: on the request thread
  only lazy MLX slices and a queued evaluation, never a wait for the device; the device-to-host copy, encoding
  and commit run on the write-behind thread; the exit drain writes what is queued), keyed by the
  tokens the cache really covers: the layers' offset; with ``--draft-model`` (target and draft layers left at
  different offsets by speculative decoding) every layer cut to the smallest one; for a list of recurrent
  ``ArraysCache`` layers only (no offset), the key's length (exact-length checkpoints, restored only whole).
  A list whose coverage cannot be told (layers that disagree and cannot be trimmed) stays in RAM exactly as
  ``LRUPromptCache`` keeps it.
* ``__len__``, ``nbytes``, ``stats_by_type()``: the in-RAM fallback plus the memory tier (its own row,
  ``spec-cache``), counted as ``LRUPromptCache`` counts: a trimmable entry replaces its shorter prefixes (the
  memory tier drops them once they are in LMDB; until then they are not counted). ``nbytes`` counts the rows
  held (exactly the covered tokens), not mlx-lm's 256-token step buffers. ``trim_to`` and ``max_size`` /
  ``max_bytes`` (``--prompt-cache-size`` / ``--prompt-cache-bytes``) bound the in-RAM fallback as they bound
  ``LRUPromptCache``; the memory tier has its own byte budget (the launcher's ``--memory-bytes``, else
  ``--prompt-cache-bytes``) and never drops a checkpoint LMDB lacks.

A restored ``KVCache``'s ``state`` (keys, values) holds exactly ``offset`` rows, where mlx-lm's own (and its deep
copy) hold a buffer padded to a multiple of 256; generation reads only the first ``offset`` rows and grows the
buffer on the next write either way, so replies do not change.

With ``--draft-model``, a restore reuses the tokens *both* models have processed. When a new prompt extends a
whole previous turn, ``mlx_lm.server`` counts the turn's key instead: when the draft model accepted every drafted
token of the last round (its layers one token behind the target's) it reports one cached token more than this
cache does, with the same reply (the extra token is prefilled here); when the last round ended on a rejected
token, the key's last token was processed by neither model and mlx-lm 0.32.2 still counts it as cached and never
processes it (its reply can differ from an uncached run; this cache prefills it).

The namespace of a model key ``(model_path, adapter_path, draft_model_path)`` is the model's artifact identity
(``spec_cache.naming.identity.model_identity`` of the directory mlx-lm loaded), the adapter stack's namespace, the KV
options the server quantizes with (``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start``), method None,
through ``spec_cache.naming.namespace.resolve_prefix_namespace`` (the definition ``Generator.load`` and the mlx-lm
import use). With a draft model the cache list also holds the draft model's layers: the method is then
``mlx-lm-draft-v1:<draft identity>``, so such entries never mix with target-only ones.

Cache kinds spec-cache cannot store (``ChunkedKVCache``, ``CacheList``, batch caches, ...), model keys whose
directory cannot be identified, and token keys that are not token ids (vision keys) fall back to the original
in-RAM behaviour of ``LRUPromptCache`` with a one-time warning.
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence

from mlx_lm.models.cache import LRUPromptCache

from spec_cache.naming.namespace import KVOptions, drafter_namespace, resolve_prefix_namespace
from spec_cache.tiers.cache import RestoredPrefix, SpecCache

log = logging.getLogger("spec_cache.mlx_lm")

__all__ = ["DRAFT_SCHEMA", "SpecCachePromptCache", "kv_options_from_args", "resolve_model_dir"]

#: the drafter-namespace schema of an mlx-lm draft model's layers appended to the target's cache list
DRAFT_SCHEMA = "mlx-lm-draft-v1"
_MAX_TOKEN = 2**32 - 1


def _storable_classes() -> tuple[type, ...]:
    from spec_cache.state.cache_kinds import cache_types

    return cache_types()


def kv_options_from_args(args: Any) -> KVOptions:
    """The KV options ``mlx_lm.server``'s arguments quantize with (none without ``--kv-bits``)."""
    bits = getattr(args, "kv_bits", None)
    if bits is None:
        return KVOptions()
    return KVOptions(kv_bits=int(bits), kv_group_size=getattr(args, "kv_group_size", None),
                     quantized_kv_start=getattr(args, "quantized_kv_start", None))


def resolve_model_dir(path_or_repo: str | Path) -> Path:
    """The local directory mlx-lm loaded ``path_or_repo`` from (a directory, or a Hugging Face repo already in the
    local cache: ``mlx_lm.utils._download`` resolves it the same way). Raises when there is none."""
    path = Path(path_or_repo)
    if path.exists():
        return path
    from mlx_lm.utils import hf_repo_to_path

    return Path(hf_repo_to_path(str(path_or_repo)))


class SpecCachePromptCache(LRUPromptCache):
    """``mlx_lm.models.cache.LRUPromptCache`` backed by a ``SpecCache`` (memory tier, LMDB, shared tier).

    ``cache``: an open ``SpecCache`` (closed by ``close()`` only when ``owns_cache``). ``kv_options``: the
    server's KV options (:func:`kv_options_from_args`). ``tenant``: an optional namespace salt. ``max_size`` and
    ``max_bytes`` bound the in-RAM fallback exactly as they bound ``LRUPromptCache``.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *, cache: SpecCache,
                 kv_options: KVOptions | None = None, tenant: str | None = None, owns_cache: bool = False):
        super().__init__(max_size, max_bytes)
        self.cache = cache
        self.kv_options = kv_options if kv_options is not None else KVOptions()
        self.tenant = tenant
        self.owns_cache = owns_cache
        self._ns: dict[Any, Optional[bytes]] = {}  # model key -> namespace key (None: in-RAM fallback)
        self._fresh: dict[bytes, tuple] = {}  # namespace -> memory-tier drop counters when LMDB held none of it
        self._ram_models: set = set()  # model keys whose cache kinds cannot be stored
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.counters = {"fetches": 0, "hits": 0, "hit_tokens": 0, "inserts": 0, "fallback_fetches": 0,
                         "fallback_inserts": 0}
        self.last_hit_tier: Optional[str] = None

    # --- namespace ------------------------------------------------------------------------------
    def namespace_for(self, model: Any) -> Optional[bytes]:
        """The store namespace of a server model key, or None (the in-RAM fallback serves it)."""
        if model in self._ns:
            return self._ns[model]
        with self._lock:
            if model not in self._ns:
                self._ns[model] = self._resolve(model)
        return self._ns[model]

    def _resolve(self, model: Any) -> Optional[bytes]:
        from spec_cache.naming.identity import model_identity
        from spec_cache.rows.adapters import resolve_adapters

        try:
            model_path, adapter_path, draft_path = model
        except (TypeError, ValueError):
            self._warn_once("key", f"spec-cache: model key {model!r} is not (model, adapter, draft); "
                                   "prompt caches for it stay in RAM")
            return None
        if model_path is None:
            return None
        try:
            memo = self.cache.memo()
            identity = model_identity(resolve_model_dir(model_path), memo=memo)
            stack = resolve_adapters(adapter_path, memo) if adapter_path else ()
            provider = None
            if draft_path is not None:
                draft_identity = model_identity(resolve_model_dir(draft_path), memo=memo)
                provider = SimpleNamespace(namespace=drafter_namespace(DRAFT_SCHEMA, draft_identity),
                                           supports_target_adapters=True)
            prefix = resolve_prefix_namespace(provider, stack, self.kv_options)
            ns = self.cache.namespace(identity, prefix, self.tenant)
            info = self.cache.store.namespace_info(ns)
            if info is not None and info.entries == 0:  # nothing in LMDB yet: the memory tier sees all it gets
                self._fresh.setdefault(ns, _dropped(self.cache.memory))
            return ns
        except Exception as exc:  # an unidentifiable model never stops the server: it keeps the RAM cache
            self._warn_once(f"ns:{model!r}", f"spec-cache: cannot identify model {model_path!r} ({exc}); "
                                             "its prompt caches stay in RAM")
            return None

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning(message)

    # --- LRUPromptCache interface -----------------------------------------------------------------
    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        self.counters["fetches"] += 1
        self.last_hit_tier = None
        ns = None if model in self._ram_models else self.namespace_for(model)
        if ns is None or not _token_ids(tokens):
            self.counters["fallback_fetches"] += 1
            return super().fetch_nearest_cache(model, tokens)
        ram = None
        if len(self._lru):  # entries this process kept in RAM (their coverage or kinds could not be stored)
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is not None:
                ram = cache, rest
        # at least one token left to prefill: mlx-lm's generate_step refuses an empty prompt
        restored = self._restore(ns, list(tokens[:-1])) if len(tokens) >= 2 else None
        if restored is None or restored.length <= 0 or (ram is not None
                                                        and len(tokens) - len(ram[1]) >= restored.length):
            if ram is not None:  # the longer of the two
                self.counters["fallback_fetches"] += 1
                return ram
            return None, tokens
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += restored.length
        self.last_hit_tier = restored.tier
        return list(restored.caches), tokens[restored.length:]

    def _restore(self, ns: bytes, tokens: List[int]):
        """The longest stored prefix: from the memory tier alone while it holds everything LMDB could give (see
        :meth:`_memory_complete`) or while its hit is a whole entry and a write is pending (:meth:`_writing`),
        else ``SpecCache.restore`` (memory tier, then LMDB, then the shared tier).

        Why: an LMDB lookup takes the store's lock, which the write-behind thread holds for a whole commit (the
        previous turn's checkpoint, ~0.5 s for 256 MiB on an H200): the next request's fetch waited for it."""
        complete = self._memory_complete(ns)
        if not complete and not self._writing():
            return self.cache.restore(ns, tokens)
        if self.cache.closed:
            return None
        memory = self.cache.memory
        hit = memory.lookup(ns, tokens)
        still = complete and self._memory_complete(ns)  # (the lookup may demote an idle entry: LMDB may hold more)
        whole = hit is not None and hit.length == hit.entry.length  # a previous turn held whole, not a shared part
        if not still and not (whole and self._writing()):
            return self.cache.restore(ns, tokens)
        if hit is None:
            return None
        caches, _ = memory.take(hit)
        return RestoredPrefix(hit.length, caches, None, [], tier="memory")

    def _writing(self) -> bool:
        """Whether the write-behind thread has checkpoints queued or in a commit (which holds the store's lock).
        Then a whole memory-tier entry (a previous turn this process holds: the usual warm turn) is served without
        asking LMDB, which could hold a longer prefix only from another process or one the memory tier let go
        (reuse lost then, never correctness); a partial hit (a shared system prompt) still asks LMDB."""
        if self.cache.shared is not None or self.cache.memory.budget_bytes == 0:
            return False
        writes = self.cache.memory_stats()["writes"]  # (pending counts queued jobs; its bytes, the one in flight too)
        return writes.get("pending", 0) > 0 or writes.get("pending_bytes", 0) > 0

    def _memory_complete(self, ns: bytes) -> bool:
        """Whether LMDB can hold no prefix of namespace ``ns`` the memory tier lacks: no shared tier, the namespace
        held no entry when this process first resolved it, and the memory tier has not let go of an entry since
        (evicted, demoted, refused; a superseded one is served by its longer entry). Another process writing the
        same store directory meanwhile is not seen: its entries serve after this one restarts (or evicts)."""
        if self.cache.shared is not None or self.cache.memory.budget_bytes == 0:
            return False
        baseline = self._fresh.get(ns)
        return baseline is not None and baseline == _dropped(self.cache.memory)

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *,
                     cache_type: str = "assistant"):
        ns = None if model in self._ram_models else self.namespace_for(model)
        if ns is not None and not _token_ids(tokens):
            ns = None
        if ns is not None:
            storable = _storable_classes()
            odd = sorted({type(c).__name__ for c in prompt_cache if type(c) not in storable})
            if odd:
                self._ram_models.add(model)
                self._warn_once(f"kinds:{model!r}", f"spec-cache: cache kinds {', '.join(odd)} cannot be stored; "
                                                    "prompt caches for this model stay in RAM (mlx-lm's own cache)")
                ns = None
        if ns is None:
            self.counters["fallback_inserts"] += 1
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        coverage = _coverage(prompt_cache, len(tokens))
        if coverage is None:
            # the key does not say which tokens the state covers: kept in RAM as mlx-lm keeps it, never stored
            self.counters["fallback_inserts"] += 1
            offsets = sorted({getattr(c, "offset", None) for c in prompt_cache}, key=str)
            self._warn_once("coverage", f"spec-cache: which tokens a prompt cache covers cannot be told (layer "
                                        f"offsets {offsets}, a key of {len(tokens)} tokens); kept in RAM, not stored")
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        covered, caches = coverage
        self.counters["inserts"] += 1
        self.cache.save(ns, list(tokens[:covered]), caches, background=True)
        return None

    def __len__(self):
        return len(self._lru) + self.cache.memory.sequences()[0]

    @property
    def nbytes(self):
        return self._n_bytes + self.cache.memory.sequences()[1]

    def stats_by_type(self):
        result = super().stats_by_type()
        n, nbytes = self.cache.memory.sequences()
        result["spec-cache"] = {"n_sequences": n, "n_bytes": nbytes}
        return result

    # --- lifetime ----------------------------------------------------------------------------------
    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every inserted checkpoint is durable in LMDB (and published, with a shared tier)."""
        return self.cache.drain(timeout)

    def close(self) -> None:
        """Write what is queued and close the store (only when this object owns it)."""
        if self.owns_cache:
            self.cache.close()
        else:
            self.cache.drain()


def _dropped(memory) -> tuple:
    """The memory tier's counters of entries it let go of (LMDB may hold them; the memory tier no longer does)."""
    c = memory.counters
    return c["evicted"], c["demoted"], c["reclaimed"], c["refused"]


def _token_ids(tokens: Sequence[Any]) -> bool:
    """Whether ``tokens`` are plain token ids (mlx-lm's vision keys hold other things). C-speed loops (``set``,
    ``min``, ``max``): it runs on the request thread for every fetch and insert."""
    try:
        return not tokens or (set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= _MAX_TOKEN)
    except TypeError:
        return False


def _coverage(prompt_cache: Sequence[Any], n_tokens: int) -> Optional[tuple[int, list]]:
    """``(covered, caches)``: how many tokens of the key a cache list holds state for, and the layers to store,
    each covering exactly that many; None when that cannot be told (the caller keeps the list in RAM).

    * Attention layers say it (``offset``). With ``--draft-model`` the list is the target's layers then the draft
      model's, and speculative decoding leaves them at different offsets (the draft model one token behind when
      it accepted every drafted token; both behind the key, whose last token neither model has processed): every
      layer is trimmed to the smallest offset (new cache objects over the same arrays; the server's are left as
      they are), so target and draft parts resume from the same token.
    * Recurrent layers (``ArraysCache``) have no offset: in a list of only those the key is all there is to go by.
      ``mlx_lm.server`` hands its cache with exactly the tokens the model has processed when it decodes without a
      draft model (``generate_step`` processes each token before yielding it; the batch path's ``all_tokens`` are
      the processed ones), and a recurrent cache cannot be speculated on (mlx-lm refuses a non-trimmable cache).
    * Layers at different offsets that cannot be trimmed (a hybrid model's recurrent layers, a full rotating
      window), or an offset past the key: None.
    """
    offsets = [int(c.offset) if getattr(c, "offset", None) is not None else None for c in prompt_cache]
    known = [o for o in offsets if o is not None]
    if not known:
        return (n_tokens, list(prompt_cache)) if n_tokens > 0 and prompt_cache else None
    covered = min(known)
    if covered <= 0 or covered > n_tokens:
        return None
    if len(set(known)) == 1:
        return covered, list(prompt_cache)
    caches = []
    for cache, offset in zip(prompt_cache, offsets):
        if offset is None:  # a recurrent layer beside attention layers that disagree: its coverage is unknown
            return None
        if offset > covered:
            if not (hasattr(cache, "is_trimmable") and cache.is_trimmable()):
                return None
            cache = copy.copy(cache)  # the same arrays (read only up to the offset), its own offset
            if cache.trim(offset - covered) != offset - covered:
                return None
        caches.append(cache)
    return covered, caches
