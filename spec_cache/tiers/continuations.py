"""Persisted continuations: a generation killed part-way resumes, token-identically, when the same request comes again.

Why: the KV checkpoints a generation leaves (every ``checkpoint_every`` tokens and when it ends) survive a crash,
but only a record of *which tokens the request had generated* lets a retry continue instead of starting over.
Each checkpoint of a generating row writes one (``store.continuations``: a versioned record under a key over the
namespace key (target, drafter, adapters, KV options, tenant), the prompt, the sampling parameters and seed and
the EOS rule), after the checkpoint itself is committed to LMDB, and claiming no more tokens than it covers: the
record of a checkpoint of ``prompt + generated[:k-1]`` holds ``generated[:k]`` (the k-th token is the row's
pending token, never forwarded). In this process the record is visible at once (the memory tier holds the KV).

Resuming (``plan`` / ``trim``): the record's tokens (cut at ``max_tokens``) are replayed; when they end the
request (``max_tokens`` reached, or an EOS it stops at) nothing runs at all. Otherwise the row restores the
longest stored prefix of ``prompt + replay`` and replays only as many tokens as that restored state covers
(``trim``): the KV it continues from is the very state the interrupted run had there, so the tokens after it are
the ones an uninterrupted run emits (greedy; sampled too: ``RowSampler`` keys each position by the seed and the
position only). Under KV quantization only whole answers replay (the conversion point depends on the prompt's
length, so a longer "prompt" would convert elsewhere).

Library: ``Generator.generate(prompts, ..., checkpoint_every=N, resume=True)`` (``generate`` below); the server's
scheduler reads and writes the same records, so a retry after a restart resumes too.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from spec_cache.errors import InvalidRequest
from spec_cache.rows.generation import Result
from spec_cache.store import CONTINUATION_MAX_BYTES as MAX_BYTES
from spec_cache.store import CONTINUATION_MAX_RECORDS as MAX_RECORDS
from spec_cache.store import (
    Continuation,
    ContinuationTable,
    StoreError,
    continuation_key,
    continuation_params,
)

log = logging.getLogger("spec_cache")

#: records the in-process memory tier keeps
MEMORY_RECORDS = 4096

__all__ = ["Continuations", "Continuation", "request_key", "plan", "trim", "record_at", "generate", "ResumedResult"]


def request_key(ns_key: bytes, prompt: Sequence[int], sampling: Any, stop_at_eos: bool,
                eos_ids: Sequence[int]) -> bytes:
    """The continuation key of a request: ``sampling`` a ``RowSampling`` (None: greedy); EOS ids count only
    when the request stops at them."""
    temperature = 0.0 if sampling is None else sampling.temperature
    params = continuation_params(temperature=temperature, top_p=1.0 if sampling is None else sampling.top_p,
                                 seed=None if sampling is None else sampling.seed,
                                 eos_ids=tuple(eos_ids) if stop_at_eos else None,
                                 top_k=0 if sampling is None else getattr(sampling, "top_k", 0),
                                 min_p=0.0 if sampling is None else getattr(sampling, "min_p", 0.0),
                                 processors=None if sampling is None else getattr(sampling, "processor_params", dict)())
    return continuation_key(ns_key, prompt, params)


class Continuations:
    """A cache's continuation records: an in-process LRU (newest first, visible at once) over the LMDB table
    (``store.continuations.ContinuationTable``, written in the commit of the checkpoint it refers to).
    ``SpecCache.continuations`` is the one of a cache."""

    def __init__(self, cache, *, memory_records: int = MEMORY_RECORDS, max_records: int = MAX_RECORDS,
                 max_bytes: int = MAX_BYTES):
        self.cache = cache
        self.table = ContinuationTable(cache.store, max_records=max_records, max_bytes=max_bytes)
        self.memory_records = memory_records
        self._memory: collections.OrderedDict[bytes, Continuation] = collections.OrderedDict()
        # per tenant label, its records' keys least recently used first: the in-process bound evicts from the
        # tenant holding the most records (as the LMDB table does by its tenant rows), never another tenant first
        self._by_tenant: dict[bytes, collections.OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "written": 0, "evicted": 0, "failed": 0}

    @classmethod
    def of(cls, cache) -> "Continuations":
        """The ``Continuations`` of ``cache`` (made on first use, one per cache)."""
        with _OF_LOCK:
            found = cache.__dict__.get("_continuations")
            if found is None:
                found = cache.__dict__["_continuations"] = cls(cache)
            return found

    def get(self, key: bytes, ns_key: bytes, prompt_tokens: int) -> Continuation | None:
        """The newest record under ``key`` (memory, then LMDB), or None. A record that does not name this
        namespace and prompt length is a miss (never another request's tokens)."""
        with self._lock:
            rec = self._memory.get(key)
            if rec is not None:
                self._memory.move_to_end(key)
                keys = self._by_tenant.get(self._tenant(rec))
                if keys is not None and key in keys:
                    keys.move_to_end(key)
        if rec is None and not self.cache.closed:
            try:
                rec = self.table.get(key)
            except StoreError as exc:
                log.warning("spec-cache: continuation lookup failed, treated as a miss: %s", exc)
                rec = None
        if rec is None or rec.ns_key != ns_key or rec.prompt_tokens != prompt_tokens or not rec.tokens:
            self.counters["misses"] += 1
            return None
        self.counters["hits"] += 1
        return rec

    def remember(self, rec: Continuation) -> None:
        """Hold ``rec`` in this process (a record never goes back to fewer tokens)."""
        tenant = self._tenant(rec)
        with self._lock:
            old = self._memory.get(rec.key)
            if old is None or (len(old.tokens), old.finished) < (len(rec.tokens), rec.finished):
                self._memory[rec.key] = rec
            self._memory.move_to_end(rec.key)
            self._by_tenant.setdefault(tenant, collections.OrderedDict())[rec.key] = None
            self._by_tenant[tenant].move_to_end(rec.key)
            while len(self._memory) > self.memory_records:
                self._evict_one(rec.key)

    def _tenant(self, rec: Continuation) -> bytes:
        tenant_of = getattr(self.cache, "tenant_of", None)
        return tenant_of(rec.ns_key) if tenant_of is not None else b""

    def _evict_one(self, keep: bytes) -> None:
        """Drop the least recently used record of the tenant holding the most (ties by label), never ``keep``."""
        ranked = sorted(((len(keys) - (keep in keys), t) for t, keys in self._by_tenant.items()), reverse=True)
        for _held, tenant in ranked:
            keys = self._by_tenant[tenant]
            victim = next((k for k in keys if k != keep), None)
            if victim is None:
                continue
            del keys[victim]
            if not keys:
                del self._by_tenant[tenant]
            self._memory.pop(victim, None)
            return
        key, rec = self._memory.popitem(last=False)  # only ``keep`` is left (memory_records 0)
        self._by_tenant.get(self._tenant(rec), {}).pop(key, None)

    def persist(self, rec: Continuation) -> None:
        """Write ``rec`` to LMDB (call once the checkpoint it refers to is committed); never raises."""
        store = self.cache.store
        if store.closed or store.readonly:  # closed (a write drained at close still lands: the store is open)
            return
        try:
            self.counters["evicted"] += self.table.put(rec)
            self.counters["written"] += 1
        except Exception as exc:  # a cache never takes the request down
            self.counters["failed"] += 1
            log.warning("spec-cache: continuation record of %d tokens not stored: %s", len(rec.tokens), exc)

    def rider(self, rec: Continuation):
        """``rec``'s rows as a rider of the checkpoint it refers to (``SpecCache.save(rider=...)``): written in
        that checkpoint's own LMDB transaction, so both land in one commit or neither (a separate commit per
        record cost ~12-20 KiB of pages: issue 21's write amplification). Counted when it runs."""
        def ride(txn) -> None:
            try:
                self.counters["evicted"] += self.table.write_in(txn, rec)
                self.counters["written"] += 1
            except Exception:
                self.counters["failed"] += 1
                raise  # the store undoes the rider's rows alone and logs it; the checkpoint stands
        return ride

    def stats(self) -> dict:
        return {**self.counters, "memory_records": len(self._memory)}


_OF_LOCK = threading.Lock()


def record_at(key: bytes, ns_key: bytes, prompt: Sequence[int], output: Sequence[int], checkpoint_tokens: int,
              finished: bool = False) -> Continuation | None:
    """The record a checkpoint of ``checkpoint_tokens`` tokens (``prompt + output[:k-1]``) supports: ``output[:k]``;
    None for a prompt-boundary (or shorter) checkpoint."""
    k = checkpoint_tokens - len(prompt) + 1
    if k < 1 or k > len(output):
        return None
    return Continuation(key, ns_key, len(prompt), tuple(int(t) for t in output[:k]), finished and k == len(output),
                        time.time_ns())


def plan(rec: Continuation | None, max_tokens: int, stop_at_eos: bool, eos_ids: Sequence[int], *,
         partial: bool = True) -> tuple[list[int], bool]:
    """(tokens to replay, whether they answer the request whole). ``partial`` False (KV quantization): only a
    whole answer is replayed."""
    if rec is None:
        return [], False
    replay = list(rec.tokens[:max_tokens])
    eos = set(int(t) for t in eos_ids) if stop_at_eos else set()
    for i, token in enumerate(replay):
        if token in eos:
            replay = replay[: i + 1]
            break
    ended = bool(replay) and (len(replay) == max_tokens or replay[-1] in eos)
    if not ended and not partial:
        return [], False
    return replay, ended


def trim(prepared, prompt_tokens: int, replayed: int) -> int:
    """Replay only what the restored state covers: ``prepared`` (``Generator.prepare`` of ``prompt + replay``)
    restored ``L`` tokens; keep ``L - len(prompt) + 1`` replayed tokens (0..replayed) and shorten its request to
    ``prompt + replay[:kept]`` (the budget grows by what was dropped). Returns the kept count."""
    kept = max(0, min(replayed, prepared.cached_tokens - prompt_tokens + 1))
    if kept < replayed:
        request = prepared.request
        prepared.request = dataclasses.replace(request, prompt=list(request.prompt[: prompt_tokens + kept]),
                                               max_tokens=request.max_tokens + replayed - kept)
    return kept


@dataclass
class ResumedResult(Result):
    """``Generator.generate``'s ``Result`` with ``resumed``: tokens replayed from a stored continuation."""

    resumed: int = 0


def generate(generator, prompts, max_tokens: int = 32, *, temperature: float = 0.0, seed: int = 0,
             top_p: float = 1.0, checkpoint_every: int | None = None, resume: bool = True, top_k: int = 0,
             min_p: float = 0.0, **processors: Any) -> list[ResumedResult]:
    """``Generator.generate`` with continuations: rows resume from their stored continuation (``resume``) and
    checkpoint every ``checkpoint_every`` generated tokens (None: at the prompt boundary and the end only), each
    checkpoint followed by its continuation record. Tokens equal an uninterrupted ``generate``'s.

    The decoding is the decode room's one loop (``generator.session()``, a ``decode.cached_session.CachedSession``,
    reached through the generator so that this room never imports ``decode``): this function plans the replay and
    names each checkpoint's record (its ``rider``); the session restores, decodes and writes."""
    from spec_cache.rows.generation import check_prompts
    from spec_cache.rows.sampling import RowSampling, Sampling

    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest("max_tokens must be a positive int")
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise InvalidRequest("checkpoint_every must be None or an int >= 1")
    prompts = check_prompts(prompts, generator.engine.target.vocab_size)
    sampling = RowSampling(temperature, top_p, seed, top_k, min_p, **processors)
    cache, eos = generator.cache, tuple(generator.eos_token_ids)
    conts = None if cache is None else Continuations.of(cache)
    ns_key = generator.ns_key
    partial = generator.engine.plan is None
    started = time.perf_counter()
    results: list[ResumedResult | None] = []
    rows: list[tuple[int, Any]] = []  # (index in results, handle) of the rows that decode
    checkpointed: dict[int, int] = {}  # row id -> generated tokens at its last periodic checkpoint

    def rider(key: bytes):
        """The record of each checkpoint of a row under continuation ``key``: the tokens that checkpoint covers."""
        def record(handle, tokens):
            output = handle.output
            return record_at(key, ns_key, handle.prompt, output, len(tokens),
                             finished=len(output) >= handle.max_tokens or bool(output) and output[-1] in eos)
        return record

    def on_tokens(handle, tokens):
        if checkpoint_every is not None and len(handle.output) - checkpointed.get(handle.row, handle.replayed) \
                >= checkpoint_every and len(handle.output) < handle.max_tokens:
            checkpointed[handle.row] = len(handle.output)
            session.checkpoint(handle)

    session = generator.session(eos_token_ids=eos, draft_sampling=Sampling(temperature, seed))
    try:
        for prompt in prompts:
            key = None if conts is None else request_key(ns_key, prompt, sampling, True, eos)
            rec = conts.get(key, ns_key, len(prompt)) if resume and conts is not None else None
            replay, ended = plan(rec, max_tokens, True, eos, partial=partial)
            if ended:
                results.append(ResumedResult(list(replay), len(prompt) - 1, 0, 0, time.perf_counter() - started,
                                             len(prompt), False, len(replay)))
                continue
            handle = session.prepare(prompt, max_tokens, sampling, replay=replay,
                                     rider=None if key is None else rider(key))
            rows.append((len(results), handle))
            results.append(None)
        for _, handle in rows:
            session.admit(handle, on_tokens=on_tokens, submitted_at=started)
        session.run(write_each_step=True)
    finally:
        session.close()
    for index, handle in rows:
        result = handle.result
        results[index] = ResumedResult(list(handle.output), handle.cached_tokens, result.drafted, result.accepted,
                                       result.ttft_s, len(handle.prompt), handle.restored_drafter, handle.replayed)
    return results  # type: ignore[return-value]
