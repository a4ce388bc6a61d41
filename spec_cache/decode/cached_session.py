"""``CachedSession``: the library's one decode loop. An engine session whose rows resume from the cache and whose
checkpoints go back to it.

The protocol every caller used to write by hand (issue 34, item 1), written once:

1. **restore** (``prepare``): ``Generator.prepare`` looks up the longest usable stored prefix of the row's sequence
   (``prompt + replay``) and builds its ``RowRequest``, restored or cold. With ``replay`` (the tokens a stored
   continuation record holds, ``spec_cache.tiers.continuations``) only as many replayed tokens are kept as the
   restored state covers (``continuations.trim``); the rest are generated again, token-identically.
2. **open** (``admit``): the row joins the engine's ``DecodeSession``. With ``cold_fallback`` a restored state the
   engine refuses (``RestoreRefused``, ``SchemaError``) is a miss plus a warning: the same request is admitted cold
   (its replayed tokens, already the caller's, prefilled with the prompt; a caller that must not prefill generated
   tokens cold, the scheduler after a failed step, prepares that row with ``lookup=False`` itself).
3. **step**: one engine step (admit, one round, retire). Callbacks get the ``CachedRow`` handle, not a row id.
4. **checkpoint**: every checkpoint the engine hands out (prompt boundary, prefill offsets, ``checkpoint``,
   finish) passes the row's ``keep`` filter, is compared with what was restored (``PreparedRow.needs_save``: the
   very state it restored is not written again) and queued; its continuation record (the row's ``rider``
   factory) is held in this process at once. ``write_checkpoints`` writes the queue through one path,
   ``Generator.save_checkpoint`` (memory tier now, LMDB behind the request when ``background``), each record as a
   rider of its checkpoint's own LMDB commit; a record whose state is stored already is persisted alone.
   Callers choose when: after every step (``run(write_each_step=True)``, the server), or after decoding
   (``close()``, ``Generator.generate``: saves stay off the TTFT path); ``discard_checkpoints`` drops the queue
   (a step that failed, a Ctrl-C).

Callers: ``Generator.generate`` (a batch), ``spec_cache.tiers.continuations.generate`` (replay + periodic
checkpoints with continuation records; it reaches this class through ``Generator.session``, so ``tiers`` never
imports ``decode``), the CLI's streaming ``apps/cli/stream.decode_rows``, and the server's scheduler
(``apps/server/scheduler.py``). No caller drives the engine session itself (``tests/library/test_one_decode_loop.py``).

The scheduler makes these calls: ``CachedSession(generator, eos_token_ids=..., background=True, cold_fallback=True,
on_save_error=log, on_refused=log)`` per session (a fresh one after a failed step, ``close(write=False)`` first:
the checkpoints of a failed step are dropped); ``prepare(sequence, budget, sampling, ns_key=..., limit=...,
replay=..., rider=..., keep=...)`` (``replay`` only for a retry's replayed tokens or a resumed row's delivered ones:
they are trimmed to what the restored state covers) then, after its own adjustments of ``handle.prepared.request``
(prefill phase, ``boundary_checkpoint``, ``checkpoint_at``, logprobs), ``admit(handle, on_tokens=..., on_finish=...,
submitted_at=job.arrived, on_cold=...)`` (``on_cold``: its re-plan of a refused row, phase dropped, replay dropped
after a failed step); ``step``; ``write_checkpoints`` after each step (timed into its trace); ``checkpoint`` /
``finish`` / ``cancel`` by handle; ``active_count`` / ``waiting_count`` / ``busy`` for admission. ``rider`` is its
continuation record of the checkpoint (``remember`` done here); ``keep`` is its prefill-phase rule (a phase keeps
only its boundary checkpoint; a row that left its batch keeps none). It keeps what is a server's: the thread and
inbox, HTTP back-pressure and tenant fairness, the shared-tier prefetch, the prefill-phase and ``checkpoint_at``
policy (which offsets, ``splits_prompt``), retries after a failed step (culprit, suspects, ``resend`` checks,
dropping a poisoned prefix), metrics, the trace and its events.

Threading: one owner thread calls every method (as ``DecodeSession``). Cost: nothing beyond the engine session and
the cache calls it makes; a handle per row (kept until the row finishes).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from spec_cache.decode.engine import RowResult
from spec_cache.errors import RestoreRefused
from spec_cache.schemas import SchemaError
from spec_cache.tiers.cache import CacheWarning
from spec_cache.tiers.continuations import Continuation, Continuations
from spec_cache.tiers.continuations import trim as continuation_trim

__all__ = ["CachedSession", "CachedRow", "PreparedRow"]


@dataclass
class PreparedRow:
    """A prompt made ready for the engine (``Generator.prepare``): its ``RowRequest`` (restored state attached
    when the cache had a usable prefix), how many prompt tokens came from the cache, and under which namespace
    key its checkpoints go."""

    request: Any  # engine.RowRequest
    ns_key: bytes | None
    cached_tokens: int = 0
    restored_drafter: bool = False
    #: (tokens, with drafter row) of the restored checkpoint: writing that one again would change nothing
    restored_at: tuple[int, bool] | None = None
    #: the tier the restored state came from ("memory", "local" (LMDB), "shared"); None: cold
    tier: str | None = None

    def needs_save(self, tokens: Sequence[int], draft_checkpoint, drafter_namespace: str | None) -> bool:
        """Whether a checkpoint of ``tokens`` (with ``draft_checkpoint``) adds anything to what was restored."""
        return self.restored_at != (len(tokens), draft_checkpoint is not None or not drafter_namespace)


#: ``rider(handle, tokens)``: the continuation record a checkpoint of ``tokens`` supports, or None
RiderFactory = Callable[["CachedRow", list], "Continuation | None"]


@dataclass
class CachedRow:
    """One request in a ``CachedSession``: what was restored for it and what it generated so far."""

    #: the request's own prompt (without replayed tokens)
    prompt: list[int]
    #: what ``Generator.prepare`` made of ``prompt + replay`` (its ``request`` may be adjusted before ``admit``)
    prepared: PreparedRow
    #: the token budget asked for (replayed tokens included)
    max_tokens: int
    #: tokens taken from a stored continuation, kept as generated (``output[:replayed]``)
    replayed: int = 0
    #: tokens generated so far, replayed ones first
    output: list[int] = field(default_factory=list)
    #: the engine's row id once admitted (None before ``admit``)
    row: int | None = None
    #: the engine's result once the row left
    result: RowResult | None = None
    rider: RiderFactory | None = None
    #: ``keep(tokens)``: whether a checkpoint of ``tokens`` is worth saving (None: every one)
    keep: Callable[[list], bool] | None = None
    on_tokens: Callable[..., None] | None = None
    on_finish: Callable[["CachedRow", RowResult], None] | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the cache held for this request (its replayed tokens not counted)."""
        return min(self.prepared.cached_tokens, len(self.prompt) - 1)

    @property
    def restored_drafter(self) -> bool:
        return self.prepared.restored_drafter


@dataclass
class _Save:
    tokens: list
    caches: list
    draft: Any
    ns_key: bytes | None
    record: Continuation | None


class CachedSession:
    """Rows that restore from ``generator``'s cache, decode in one engine session and checkpoint back to it.

    ``eos_token_ids``: default the generator's. ``draft_sampling``, ``default_sampling``, ``cancel``: as
    ``SpeculativeEngine.session``. ``background``: write checkpoints to LMDB behind the request (None: the
    generator's ``write_behind``). ``cold_fallback``: a restored state the engine refuses at ``admit`` is a miss
    plus a ``CacheWarning`` (False: the error propagates). ``on_save_error(exc, tokens)``: a checkpoint write that
    raised (None: the exception propagates; the rest of the queue is dropped). ``on_refused(exc)``: how a refused
    restored state is reported under ``cold_fallback`` (None: a ``CacheWarning``; the server logs it).
    """

    def __init__(self, generator, *, eos_token_ids: Sequence[int] | None = None, draft_sampling=None,
                 default_sampling=None, cancel: Callable[[int], bool] | None = None, background: bool | None = None,
                 cold_fallback: bool = False,
                 on_save_error: Callable[[Exception, list], None] | None = None,
                 on_refused: Callable[[Exception], None] | None = None) -> None:
        self.generator = generator
        cache = generator.cache
        self.background = background
        self.cold_fallback = cold_fallback
        self.on_save_error = on_save_error
        self.on_refused = on_refused
        self.eos_token_ids = tuple(generator.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.rows: dict[int, CachedRow] = {}
        self._saves: list[_Save] = []
        self._options = dict(eos_token_ids=self.eos_token_ids,
                             on_checkpoint=None if cache is None else self._on_checkpoint,  # no copies for no cache
                             draft_sampling=draft_sampling, default_sampling=default_sampling, cancel=cancel)
        self._session: Any = None
        self._closed = False

    @property
    def session(self):
        """The engine's ``DecodeSession``, opened at the first ``admit`` (or ``step``): restores run before the
        batch state is built, as ``SpeculativeEngine.run`` checks every request first."""
        if self._session is None:
            if self._closed:
                raise RuntimeError("the session is closed")
            self._session = self.generator.engine.session(**self._options)
        return self._session

    # -- admission --------------------------------------------------------------------------------------
    def prepare(self, prompt: Sequence[int], max_tokens: int = 32, sampling: Any = None, *,
                ns_key: bytes | None = None, lookup: bool = True, limit: int | None = None,
                replay: Sequence[int] = (), rider: RiderFactory | None = None,
                keep: Callable[[list], bool] | None = None) -> CachedRow:
        """Restore a row for ``prompt`` (``Generator.prepare`` of ``prompt + replay``, budget ``max_tokens`` less
        the replay; ``replay`` trimmed to what the restored state covers). Not in the session yet: adjust
        ``handle.prepared.request`` if needed, then ``admit``. ``rider``: the continuation record of each
        checkpoint (see the module doc)."""
        prompt = [int(t) for t in prompt]
        replay = [int(t) for t in replay]
        prepared = self.generator.prepare(prompt + replay, max_tokens - len(replay), sampling=sampling,
                                          ns_key=ns_key, lookup=lookup, limit=limit)
        kept = continuation_trim(prepared, len(prompt), len(replay)) if replay else 0
        return CachedRow(prompt, prepared, max_tokens, kept, replay[:kept], rider=rider, keep=keep)

    def admit(self, handle: CachedRow, *, on_tokens: Callable[..., None] | None = None,
              on_finish: Callable[[CachedRow, RowResult], None] | None = None,
              submitted_at: float | None = None,
              on_cold: Callable[[CachedRow, Exception], None] | None = None) -> CachedRow:
        """Put a prepared row into the engine session (it joins at the next ``step``). ``on_tokens(handle, tokens)``
        (``(handle, tokens, RowLogprobs)`` for a row with logprobs) after each round that emitted tokens for it,
        after ``handle.output`` took them; ``on_finish(handle, result)`` once when it leaves. Raises what
        ``DecodeSession.submit`` raises (a refused restored state only without ``cold_fallback``).
        ``on_cold(handle, exc)``: with ``cold_fallback``, called once the refused state was taken off the request
        and before it goes in cold: a caller may re-plan ``handle.prepared`` there (e.g. with ``self.prepare(...,
        lookup=False)``'s, its prefill phase dropped)."""
        handle.on_tokens, handle.on_finish = on_tokens, on_finish
        try:
            row = self.session.submit(handle.prepared.request, on_tokens=self._tokens, on_finish=self._finish,
                                      submitted_at=submitted_at)
        except (RestoreRefused, SchemaError) as exc:
            if not self.cold_fallback or not handle.prepared.cached_tokens:
                raise
            if self.on_refused is not None:
                self.on_refused(exc)
            else:
                warnings.warn(f"spec-cache: restored prefix refused, prefilling cold: {exc}", CacheWarning,
                              stacklevel=2)
            self._go_cold(handle)
            if on_cold is not None:
                on_cold(handle, exc)
            row = self.session.submit(handle.prepared.request, on_tokens=self._tokens, on_finish=self._finish,
                                      submitted_at=submitted_at)
        handle.row = row
        self.rows[row] = handle
        return handle

    def submit(self, prompt: Sequence[int], max_tokens: int = 32, sampling: Any = None, *,
               ns_key: bytes | None = None, lookup: bool = True, limit: int | None = None,
               replay: Sequence[int] = (), rider: RiderFactory | None = None,
               keep: Callable[[list], bool] | None = None, on_tokens: Callable[..., None] | None = None,
               on_finish: Callable[[CachedRow, RowResult], None] | None = None,
               submitted_at: float | None = None) -> CachedRow:
        """``prepare`` then ``admit``: the handle of a row in the session."""
        handle = self.prepare(prompt, max_tokens, sampling, ns_key=ns_key, lookup=lookup, limit=limit, replay=replay,
                              rider=rider, keep=keep)
        return self.admit(handle, on_tokens=on_tokens, on_finish=on_finish, submitted_at=submitted_at)

    def _go_cold(self, handle: CachedRow) -> None:
        """``handle``'s request without its restored state: the same prompt (replayed tokens included, as they were
        delivered), prefilled cold."""
        request = handle.prepared.request
        cold = dataclasses.replace(request, restored_caches=None, restored_tokens=0, draft_checkpoint=None)
        handle.prepared = PreparedRow(cold, handle.prepared.ns_key)

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step (admit what fits, one round, retire); True while rows remain. Checkpoints it took wait
        in the queue (``write_checkpoints``)."""
        return self.session.step()

    def run(self, *, write_each_step: bool = False) -> None:
        """Step until no row is left; ``write_each_step``: write the checkpoints after every step."""
        while self.busy:
            self.session.step()
            if write_each_step:
                self.write_checkpoints()

    def cancel(self, handle: CachedRow) -> bool:
        """End the row without a finish checkpoint (``DecodeSession.cancel``)."""
        return handle.row is not None and self.session.cancel(handle.row)

    def finish(self, handle: CachedRow) -> bool:
        """End the row as done, its finish checkpoint taken (``DecodeSession.finish``)."""
        return handle.row is not None and self.session.finish(handle.row)

    def checkpoint(self, handle: CachedRow) -> bool:
        """Checkpoint the decoding row as it stands (``DecodeSession.checkpoint``)."""
        return handle.row is not None and self.session.checkpoint(handle.row)

    @property
    def busy(self) -> bool:
        """Rows are decoding, prefilling or waiting."""
        return self._session is not None and self._session.busy

    @property
    def active_count(self) -> int:
        return 0 if self._session is None else self._session.active_count

    @property
    def waiting_count(self) -> int:
        return 0 if self._session is None else self._session.waiting_count

    @property
    def first_tokens_due(self) -> int:
        """Rows whose first token comes at the next step (``DecodeSession.first_tokens_due``)."""
        return 0 if self._session is None else self._session.first_tokens_due

    @property
    def pending_checkpoints(self) -> int:
        """Checkpoints taken and not written yet."""
        return len(self._saves)

    # -- checkpoints: one path to the tiers -------------------------------------------------------------
    @property
    def _continuations(self) -> Continuations | None:
        """The cache's continuation records (made on first use: rows without a rider never touch them)."""
        cache = self.generator.cache
        return None if cache is None else Continuations.of(cache)

    def write_checkpoints(self) -> int:
        """Write the queued checkpoints (``Generator.save_checkpoint``, each continuation record as its rider);
        returns how many."""
        saves, self._saves = self._saves, []
        for save in saves:
            rider = None if save.record is None else self._continuations.rider(save.record)
            try:
                self.generator.save_checkpoint(save.tokens, save.caches, save.draft, ns_key=save.ns_key,
                                               background=self.background, rider=rider)
            except Exception as exc:
                if self.on_save_error is None:
                    raise
                self.on_save_error(exc, save.tokens)
        return len(saves)

    def discard_checkpoints(self) -> int:
        """Drop the queued checkpoints (not to be trusted, or not wanted); returns how many."""
        dropped, self._saves = len(self._saves), []
        return dropped

    def close(self, *, write: bool = True) -> None:
        """Close the engine session (rows still in it get no further callbacks), then write the queued checkpoints
        (``write``) or drop them. Idempotent."""
        self._closed = True
        try:
            if self._session is not None:
                self._session.close()
        finally:
            if write:
                self.write_checkpoints()
            else:
                self.discard_checkpoints()

    # -- engine callbacks -------------------------------------------------------------------------------
    def _tokens(self, row: int, tokens: list, *scored) -> None:
        handle = self.rows.get(row)
        if handle is None:
            return
        handle.output += tokens
        if handle.on_tokens is not None:
            handle.on_tokens(handle, tokens, *scored)

    def _finish(self, row: int, result: RowResult) -> None:
        handle = self.rows.pop(row, None)
        if handle is None:
            return
        handle.result = result
        if handle.on_finish is not None:
            handle.on_finish(handle, result)

    def _on_checkpoint(self, row: int, tokens: list, caches: list, draft) -> None:
        handle = self.rows.get(row)
        if handle is None or handle.keep is not None and not handle.keep(tokens):
            return
        conts = None if handle.rider is None else self._continuations
        record = None if conts is None else handle.rider(handle, tokens)
        if record is not None:
            conts.remember(record)  # visible in this process at once
        if handle.prepared.needs_save(tokens, draft, self.generator.drafter_namespace):
            self._saves.append(_Save(tokens, caches, draft, handle.prepared.ns_key, record))
        elif record is not None:  # the state is stored already: only the record is new
            conts.persist(record)
