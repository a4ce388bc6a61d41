"""The scheduler: one thread owns the generator, its engine session and the cache; nothing else touches them.

Why one file of ~1100 lines: the scheduler is one thread's loop and the state only it touches (queue,
admission, checkpoint phases, retries); splitting it would share that state across modules.

HTTP handlers call ``submit`` / ``cancel`` / ``finish`` (thread-safe: they only enqueue) and read the events of
their ``Job`` through its ``deliver`` callback (which must be thread-safe: the app passes one that hops onto its
event loop). The thread loops: take every control message, admit waiting jobs while fewer than ``max_rows`` are
in the batch (each restored from the cache at that moment: memory tier, LMDB, shared tier), run one engine
round, write the checkpoints that round produced (the memory tier at once, LMDB behind), and go on; with nothing to
do it sleeps on its inbox. The restore, the engine session and the checkpoint writes are the library's one decode
loop, ``spec_cache.decode.cached_session.CachedSession`` (``prepare`` / ``admit`` / ``step`` /
``write_checkpoints``, a fresh one after a failed step); this module keeps what is a server's: the thread and
inbox, back-pressure and fairness, the shared-tier prefetch, the prefill-phase and ``checkpoint_at`` policy (the
session's ``keep`` rule), continuation records (its ``rider``), retries and fault isolation, metrics and the trace.

Long prompts and generations (``prefill_checkpoint_every=N``; ``checkpoint_every=M``): a prompt with more than N
tokens left to prefill goes in phases: a row for ``prompt[:k*N + 1]`` with ``max_tokens=1`` whose prompt-boundary
checkpoint (``k*N`` tokens) is saved, then the next phase (or the request itself) restores from it; so a crash
mid-prefill, or a later request sharing only the head, resumes part-way. Each phase costs one extra one-token round
and a restore. A decoding row is checkpointed every M generated tokens (``DecodeSession.checkpoint``). Phases are
skipped under KV quantization (the conversion point depends on the whole prompt's length, so a phase's state would not
be reusable). Where the engine checkpoints from its prefill chunks (``SpeculativeEngine.prefill_checkpoints``: no
drafter, float KV, an attention-only target) there are no phases: the same offsets go on the job's own row as
``RowRequest.checkpoint_at`` and each state is saved as the prefill passes it (no extra round, no restore).

Checkpoints at chosen offsets (``Job.checkpoint_at``, the template seam): a chat request's message boundaries
(``seam.message_boundaries``), Anthropic ``cache_control`` breakpoints, anything a caller names. An offset inside
the prompt goes as a prefill phase like the ``prefill_checkpoint_every`` ones, when the prompt is split at all
(``splits_prompt``: the cache held none of it, or a prefill chunk or more is left; a warm turn's short tail is
prefilled in one piece); ``len(prompt)`` (the end of the prompt, where the next turn of a conversation continues,
and where a drafter's exact-length row must be stored) is taken from the job's own row right after its first
token: its state then holds exactly ``prompt`` (``prompt + generated[:-1]`` with one token generated), so the
scheduler asks the session for a checkpoint there (``DecodeSession.checkpoint``, taken at the end of the step that
delivered the first token, never before it; a row that ends with its first token writes that state as its finish
checkpoint anyway). Cost: one checkpoint copy and its write, after the first token (no extra row, restore or
round). An offset inside the prompt costs one restore
and one one-token round; at most ``MAX_CHECKPOINT_AT`` offsets a request, offsets the restored prefix already
covers are skipped, and so are offsets within ``MIN_CHECKPOINT_GAP`` tokens of the restored prefix or of the
prompt boundary.

Retries (continuation checkpoints, ``spec_cache.tiers.continuations``): a job whose tokens are a function of the request
(greedy, or sampled with an explicit seed: ``RowSampler`` keys each position by the seed) leaves, with each of its
checkpoints (every ``checkpoint_every`` generated tokens, and when it finishes, or when its client goes away: then
its row is finished, checkpoint written, rather than cancelled), a continuation record of the tokens that
checkpoint covers: held in this process at once (the last ``CONTINUATIONS``) and written to LMDB after the
checkpoint is. The same request again (same tenant, prompt, sampling, seed, EOS rule), in this process or after a
restart or a SIGKILL, gets those tokens replayed at once (as many as the restored state covers) and its row
continues from the stored ``prompt + tokens`` state, token-identically.

Shared tier (a fleet's Redis/Valkey): its lookups never run on this thread. When a job arrives, a small prefetch
pool asks the cache for a shared prefix of its prompt (``SpecCache.prefetch_shared``, bounded by the tier's lookup
budget); the job waits in the queue meanwhile while the batch goes on decoding, and is admitted once its prefetch
is done. The scheduler's own restore (inside ``SpecCache.shared_via_prefetch()``) takes the prefetched prefix and
never asks the network, so a slow or hung server delays only the job that needs it, never a stream in the batch.

Fault isolation: an engine step that raises leaves its session unusable, but fails only the row that caused
it. The culprit is the one row that had not been through a step yet (just admitted: a restored state that does
not fit the model fails the step it joins in), or else the one suspect left from an earlier failure
(``Scheduler._culprit``); that row is
failed alone with its own error (500 ``engine_error``) and the prefix it restored is dropped from the memory tier
and LMDB (``SpecCache.drop``), so no later request restores it. Every other row is resumed in a fresh session
exactly where its client stands: readmitted as a retry of itself (``continuations.trim``: its row continues
from the longest stored state of ``prompt + delivered`` a run of it would have held, or from the prompt), and the
delivered tokens its row generates again are checked, not sent (a row's tokens never depend on its batch, so
they are the same; one that differs fails the row rather than answer wrongly). When the step cannot tell the
culprit (several rows new, or none), those rows become suspects, readmitted one at a time, so the next failure
names one; a row in ``MAX_FAILURES`` failed steps is failed whatever the rule says. Cost: the survivors' lost
step and the tokens they generate again. A row's grammar never fails a step: where it fails (``rows.grammar``),
its masks end the row in that step and ``_on_finish`` answers its 422 (no continuation record is kept).

Back-pressure: at most ``max_rows`` jobs decode at once; up to ``max_queue`` more wait; beyond that ``submit``
raises ``APIError(429)``. Fairness (``tenants`` > 1: a server with several API keys): a tenant (its key; a
``cache_salt`` does not make another) may hold at most ``fair_share`` of those ``max_rows + max_queue`` slots,
``capacity // max(2, tenants holding slots)`` and at least 1; its next job is refused (429) while other tenants
are admitted, so one key's ``n=16`` requests never fill every slot. Waiting jobs are admitted round-robin across
tenants (the one admitted least recently first; FIFO within a tenant), so another tenant's job joins the next
batch ahead of the 60th of a tenant that queued 64; and a tenant decodes in at most ``row_cap`` rows (``max_rows``
less one per other key, at most half kept), so a row is always free for another key's request, which a generation
of thousands of tokens would otherwise hold for its whole length. One tenant (no keys, or one key) is served
exactly FIFO, with no share but the global cap. A cancelled job (client gone) leaves the batch before the next
round. Events, in order: ``("start", cached_tokens)``, ``("tokens", [ids])`` ..., then ``("done", reason,
generated)`` with reason ``length``/``eos``/``stop``/``cancelled``, or ``("error", APIError)``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from spec_cache.apps.server.errors import api_error
from spec_cache.apps.server.logprobs import PromptScores, common_prefix
from spec_cache.apps.server.protocol import APIError
from spec_cache.apps.server.trace import scheduler_trace
from spec_cache.naming.namespace import namespace_key
from spec_cache.rows.sampling import RowSampling
from spec_cache.store import StoreError
from spec_cache.tiers.continuations import Continuations, request_key
from spec_cache.tiers.continuations import plan as continuation_plan
from spec_cache.tiers.continuations import record_at as continuation_record

if TYPE_CHECKING:  # imported by ``_new_session``: the server binds its port before anything imports MLX
    from spec_cache.decode.cached_session import CachedSession

log = logging.getLogger("spec_cache.apps.server")

#: how many finished generations the retry table remembers
CONTINUATIONS = 4096
#: threads of the shared-tier prefetch pool (each lookup is bounded by the tier's budget)
PREFETCH_WORKERS = 4
#: a job's prefetch ends by this many lookup budgets after it arrived (time waiting for a pool thread included)
PREFETCH_BUDGETS = 2.0
#: at most this many ``checkpoint_at`` offsets a request (the largest are kept: nearest the next turn)
MAX_CHECKPOINT_AT = 8
#: a ``checkpoint_at`` offset this close to what is already covered (or to the prompt boundary) is skipped
MIN_CHECKPOINT_GAP = 16
#: a job in this many failed engine steps is failed (fault isolation, module doc), whoever the rule blames
MAX_FAILURES = 3
#: a new job waits at most this long for generation requests still being read and tokenized (``Arrival``)
COALESCE_S = 0.1

__all__ = ["Arrival", "Job", "Scheduler", "checkpoint_points", "fair_key", "MAX_CHECKPOINT_AT", "MIN_CHECKPOINT_GAP"]


def _read_records(job: Job) -> bool:
    """Whether ``job``'s row was just restored by reading records (LMDB or the shared tier: ~360 ms for a 15k-token
    8B prefix on the H100), which ends the admission pass: its prefill starts in the next step while the next such
    restore waits for it, so each request's first token comes after its own restore and prefill, not after every
    request's restore (issue 35, the agent restart at 2 clients: both restores, 724 ms, came before either prefill).
    A memory-tier hit costs a few ms and admits on."""
    prepared = job.prepared
    return prepared is not None and getattr(prepared, "tier", None) in ("local", "shared")


def _restored(job: Job) -> int:
    """Tokens ``job``'s current row restored from the cache (0: cold, or not prepared yet)."""
    request = None if job.prepared is None else job.prepared.request
    return 0 if request is None else request.restored_tokens


def _grammar_failure(job: "Job") -> str | None:
    """Why ``job``'s grammar cut its output (a one-line message), or None."""
    grammar = job.sampling.grammar if job.sampling is not None else None
    failure = getattr(grammar, "failure", None)
    return None if failure is None else failure(job.output)


def _save_failed(exc: Exception, tokens: list) -> None:
    """``CachedSession.on_save_error``: a cache never takes the server down."""
    log.error("spec-cache: checkpoint of %d tokens not stored", len(tokens), exc_info=exc)


def _refused(exc: Exception) -> None:
    """``CachedSession.on_refused``: a restored state the engine refuses is a miss plus a warning in the log."""
    log.warning("spec-cache: restored prefix refused, prefilling cold: %s", exc)


def _device_memory() -> dict:
    """MLX's active and cached device memory in MiB, for the trace (``mem``, ``mcache``): a step that waits on an
    allocation shows next to a cache the allocator had to give back (issue 35's 216 ms steps when a row left)."""
    import mlx.core as mx

    return {"mem": mx.get_active_memory() >> 20, "mcache": mx.get_cache_memory() >> 20}


def _write_state(cache) -> dict:
    """The write queue and the memory tier, for the trace: ``wq`` queued bytes (what the writer will copy), ``wn``
    queued checkpoints, ``tier`` the memory tier's MiB (device memory on a GPU; with ``mem``: whether the snapshots
    waiting for LMDB are what fills it)."""
    if cache is None:
        return {"wq": 0}
    jobs, nbytes = cache.write_pending
    return {"wq": nbytes, "wn": jobs, "tier": cache.memory.bytes >> 20}


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message as one line of at most ``limit`` characters (an error reply is one line)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(eq=False)
class Job:
    """One generation request as the scheduler sees it."""

    prompt: list[int]
    max_tokens: int
    sampling: RowSampling
    deliver: Callable[[tuple], None]  # thread-safe: called on the scheduler thread
    tenant: str | None = None  # namespace tenant (API key, cache salt); None: the open namespace
    stop_at_eos: bool = True
    arrived: float = field(default_factory=time.perf_counter)
    #: when its HTTP request began (``perf_counter``; the routes set it): the trace's ``http_ms`` is the time to
    #: ``arrived`` (reading, parsing, rendering and tokenizing the prompt)
    received: float | None = None
    # set by the scheduler thread
    admitted_at: float | None = None  # its first row (or prefill phase) went into the batch
    row: int | None = None
    handle: Any = None  # its row in the scheduler's ``CachedSession`` (a ``CachedRow``), once admitted
    prepared: Any = None  # ``handle.prepared``: what its current row restored
    cached_tokens: int = 0
    generated: int = 0
    last_token_at: float | None = None
    finished: bool = False
    started: bool = False  # "start" delivered (the job's own row was admitted, not a prefill phase)
    phase_end: int | None = None  # the row decoding now is a prefill phase up to this many prompt tokens
    prefilled: int = 0  # prompt tokens covered by this job's own phase checkpoints
    checkpointed_at: int = 0  # generated tokens at the last mid-generation checkpoint
    #: its tokens are a function of the request (greedy, or an explicit seed): a retry may resume it
    replayable: bool = False
    output: list[int] = field(default_factory=list)  # every token delivered (replayed ones included)
    replayed: int = 0  # tokens replayed from an earlier identical request
    prefetch: Any = None  # the shared-tier prefetch of its prompt (a Future) while one runs
    held_ns: bytes | None = None  # the namespace the scheduler holds for it until it ends (``SpecCache.hold``)
    #: prompt offsets (token counts) to checkpoint while prefilling; ``len(prompt)``: the end of the prompt (see
    #: the module doc; normalised by ``checkpoint_points`` when submitted)
    checkpoint_at: tuple[int, ...] = ()
    #: the offsets of ``checkpoint_at`` a client asked for by name (Anthropic ``cache_control``): they split the
    #: prefill warm turn or not (the reply reports them as cache creation); one within ``MIN_CHECKPOINT_GAP`` of
    #: the prompt's end is left to the end-of-prompt checkpoint, as any offset
    pinned_at: tuple[int, ...] = ()
    end_checkpoint: bool = False  # checkpoint ``prompt`` itself right after its first token (see the module doc)
    # fault isolation (``Scheduler._step``): set by the scheduler thread
    proven: bool = False  # its current row got through a step that emitted tokens for it (or finished it)
    suspect: bool = False  # in a failed step that could not tell the culprit: readmitted one suspect at a time
    failures: int = 0  # failed steps it was in
    resuming: bool = False  # readmitted after a failed step: its next ``_submit`` resumes what it delivered
    resend: list[int] = field(default_factory=list)  # delivered tokens its resumed row generates again (not sent)
    #: logprobs of each generated token with this many alternatives (None: off; ``RowRequest.logprobs``): its
    #: ``tokens`` events carry them as a third item
    logprobs: int | None = None
    #: score the prompt too (echo; ``RowRequest.prompt_logprobs``): the job restores only as far as the
    #: scheduler's ``prompt_scores`` know its prompt's scores (a restored prefix has no logits to score), is never
    #: split into prefill phases, and delivers ``("prompt_logprobs", list)`` once, before its first tokens
    prompt_logprobs: int | None = None
    prompt_sent: bool = False  # its prompt logprobs were delivered
    prompt_known: list | None = None  # the scores ``prompt_scores`` held of its prompt's first positions
    #: prompt offsets its prefill checkpoints because a job queued behind it shares that prefix (``_sibling_offsets``)
    shared_at: tuple[int, ...] = ()
    #: per admitted row id: how many leading prompt tokens this job shares with that row's (``_prefix_waits``)
    shared_with: dict = field(default_factory=dict)
    waited: bool = False  # it waited for such a row's prefill (counted once in ``Scheduler.shared_waits``)
    coalesced: bool = False  # it waited for requests arriving with it (counted once in ``Scheduler.arrival_waits``)
    room: bool | None = None  # rows arriving could join its prefill step (``Scheduler._leaves_room``; once)
    deferred: bool = False  # it waited for rows' first tokens (counted once in ``Scheduler.first_token_waits``)
    stored_hint: int | None = None  # what LMDB held of its prompt when first asked (``Scheduler._first_tokens_wait``)
    known_at: tuple | None = None  # (memory-tier puts, tokens asked, tokens held) of its last such ask

    @property
    def sequence(self) -> list[int]:
        """What the engine continues: the prompt and the replayed tokens."""
        return self.prompt + self.output[: self.replayed]

    def continuation_key(self, ns_key: bytes, eos_token_ids) -> bytes:
        """The key of its continuation record (``spec_cache.tiers.continuations.request_key``)."""
        return request_key(ns_key, self.prompt, self.sampling, self.stop_at_eos, eos_token_ids)


def checkpoint_points(offsets, prompt_tokens: int, limit: int = MAX_CHECKPOINT_AT) -> tuple[int, ...]:
    """``offsets`` as the sorted distinct ints in ``1..prompt_tokens``, at most ``limit`` of them (the largest)."""
    points = sorted({int(k) for k in offsets if 1 <= int(k) <= prompt_tokens})
    return tuple(points[-limit:]) if limit > 0 else ()


def fair_key(tenant: str | None) -> str:
    """The tenant a job counts against for fairness: its API key's part of ``Job.tenant`` (a ``cache_salt`` does not
    make another tenant: ``auth.salted_tenant``); ``open`` without keys."""
    return "open" if tenant is None else tenant.split("|", 1)[0]


def random_seed() -> int:
    return secrets.randbits(62)


class Arrival:
    """A generation request between its first byte and its submit (reading the body, rendering, tokenizing): the
    routes open one per request (``Scheduler.arrival``) and close it at the submit, or when they answer without
    one (``done`` is idempotent).

    Why: clients that go on together (a batch of chat clients, agents whose tool calls end in the same round) send
    their next requests within milliseconds, but they reach the scheduler one tokenization apart (the tokenizer
    runs one request at a time). Admitted as they came, the first one's prefill ran alone and the others waited for
    that step to end before theirs could start (issue 35, the H100 run at 4 clients: the first of four turn-2
    requests 167 ms to its first token, the other three 173-179 ms in the queue, then 385 ms together). A new job
    therefore waits while requests are arriving, at most ``Scheduler.coalesce_s``, and the prefills run as one
    step; only where rows prefill together in one step (a GPU: ``engine.join_budget``), so 0 on the CPU, and only a
    job that leaves room in that budget for a partner of its own size (``Scheduler._leaves_room``): a longer one
    prefills alone whatever arrives, and the rows then go one a step."""

    __slots__ = ("_scheduler", "_open")

    def __init__(self, scheduler: "Scheduler") -> None:
        self._scheduler = scheduler
        self._open = True
        scheduler._arrivals(1)

    def done(self) -> None:
        if self._open:
            self._open = False
            self._scheduler._arrivals(-1)


class Scheduler:
    """See the module doc. ``generator``: a loaded ``spec_cache.decode.generator.Generator``."""

    #: a new job waits at most this long (seconds) while other requests are arriving (``Arrival``); 0: never
    coalesce_s = COALESCE_S

    def __init__(self, generator, *, max_rows: int = 8, max_queue: int = 64, metrics=None,
                 checkpoint_every: int | None = None, eos_token_ids=(), tenants: int = 1,
                 prefill_checkpoint_every: int | None | str = "same") -> None:
        """``checkpoint_every``: a decoding row's checkpoint every N generated tokens; ``prefill_checkpoint_every``
        (default: the same N): a long prefill's phases every N prompt tokens. Apart because their costs differ: a
        generation checkpoint is one copy of the row's state, a prefill phase also a restore and a one-token round
        (the server's defaults: 256 generated tokens, 4096 prompt tokens)."""
        if max_rows < 1 or max_queue < 0:
            raise ValueError("max_rows must be >= 1 and max_queue >= 0")
        #: the API keys the server takes (module doc: fairness); more than one: each holds at most its share
        self.tenants = tenants
        if prefill_checkpoint_every == "same":
            prefill_checkpoint_every = checkpoint_every
        for name, every in (("checkpoint_every", checkpoint_every),
                            ("prefill_checkpoint_every", prefill_checkpoint_every)):
            if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
                raise ValueError(f"{name} must be None or an int >= 1")
        self.checkpoint_every = checkpoint_every if generator.cache is not None else None
        self.prefill_checkpoint_every = prefill_checkpoint_every if generator.cache is not None else None
        #: the model's EOS ids and the tokenizer's (a chat model's end-of-turn token is often only the latter)
        self.eos_token_ids = tuple(sorted(set(generator.eos_token_ids) | {int(t) for t in eos_token_ids}))
        self.generator = generator
        #: the prompt logprobs echo requests computed, per tenant (``logprobs.PromptScores``): an echo request
        #: restores its prompt from the cache as far as they go (none without a cache: nothing to restore)
        self.prompt_scores = PromptScores()
        self.max_rows = max_rows
        self.max_queue = max_queue
        self.metrics = metrics
        self._inbox: queue.Queue = queue.Queue()
        self._calls: collections.deque = collections.deque()  # ``call``s waiting for their turn (``_run_calls``)
        self._call_debt = 0.0  # seconds calls took while rows decoded, not yet matched by rounds
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted and not finished (waiting + decoding)
        self._held: collections.Counter = collections.Counter()  # the same, by ``fair_key`` (tenant)
        self._turn = 0  # admissions so far: round-robin's clock
        self._last_turn: dict[str, int] = {}  # ``fair_key`` -> the turn its last job was admitted at
        self._decoding = 0
        self._accepting = True
        self._stop = threading.Event()
        self._trace = scheduler_trace()  # off unless SPEC_CACHE_SCHED_TRACE names a path (``trace``)
        self._pending: collections.deque[Job] = collections.deque()
        self._rows: dict[int, Job] = {}
        self._session: CachedSession | None = None
        #: continuation records (memory, then LMDB); None without a cache
        self._continuations = None if generator.cache is None else Continuations.of(generator.cache)
        if self._continuations is not None:
            self._continuations.memory_records = CONTINUATIONS
        self.replayed_tokens = 0  # tokens answered from continuation records (a gauge of /metrics)
        self.shared_waits = 0  # jobs that waited for another row's prefill of a prefix they share (``_prefix_waits``)
        self._arriving = 0  # generation requests being read and tokenized (``Arrival``)
        # only where rows that arrive together can prefill in one step (a GPU: ``engine.join_budget``); on the CPU a
        # forward costs its tokens whatever the batch, and waiting made each of four chat turns at 4 clients wait
        # for the others (the 2-core VM: warm TTFT p50 1.70x mlx_lm.server -> ~1.0x with the hold)
        if getattr(generator.engine, "join_budget", 0) <= 0:
            self.coalesce_s = 0.0
        self.arrival_waits = 0  # jobs that waited for such requests before their admission (``_holds_for_arrivals``)
        #: jobs whose record-reading restore waited for rows' first tokens due at the next step (``_first_tokens_wait``)
        self.first_token_waits = 0
        self._thread = threading.Thread(target=self._loop, name="spec-cache-scheduler", daemon=True)
        self.error: BaseException | None = None
        cache = generator.cache
        self._prefetcher = None  # shared-tier lookups happen here, never on the scheduler thread
        if cache is not None and getattr(cache, "shared", None) is not None:
            self._prefetcher = concurrent.futures.ThreadPoolExecutor(PREFETCH_WORKERS,
                                                                     thread_name_prefix="spec-cache-prefetch")

    # -- any thread ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread.ident is None:
            self._thread.start()

    def arrival(self) -> Arrival:
        """A generation request has begun to arrive (``Arrival``): close it at its submit or its answer."""
        return Arrival(self)

    @property
    def arriving(self) -> int:
        """Generation requests being read and tokenized now (``Arrival``)."""
        return self._arriving

    def _arrivals(self, delta: int) -> None:
        with self._lock:
            self._arriving += delta
        if delta < 0:  # a job held for it may go now (a request that failed before its submit sends no message)
            self._inbox.put(("wake", None))

    def held_prefix(self, tenant: str | None, tokens: list[int]) -> int:
        """How many leading ``tokens`` the memory tier holds for ``tenant`` (``MemoryTier.held_prefix``; 0 without
        a cache, or for a tenant it holds nothing of). Any thread: a planning read (the app skips the message
        boundaries it covers), never a restore; the key is derived, not registered (``naming.namespace``)."""
        cache = self.generator.cache
        if cache is None or len(tokens) == 0:
            return 0
        ns_key = self._derived_key(tenant)
        return 0 if ns_key is None else cache.memory.held_prefix(ns_key, tokens)

    def seam_floor(self, tenant: str | None, prompt: list[int]) -> int | None:
        """For the routes' ``seam.message_boundaries``: None when ``prompt``'s prefill will not be split (a warm
        turn's short tail, ``splits_prompt``: its end is the one checkpoint, no message head need be rendered);
        else the offset at or below which a boundary gives no checkpoint (``_phase_end`` skips it): what the memory
        tier or LMDB holds of the prompt for ``tenant`` plus ``MIN_CHECKPOINT_GAP - 1``, or 0 when they hold
        nothing. Any thread (the tokenizer thread asks, before the job exists).

        LMDB is asked (index only, no lock: ``Store.lookup``) when what the memory tier holds would have heads
        rendered: after a restart the memory tier is empty, and rendering every message head of a 16k-token agent
        prompt (~12 tokenizations) cost more than the restore (issue 35, the H100 agent run)."""
        head = prompt[:-1]
        covered = self.held_prefix(tenant, head)
        if covered <= 0 or self.splits_prompt(covered, len(head) - covered):
            covered = max(covered, self.stored_prefix(tenant, head))
        if covered <= 0:
            return 0
        return covered + MIN_CHECKPOINT_GAP - 1 if self.splits_prompt(covered, len(head) - covered) else None

    def stored_prefix(self, tenant: str | None, tokens: list[int]) -> int:
        """How many leading ``tokens`` LMDB holds for ``tenant`` (``Store.lookup``: the index only, nothing read or
        verified; 0 without a cache, for a namespace it holds nothing of, or on a store error). A planning read,
        as ``held_prefix``: never a restore, no hit counted."""
        cache = self.generator.cache
        if cache is None or len(tokens) == 0 or cache.closed:
            return 0
        ns_key = self._derived_key(tenant)
        if ns_key is None:
            return 0
        try:
            hit = cache.store.lookup(ns_key, tokens)
        except StoreError:  # a damaged index, a store gone: plan as if nothing were stored (the restore reports it)
            return 0
        return 0 if hit is None else int(hit.length)

    def _derived_key(self, tenant: str | None) -> bytes | None:
        """``tenant``'s namespace key, derived (``naming.namespace``), not registered: any thread."""
        gen = self.generator
        return gen.ns_key if tenant is None else namespace_key(gen.target_identity, gen.prefix_namespace, tenant)

    @property
    def queue_depth(self) -> int:
        """Jobs accepted and not yet decoding."""
        with self._lock:
            return self._outstanding - self._decoding

    @property
    def active_rows(self) -> int:
        with self._lock:
            return self._decoding

    @property
    def capacity(self) -> int:
        """Jobs accepted at once (decoding and waiting): ``max_rows + max_queue``."""
        return self.max_rows + self.max_queue

    @property
    def row_cap(self) -> int:
        """The most decoding rows one tenant takes when the server has several (module doc: fairness):
        ``max_rows`` less one row per other key (at most half the rows), at least 1, so another key's request
        joins the next round instead of waiting for one of them to finish its generation."""
        if self.tenants <= 1:
            return self.max_rows
        return max(1, self.max_rows - min(self.tenants - 1, self.max_rows // 2))

    def fair_share(self, key: str) -> int | None:
        """The most slots tenant ``key`` (a ``fair_key``) may hold now, or None (one tenant: no share but the
        global cap): ``capacity // max(2, tenants holding slots, itself included)``, at least 1 (module doc). Call
        with the lock held."""
        if self.tenants <= 1:
            return None
        holders = len({k for k, n in self._held.items() if n > 0} | {key})
        return max(1, self.capacity // max(2, holders))

    def submit(self, job: Job) -> None:
        """Queue ``job``; ``APIError(429)`` when ``max_rows + max_queue`` jobs are already in, or its tenant holds
        its ``fair_share`` already (several tenants); 503 when stopping."""
        key = fair_key(job.tenant)
        with self._lock:
            if not self._accepting or not self._thread.is_alive():
                raise APIError(503, "the server is shutting down", code="unavailable")
            if self._outstanding >= self.capacity:
                raise APIError(429, f"the server is overloaded ({self.max_rows} rows decoding, {self.max_queue} "
                               "waiting); retry later", code="overloaded", headers={"Retry-After": "1"})
            share = self.fair_share(key)
            if share is not None and self._held[key] >= share:
                raise APIError(429, f"this API key holds its share of the server ({share} of {self.capacity} "
                               "requests decoding or waiting, shared with the other keys); retry later",
                               code="overloaded", headers={"Retry-After": "1"})
            self._outstanding += 1
            self._held[key] += 1
        job.checkpoint_at = checkpoint_points(job.checkpoint_at, len(job.prompt))
        job.pinned_at = tuple(k for k in job.pinned_at if k in job.checkpoint_at)
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """The client went away: the row leaves at once (no finish checkpoint)."""
        self._inbox.put(("cancel", job))

    def finish(self, job: Job) -> None:
        """A stop string matched: the row leaves as done (its finish checkpoint is written)."""
        self._inbox.put(("finish", job))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the scheduler thread between rounds (it owns the cache: ``/v1/cache/...``); its result
        or exception comes in the returned future. 503 when stopping. While rows decode, calls take at most about
        half the thread's time (``_run_calls``): a tenant's loop of exports of a long prefix (0.8 s each for 3000
        SmolLM2 tokens) would otherwise run back to back between two rounds of every other tenant's rows."""
        with self._lock:
            if not self._accepting or not self._thread.is_alive():
                raise APIError(503, "the server is shutting down", code="unavailable")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the caller's to answer (an APIError, a typed cache error)
                    future.set_exception(exc)
        self._inbox.put(("call", run))
        return future

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let the jobs in finish (up to ``drain_timeout`` s; then cancel them), write the pending
        checkpoints and end the thread."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                if self._outstanding == 0:
                    break
            time.sleep(0.02)
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, drain_timeout))

    # -- the scheduler thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        cache = self.generator.cache
        shared_off_thread = cache.shared_via_prefetch() if self._prefetcher is not None else contextlib.nullcontext()
        try:
            with shared_off_thread:
                self._run()
        except BaseException as exc:  # pragma: no cover - a bug: fail every job rather than hang its client
            log.exception("spec-cache: the scheduler thread failed")
            self.error = exc
            with self._lock:
                self._accepting = False
        finally:
            self._shutdown()

    def _run(self) -> None:
        self._session = self._new_session()
        while True:
            block = not (self._ready() or self._session.busy or self._calls)
            self._take_messages(block, timeout=self._hold_left() if block else 0.5)
            if self._stop.is_set():
                break
            self._run_calls()
            self._iteration()

    def _run_calls(self) -> None:
        """Run waiting ``call``s: all of them while no row decodes; else one, and the next only once rounds have
        taken as long as the calls did since (issue 37, third attacker pass: calls never hold every other row)."""
        while self._calls and (not self._session.busy or self._call_debt <= 0):
            busy = self._session.busy
            began = time.perf_counter()
            self._calls.popleft()()
            if busy:
                self._call_debt += time.perf_counter() - began

    def _iteration(self) -> None:
        """Admit what fits, run one engine step, queue the checkpoints it took; timed into the trace when
        ``SPEC_CACHE_SCHED_TRACE`` asks for one (``trace``)."""
        session, rows = self._session, len(self._rows)
        t0 = time.perf_counter()
        self._admit()
        t1 = time.perf_counter()
        shape = {"waiting": session.waiting_count, "active": session.active_count} if session.busy else None
        if shape is not None:
            self._step()
        t2 = time.perf_counter()
        cache = self.generator.cache
        saved = dict(getattr(cache, "save_seconds", None) or {}) if self._trace is not None else None
        self._write_checkpoints()
        admitted = len(self._rows) - rows
        if self._trace is not None and (admitted or shape):
            parts = getattr(getattr(session, "session", None), "step_parts", None) if shape else None
            # where the checkpoints' time went (``SpecCache.save_seconds``): only in an iteration that took one
            ck_parts = {k: round((v - saved.get(k, 0.0)) * 1e3, 2)
                        for k, v in (getattr(cache, "save_seconds", None) or {}).items()}
            self._trace.record(adm=max(admitted, 0), adm_ms=round((t1 - t0) * 1e3, 3),
                               step_ms=round((t2 - t1) * 1e3, 3), ck_ms=round((time.perf_counter() - t2) * 1e3, 3),
                               pend=len(self._pending), **_write_state(cache), **(shape or {}),
                               **({"parts": {k: round(v * 1e3, 2) for k, v in parts.items()}} if parts else {}),
                               **({"ck_parts": ck_parts} if any(ck_parts.values()) else {}), **_device_memory())

    def _new_session(self) -> CachedSession:
        """The library's decode loop (``decode.cached_session``): restores, the engine session, checkpoints written
        behind the request; a refused restored state is a miss (logged), a failed write is logged."""
        from spec_cache.decode.cached_session import CachedSession

        return CachedSession(self.generator, eos_token_ids=self.eos_token_ids, background=True, cold_fallback=True,
                             on_save_error=_save_failed, on_refused=_refused)

    def _take_messages(self, block: bool, timeout: float = 0.5) -> None:
        try:
            message = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, job: Job | None) -> None:
        if kind == "call":  # ``call``: job is the wrapped function, run in its turn (``_run_calls``)
            self._calls.append(job)
        elif kind == "submit":
            self._hold(job)
            self._pending.append(job)
            self._prefetch(job)
        elif kind in ("cancel", "finish"):
            if job.finished:
                return
            if job.row is None:
                if job in self._pending:
                    self._pending.remove(job)
                    self._done(job, "cancelled")
                return
            if kind == "cancel" and not (job.replayable and self.generator.cache is not None):
                self._session.cancel(job.handle)
            else:  # a replayable job keeps what it generated, for a retry
                self._session.finish(job.handle)

    def _ns_key(self, tenant: str | None) -> bytes | None:
        """``tenant``'s namespace key, named again on every use (``Generator.namespace_key``: a lookup while it is
        registered, registered again once ``SpecCache`` forgot it). Issue 37, seventh pass: a key kept here for good
        was never named again, so another tenant's fresh salts left this tenant's namespace unregistered (its bytes
        on the default tenant; its row, once dropped as empty, refusing every later checkpoint); and that memo grew
        by one entry per ``cache_salt``."""
        return self.generator.namespace_key(tenant)

    def _hold(self, job: Job) -> None:
        """Hold ``job``'s namespace from now until it ends (``_let_go``, from ``_done`` / ``_fail``, the only ways a
        job ends): ``SpecCache`` never forgets a held namespace, so its checkpoints find it registered however many
        namespaces other tenants name meanwhile (issue 37, seventh pass: a job lost its first checkpoint to
        ``2 * max_namespaces`` fresh salts named during its prefill). Held before ``_ns_key`` first names it."""
        cache = self.generator.cache
        if cache is not None and job.held_ns is None:
            job.held_ns = self._derived_key(job.tenant)
            cache.hold(job.held_ns)

    def _let_go(self, job: Job) -> None:
        """``job`` ended: its namespace is forgettable again once no other job holds it."""
        if job.held_ns is not None:
            self.generator.cache.release(job.held_ns)
            job.held_ns = None

    def _prefetch(self, job: Job) -> None:
        """Start the shared-tier lookup of a new job's prompt on the prefetch pool (none without a shared tier,
        for a prompt nothing stored can help, or one LMDB already covers: ``prefetch_shared`` returns at once)."""
        if self._prefetcher is None or len(job.prompt) < 2:
            return
        generator = self.generator
        usable = generator.usable_rule(len(job.prompt))
        if usable is None:
            return
        ns_key = self._ns_key(job.tenant)
        budget = generator.cache.shared.config.lookup_budget_s
        deadline = time.monotonic() + PREFETCH_BUDGETS * budget
        tokens = job.prompt[:-1]

        def run() -> None:
            try:
                generator.cache.prefetch_shared(ns_key, tokens, generator.drafter_namespace, deadline, usable=usable)
            except Exception:  # never: prefetch_shared turns failures into misses; a job must not wait on a bug
                log.exception("spec-cache: shared prefetch failed")
        try:
            job.prefetch = self._prefetcher.submit(run)
        except RuntimeError:  # the pool is shut down (stopping): restore without it
            return
        job.prefetch.add_done_callback(lambda _future: self._inbox.put(("wake", None)))

    def _ready(self) -> bool:
        """Whether a waiting job can be admitted now (its prefetch, if any, is done)."""
        return any(self._admissible(job) for job in self._pending)

    def _next_ready(self) -> Job | None:
        """The next waiting job whose prefetch is done (taken off the queue), or None; a suspect (module doc:
        fault isolation) waits while another one is in the batch. A job back in the queue after its admission (a
        prefill phase's next, a row resumed after a failed step: at the front) goes first; new ones round-robin
        across tenants (module doc: fairness): the first of the tenant admitted least recently (FIFO with one)."""
        best, best_turn = None, None
        rows = collections.Counter(fair_key(job.tenant) for job in self._rows.values()) if self.tenants > 1 else None
        for job in self._pending:
            if not self._admissible(job):
                continue
            if job.admitted_at is not None or self.tenants <= 1:
                best = job
                break
            if rows[fair_key(job.tenant)] >= self.row_cap:
                continue  # the rows kept for the other keys (module doc: fairness)
            turn = self._last_turn.get(fair_key(job.tenant), -1)
            if best_turn is None or turn < best_turn:
                best, best_turn = job, turn
        if best is None:
            return None
        self._pending.remove(best)
        best.prefetch = None
        if best.admitted_at is None:
            self._turn += 1
            self._last_turn[fair_key(best.tenant)] = self._turn
        return best

    def _admissible(self, job: Job) -> bool:
        if job.prefetch is not None and not job.prefetch.done():
            return False
        if job.suspect and any(other.suspect for other in self._rows.values()):
            return False
        return (not self._holds_for_arrivals(job) and not self._echo_waits(job) and not self._prefix_waits(job)
                and not self._first_tokens_wait(job))

    def _first_tokens_wait(self, job: Job) -> bool:
        """Whether ``job`` (new) waits one step for rows whose first token comes at that step (decoding without a
        token yet, or in their last prefill chunk: ``CachedSession.first_tokens_due``) because its restore would
        read LMDB records: ~0.5 s on this thread for a 15k-token 8B prefix, before the step. Issue 35's agent
        restart on the H200 (d49a463): the first session's first token came after the second session's restore
        (525 ms) and its whole prefill, which ran in the step that finished the first one's prefill; both first
        tokens at once, 1490 / 1840 ms. Waiting moves the second's restore and prefill behind the first's token
        (the same work, one round later for it). Bounded: rows are due for at most one step, and a row that joins
        then is the only thing that can make one due again. A memory-tier hit (a few ms) never waits; a shared-tier
        restore is not predicted (its records come from the prefetch, off this thread's clock until then)."""
        if job.prepared is not None or self.generator.cache is None or self._session is None:
            return False
        if not self._session.first_tokens_due:
            return False
        head = job.prompt[:-1]
        if job.stored_hint is None:  # an index read, once a job (every pending job is asked while rows are due)
            job.stored_hint = self.stored_prefix(job.tenant, head)
        if job.stored_hint <= self.held_prefix(job.tenant, head):
            return False
        if not job.deferred:
            job.deferred = True
            self.first_token_waits += 1
        return True

    def _holds_for_arrivals(self, job: Job) -> bool:
        """Whether ``job`` (new: never admitted) waits for generation requests still arriving (``Arrival``): while
        any is, for at most ``coalesce_s`` after its own submit, so that requests sent together prefill in one
        step. A job that waited is counted once in ``arrival_waits``."""
        if self._arriving <= 0 or self.coalesce_s <= 0 or job.prepared is not None:
            return False
        if time.perf_counter() - job.arrived >= self.coalesce_s or not self._leaves_room(job):
            return False
        if not job.coalesced:
            job.coalesced = True
            self.arrival_waits += 1
        return True

    def _leaves_room(self, job: Job) -> bool:
        """Whether a row arriving could join ``job``'s prefill step: a partner of the job's own size would fit beside
        it in the engine's ``join_budget`` (twice its new tokens, the prompt less what the memory tier holds of it,
        within the budget). A job past that prefills alone whatever arrives (the step's budget has no room left
        for a partner like it; past the budget itself the prefill is bound by compute and a partner only makes both
        wait): holding it delays it and gains nothing (issue 35, H100 agent run at 2 clients, b393693: both
        sessions' ~600-1300-token turns held and prefilled together, warm-turn TTFT p50 787 ms where the sessions
        one after the other had read 470). With the GPU budget of 1280 the tool's ~545-token chat turns are held
        in pairs and most agent turns are not. Read once a job (a memory-tier probe, no restore)."""
        if job.room is None:
            budget = getattr(self.generator.engine, "join_budget", 0)
            new = len(job.prompt) - self.held_prefix(job.tenant, job.prompt)
            job.room = 2 * new <= budget
        return job.room

    def _hold_left(self) -> float:
        """How long the scheduler may sleep on its inbox: 0.5 s, or less while a job waits for arrivals (its
        ``coalesce_s`` ends without a message when an arriving request is slow to tokenize)."""
        if self._arriving <= 0:
            return 0.5
        now = time.perf_counter()
        left = [job.arrived + self.coalesce_s - now for job in self._pending if job.prepared is None]
        return min([0.5] + [t + 1e-3 for t in left if t > 0])

    #: a job waits for a row prefilling a prefix of its prompt when that row's checkpoint there would spare it at
    #: least this many tokens of prefill (``_prefix_waits``); a row admitted with jobs queued behind it checkpoints
    #: the longest prefix it shares with them when that is this much past what the cache holds (``_sibling_offsets``)
    SHARED_WAIT_TOKENS = 64

    def _prefix_waits(self, job: Job) -> bool:
        """Whether ``job`` (not yet admitted, no prompt logprobs) waits for an admitted row of its tenant that has
        not delivered its first token and whose prefill will checkpoint a prefix of ``job``'s prompt
        (``RowRequest.checkpoint_at``, or its prefill phase's end) at least ``SHARED_WAIT_TOKENS`` past what the
        cache holds of it: once that checkpoint is in the memory tier, ``job`` restores it and prefills only the
        rest. Requests that arrive together with one long uncached prefix (a shared system prompt: a fleet of
        agents starting, a chat client's first turns, an eval harness's few-shot prefix) forward it once, not
        once each in one batch, as mlx_lm.server's one-at-a-time prompt processing reuses it. Bounded by that
        row's prefill: it stops counting once the row delivers its first token, or leaves."""
        if job.prepared is not None or job.prompt_logprobs is not None or self.generator.cache is None:
            return False
        ahead = 0
        for row_id, row in self._rows.items():
            if row.tenant != job.tenant or row.last_token_at is not None or row.prepared is None:
                continue
            shared = job.shared_with.get(row_id)
            if shared is None:
                shared = job.shared_with[row_id] = common_prefix(row.prompt, job.prompt)
            if shared < self.SHARED_WAIT_TOKENS:
                continue
            offsets = tuple(row.prepared.request.checkpoint_at or ()) + ((row.phase_end,) if row.phase_end else ())
            ahead = max([ahead] + [k for k in offsets if k <= shared])
        if ahead < self.SHARED_WAIT_TOKENS:
            return False
        memory = self.generator.cache.memory
        puts = memory.counters["puts"]  # what it holds of the prompt changes only with a put (asked once per put)
        if job.known_at is None or job.known_at[0] != puts or job.known_at[1] < ahead:
            job.known_at = (puts, ahead, memory.common_prefix(self._ns_key(job.tenant), job.prompt[:ahead]))
        known = job.known_at[2]
        if ahead - known < self.SHARED_WAIT_TOKENS:
            return False
        if not job.waited:
            job.waited = True
            self.shared_waits += 1
        return True

    def _sibling_offsets(self, job: Job, covered: int) -> tuple[int, ...]:
        """Where ``job``'s prefill (first admission, its prompt ``covered`` tokens restored) also checkpoints for
        the jobs queued behind it (same tenant, no prompt logprobs): the longest prefix it shares with each, when
        that is ``SHARED_WAIT_TOKENS`` or more past ``covered``, ``MIN_CHECKPOINT_GAP`` or more before its prompt
        boundary and not within ``MIN_CHECKPOINT_GAP`` after one of ``job``'s own offsets (a chat prompt shares a
        few template tokens past the system message's end: its seam is checkpointed already). At most two, the
        longest; those jobs then wait for them (``_prefix_waits``)."""
        if self.generator.cache is None or job.prompt_logprobs is not None:
            return ()
        boundary = len(job.prompt) - 1
        own = [k for k in job.checkpoint_at if k > covered]
        found: set[int] = set()
        for other in self._pending:
            if other is job or other.tenant != job.tenant or other.prepared is not None \
                    or other.prompt_logprobs is not None:
                continue
            shared = min(common_prefix(job.prompt, other.prompt), boundary)
            if shared - covered < self.SHARED_WAIT_TOKENS or boundary - shared < MIN_CHECKPOINT_GAP:
                continue
            if any(0 <= shared - k < MIN_CHECKPOINT_GAP for k in own):
                continue
            found.add(shared)
        return tuple(sorted(found)[-2:])

    #: an echo job waits for a row whose prompt shares at least this many more tokens than ``prompt_scores`` know
    ECHO_WAIT_SHARED = 32

    def _echo_waits(self, job: Job) -> bool:
        """Whether ``job`` (echo with logprobs, not yet submitted) waits for a row of its tenant and ``logprobs``
        count whose prompt is not scored yet and shares most of ``job``'s (at least half of it, and
        ``ECHO_WAIT_SHARED`` tokens more than ``prompt_scores`` know; that row's prompt at most twice as long):
        once that row's prefill delivers its scores (and checkpoints its prompt), ``job`` restores the shared
        prefix instead of forwarding it too. lm-eval's choices of one question in one batch: one prefills the
        context, the others only their continuations. Bounded by that row's prefill (it sends its scores with
        its first token, or leaves)."""
        if job.prompt_logprobs is None or job.prepared is not None or self.generator.cache is None:
            return False
        size = len(job.prompt)
        shared = max((common_prefix(row.prompt, job.prompt) for row in self._rows.values()
                      if row.prompt_logprobs == job.prompt_logprobs and row.tenant == job.tenant
                      and not row.prompt_sent and len(row.prompt) <= 2 * size), default=0)
        if shared < self.ECHO_WAIT_SHARED or 2 * shared < size:
            return False
        known = self.prompt_scores.longest(job.tenant, job.prompt_logprobs, job.prompt)[0]
        return shared - known >= self.ECHO_WAIT_SHARED

    def _admit(self) -> None:
        session = self._session
        while self._pending and session.active_count + session.waiting_count < self.max_rows:
            job = self._next_ready()
            if job is None:
                break  # the rest wait for their shared-tier prefetch (the batch decodes meanwhile)
            try:
                if not self._submit(job):
                    continue  # answered from the retry table alone
            except Exception as exc:  # a request the engine refuses: this job fails, the others go on
                log.warning("spec-cache: request refused: %s", exc)
                self._fail(job, api_error(exc, context="the engine refused the request", fallback=400))
                continue
            self._rows[job.row] = job
            job.proven = False
            with self._lock:
                self._decoding += 1
            if job.phase_end is None and not job.started:
                self._start(job, job.cached_tokens)
            if self._pending and _read_records(job):
                break  # the next restore after a step: see ``_read_records``

    def _wants_end_checkpoint(self, job: Job) -> bool:
        """Whether ``job``'s own row (just admitted) is checkpointed at ``prompt`` after its first token: asked for
        (``len(prompt)`` in ``checkpoint_at``), not a retry (its replayed tokens are past the prompt), with a cache
        and full-precision KV (a quantized state depends on the whole prompt's length)."""
        end = len(job.prompt)
        return (end in job.checkpoint_at and not job.replayed and end >= 2 and self.generator.cache is not None
                and self.generator.engine.plan is None)

    def _start(self, job: Job, cached_tokens: int) -> None:
        """Deliver ``start`` (and the replayed tokens, for a retry)."""
        job.started, job.cached_tokens = True, cached_tokens
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self.metrics.cached_tokens.inc(cached_tokens)
        job.deliver(("start", cached_tokens))
        if job.replayed:
            self.replayed_tokens += job.replayed
            job.deliver(("tokens", job.output[: job.replayed]))

    def _submit(self, job: Job) -> bool:
        """Restore ``job`` (or its next prefill phase) from the cache and put its row into the session; False when
        the retry table answered it whole (no row)."""
        first = job.prepared is None
        if first and job.replayable and self._replay(job):
            return False
        began = time.perf_counter()
        if first:
            self._observe("queue", began - job.arrived)
        handle = self._prepare(job)
        self._observe("restore", time.perf_counter() - began)
        if first:  # what the cache held of the prompt before this request
            job.cached_tokens = min(job.prepared.cached_tokens, len(job.prompt) - 1)
            if job.replayed:  # a retry: as many replayed tokens as the restored state covers (``prepare``)
                job.replayed = handle.replayed
                del job.output[job.replayed:]
                job.generated = job.checkpointed_at = job.replayed
                self._start(job, job.cached_tokens)
        if first:
            job.shared_at = self._sibling_offsets(job, job.prepared.cached_tokens)
        job.phase_end = self._phase_end(job)
        if job.phase_end is not None:  # the same restored state, a shorter prompt: prefill up to phase_end
            job.prepared.request = dataclasses.replace(job.prepared.request,
                                                       prompt=job.sequence[: job.phase_end + 1], max_tokens=1,
                                                       sampling=None)
        # `prompt` is checkpointed from the job's own row after its first token, not at its boundary before it
        job.end_checkpoint = job.phase_end is None and self._wants_end_checkpoint(job)
        job.prepared.request.boundary_checkpoint = not job.end_checkpoint
        self._score(job)
        # a bad request itself (InvalidRequest) fails in _admit; a refused restored state goes in cold (``_cold``)
        self._session.admit(handle, on_tokens=self._on_tokens, on_finish=self._on_finish, submitted_at=job.arrived,
                            on_cold=lambda handle, exc: self._cold(job))
        job.row = handle.row
        if job.admitted_at is None:
            job.admitted_at = time.perf_counter()
        return True

    def _prepare(self, job: Job):
        """``job``'s row restored (``CachedSession.prepare``; its ``CachedRow``, also ``job.handle``): from
        ``job.sequence``; a retry's replayed tokens (the first time) and a resumed row's delivered ones (``_resume``)
        kept only as far as the restored state covers (``continuations.trim``)."""
        lookup = self._prompt_lookup(job)
        keep = self._keeper(job)
        rider = self._rider(job) if job.replayable else None
        ns_key = self._ns_key(job.tenant)
        if job.resuming and self.generator.engine.plan is not None:
            # KV quantization: a state converts where its whole prompt says, so none of what was delivered is kept
            handle = self._session.prepare(job.prompt, job.max_tokens, job.sampling, ns_key=ns_key, rider=rider,
                                           keep=keep)
        elif job.replayed and (job.prepared is None or job.resuming):
            handle = self._session.prepare(job.prompt, job.max_tokens, job.sampling, ns_key=ns_key,
                                           replay=job.output[: job.replayed], rider=rider, keep=keep, **lookup)
        else:
            handle = self._session.prepare(job.sequence, job.max_tokens - job.replayed, job.sampling, ns_key=ns_key,
                                           rider=rider, keep=keep, **lookup)
        handle.prepared.request.stop_at_eos = job.stop_at_eos
        job.handle, job.prepared = handle, handle.prepared
        if job.resuming:
            self._resume(job, handle.replayed)
        return handle

    def _cold(self, job: Job) -> None:
        """``CachedSession.admit``'s ``on_cold``: the restored state of ``job``'s row was refused (a miss, logged by
        ``_refused``); its row is planned again cold: the whole sequence (no prefill phase); a resumed row whose
        replayed tokens would be prefilled cold generates them again instead (checked against what was sent)."""
        handle, ns_key = job.handle, self._ns_key(job.tenant)
        job.phase_end = None
        handle.prepared = self._session.prepare(job.sequence, job.max_tokens - job.replayed, job.sampling,
                                                ns_key=ns_key, lookup=False).prepared
        handle.prepared.request.stop_at_eos = job.stop_at_eos
        job.end_checkpoint = self._wants_end_checkpoint(job)  # taken once, as on the restored path
        handle.prepared.request.boundary_checkpoint = not job.end_checkpoint
        if not job.started:  # "start" reports what was restored: nothing now (a replay was reported already)
            job.cached_tokens = 0
        if job.failures and job.replayed:  # resumed: a cold prefill of tokens it generated is not exact
            job.resend, job.output = job.output + job.resend, []
            job.replayed = job.generated = job.checkpointed_at = 0
            handle.prepared = self._session.prepare(job.sequence, job.max_tokens, job.sampling, ns_key=ns_key,
                                                    lookup=False).prepared
            handle.prepared.request.stop_at_eos = job.stop_at_eos
        job.prepared = handle.prepared
        self._score(job)

    def _prompt_lookup(self, job: Job) -> dict:
        """``prepare``'s lookup options for ``job``: any restore without prompt logprobs; with them (echo), a
        restore of at most ``n - 1`` tokens where ``prompt_scores`` know the scores of the prompt's first ``n``
        positions (the engine scores the positions after the restored prefix; the table gives the rest, the
        restored prefix's last token included), none once they were sent."""
        if job.prompt_logprobs is None:
            return {"lookup": True}
        if job.prompt_sent or self.generator.cache is None:
            return {"lookup": False}
        if job.prompt_known is None or job.prepared is None:  # first: what the table holds now
            job.prompt_known = self.prompt_scores.longest(job.tenant, job.prompt_logprobs, job.prompt)[1]
        known = len(job.prompt_known)
        return {"lookup": known >= 2, "limit": known - 1}

    def _prompt_scores(self, job: Job, scores: list) -> list:
        """The engine's prompt logprobs of ``job`` (None at position 0 and over the restored prefix) completed
        from the ``prompt_scores`` its restore was limited by, and kept there for later echo requests."""
        known = job.prompt_known or []
        merged = [s if s is not None or p >= len(known) else known[p] for p, s in enumerate(scores)]
        if self.generator.cache is not None and len(merged) == len(job.prompt):
            self.prompt_scores.put(job.tenant, job.prompt_logprobs, job.prompt, merged)
        return merged

    def _score(self, job: Job) -> None:
        """The logprobs ``job`` asks for, on its own row (not on a prefill phase's); the prompt's until sent."""
        if job.phase_end is None:
            job.prepared.request.logprobs = job.logprobs
            job.prepared.request.prompt_logprobs = None if job.prompt_sent else job.prompt_logprobs

    def _resume(self, job: Job, kept: int) -> None:
        """``job`` delivered ``job.output`` before a failed step: its row goes on as a retry of itself, keeping the
        ``kept`` delivered tokens its restored state covers (``_prepare``: ``continuations.trim`` under float KV, as
        a retry does; none under KV quantization); the rest it generates again, checked against what was sent
        (``resend``)."""
        job.resuming = False
        job.resend = job.output[kept:]
        del job.output[kept:]
        job.replayed = job.generated = job.checkpointed_at = kept

    def _observe(self, stage: str, seconds: float) -> None:
        """One observation of ``spec_cache_stage_seconds{stage=...}`` (see ``metrics``), when metrics are on."""
        if self.metrics is not None:
            self.metrics.stage_of(stage).observe(seconds)

    def _replay(self, job: Job) -> bool:
        """Deliver what an identical earlier request generated; True when that answers the job whole."""
        if self._continuations is None:
            return False
        ns_key = self._ns_key(job.tenant)
        previous = self._continuations.get(job.continuation_key(ns_key, self.eos_token_ids), ns_key, len(job.prompt))
        replay, ended = continuation_plan(previous, job.max_tokens, job.stop_at_eos, self.eos_token_ids,
                                          partial=self.generator.engine.plan is None)
        if not replay:
            return False
        # the row continues from prompt + replay, restored from the checkpoint the earlier request left; ``_submit``
        # keeps only as many replayed tokens as the restored state covers (``continuations.trim``)
        job.replayed, job.output = len(replay), list(replay)
        job.generated = job.checkpointed_at = len(replay)
        job.last_token_at = time.perf_counter()
        if ended:
            self._start(job, len(job.prompt) - 1)  # nothing forwarded at all
            reason = "length" if len(replay) == job.max_tokens and replay[-1] not in self.eos_token_ids else "eos"
            self._done(job, reason if job.stop_at_eos else "length")
            return True
        return False

    def _phase_end(self, job: Job) -> int | None:
        """Where the next prefill phase of ``job`` ends, or None when the job's own row should go now. Where the
        engine checkpoints from the prefill chunks themselves (``SpeculativeEngine.prefill_checkpoints``: no
        drafter, float KV, attention-only), there are no phases: every offset goes on the row as
        ``RowRequest.checkpoint_at`` and its state is saved as the prefill passes it (no extra one-token round,
        no restore between phases)."""
        engine = self.generator.engine
        every = self.prefill_checkpoint_every
        if engine.plan is not None or (every is None and not job.checkpoint_at and not job.shared_at) \
                or job.prompt_logprobs is not None:
            return None  # (a scored prompt is forwarded whole by the job's own row)
        covered = max(job.prepared.cached_tokens, job.prefilled)
        boundary = len(job.sequence) - 1
        splits = self.splits_prompt(job.cached_tokens, boundary - covered)
        if engine.prefill_checkpoints:
            job.prepared.request.checkpoint_at = self._prefill_offsets(job, covered, boundary, splits)
            return None
        ends = [(covered // every + 1) * every] if every is not None else []
        ends += [k for k in job.checkpoint_at if k > covered and boundary - k >= MIN_CHECKPOINT_GAP and (
            k in job.pinned_at or (splits and k - covered >= MIN_CHECKPOINT_GAP))]
        end = min(ends, default=None)
        return end if end is not None and end < boundary else None

    def _prefill_offsets(self, job: Job, covered: int, boundary: int, splits: bool) -> tuple[int, ...]:
        """The offsets the phases would have ended at, all at once: each ``checkpoint_every`` multiple past what is
        covered, and the ``checkpoint_at`` offsets the phase rule keeps (pinned ones always; the others when the
        prompt is split, ``MIN_CHECKPOINT_GAP`` or more past the last one kept), none within the gap of the
        prompt boundary; and ``Job.shared_at`` (the prefixes jobs queued behind it share, ``_sibling_offsets``)."""
        every = self.prefill_checkpoint_every
        points = set(range((covered // every + 1) * every, boundary, every)) if every is not None else set()
        points.update(k for k in job.shared_at if covered < k and boundary - k >= MIN_CHECKPOINT_GAP)
        last = covered
        for k in sorted(job.checkpoint_at):
            if k <= covered or boundary - k < MIN_CHECKPOINT_GAP:
                continue
            if k in job.pinned_at or (splits and k - last >= MIN_CHECKPOINT_GAP):
                points.add(k)
                last = k
        return tuple(sorted(points))

    def splits_prompt(self, cached: int, left: int) -> bool:
        """Whether ``checkpoint_at`` offsets inside a prompt split its prefill into phases, for a request the cache
        held ``cached`` tokens of with ``left`` tokens still to forward: when the cache held next to nothing (fewer
        than ``MIN_CHECKPOINT_GAP`` tokens: a chat template's first tokens, which every prompt shares; the prompt's
        prefixes are worth storing: a shared system prompt, a resumable prefill), or at least a prefill chunk is
        left. A warm turn's short tail is not split: a phase would cost its first token a restore and a round (a
        checkpoint from the prefill chunks, a copy of the row's state and its write), for a state the end-of-prompt
        checkpoint covers (a previous reply often re-tokenizes differently from what was
        generated, so its message end is rarely covered already). ``Job.pinned_at`` offsets split it anyway. Any
        thread (the app skips rendering the message boundaries of a prompt that will not be split)."""
        return cached < MIN_CHECKPOINT_GAP or left >= self.generator.engine.prefill_step_size

    def _step(self) -> None:
        began = time.perf_counter()
        try:
            self._session.step()
            self._observe("round", time.perf_counter() - began)
        except Exception as exc:
            self._isolate(exc)
        self._call_debt = max(0.0, self._call_debt - (time.perf_counter() - began))

    def _isolate(self, exc: Exception) -> None:
        """A step raised (module doc: fault isolation): fail its culprit alone, drop the prefix that row restored,
        resume every other row of the batch in a fresh session."""
        jobs = list(self._rows.values())
        self._rows.clear()
        try:  # the checkpoints taken in the failed step are dropped: their state is not to be trusted
            self._session.close(write=False)
        except Exception:  # a broken session may fail to close; its state goes anyway
            log.warning("spec-cache: closing the failed session raised", exc_info=True)
        finally:
            self._session = self._new_session()
        for job in jobs:
            job.failures += 1
        culprit = self._culprit(jobs)
        reason = f"{type(exc).__name__}: {_one_line(exc)}"
        if culprit is None:
            log.exception("spec-cache: an engine step failed (%s); %d rows readmitted one at a time to find the "
                          "culprit", reason, len(jobs), exc_info=exc)
        else:
            log.error("spec-cache: an engine step failed (%s); failing its culprit alone, %d other rows resume",
                      reason, len(jobs) - 1, exc_info=exc)
        survivors = []
        for job in jobs:
            if job is culprit:
                dropped = self._drop_restored(job)
                note = f" (the {dropped}-token prefix it restored was dropped from the cache)" if dropped else ""
                self._fail(job, APIError(500, f"generation failed: {reason}{note}", code="engine_error"))
                continue
            with self._lock:
                self._decoding -= 1
            job.row = None
            if job.phase_end is not None:  # a prefill phase: it is simply planned again
                job.phase_end = None
            elif job.started:
                job.replayed, job.resuming = len(job.output), True
            survivors.append(job)
        # a suspect that restored a prefix goes first (restored state is what fails a step that a row joins)
        survivors.sort(key=lambda job: not (job.suspect and _restored(job)))
        self._pending.extendleft(reversed(survivors))

    def _culprit(self, jobs: list[Job]) -> Job | None:
        """The job a failed step is blamed on, or None (then the candidates become suspects, readmitted one at a
        time). The only row; else the only row new in the batch (not proven) if it restored a prefix (what fails a
        step a row joins) or no suspect shares the batch; else the only suspect, unless a new row restored a
        prefix; else one in ``MAX_FAILURES`` failed steps."""
        if len(jobs) == 1:
            return jobs[0]
        fresh = [job for job in jobs if not job.proven]
        suspects = [job for job in jobs if job.suspect]
        if len(fresh) == 1 and (_restored(fresh[0]) or not suspects):
            return fresh[0]
        if len(suspects) == 1 and not any(_restored(job) for job in fresh):
            return suspects[0]
        candidates = [job for job in jobs if job in fresh or job in suspects] or jobs
        worn = [job for job in candidates if job.failures >= MAX_FAILURES]
        if worn:
            return worn[0]
        for job in candidates:
            job.suspect = True
        return None

    def _drop_restored(self, job: Job) -> int:
        """Drop from the cache the prefix ``job``'s row restored (a poisoned entry fails every row it is restored
        into); the number of tokens it covered, 0 for none."""
        cache, prepared = self.generator.cache, job.prepared
        if cache is None or not _restored(job):
            return 0
        tokens = list(prepared.request.prompt[: _restored(job)])
        try:
            cache.drop(prepared.ns_key, tokens)
        except Exception:  # a cache never takes the server down
            log.exception("spec-cache: the poisoned prefix of %d tokens could not be dropped", len(tokens))
            return 0
        return len(tokens)

    def _on_tokens(self, handle, tokens: list, scored=None) -> None:
        job = self._rows.get(handle.row)
        if job is None:
            return
        job.proven = True
        if job.phase_end is not None:
            return
        if scored is not None and scored.prompt is not None and not job.prompt_sent:
            job.prompt_sent = True
            job.deliver(("prompt_logprobs", self._prompt_scores(job, scored.prompt)))
        if job.resend:
            tokens = self._resent(job, handle, tokens)
            if not tokens:
                return
        now = time.perf_counter()
        if self.metrics is not None:
            if job.last_token_at is None:
                self.metrics.ttft.observe(now - job.arrived)
                self._observe("prefill", now - (job.admitted_at or job.arrived))
                following = len(tokens) - 1
            else:
                following = len(tokens)
                for _ in range(following):
                    self.metrics.token_latency.observe((now - job.last_token_at) / following)
            self.metrics.generated_tokens.inc(len(tokens))
        if self._trace is not None and job.last_token_at is None:
            self._trace.record(first=1, queue_ms=round(((job.admitted_at or now) - job.arrived) * 1e3, 3),
                               ttft_ms=round((now - job.arrived) * 1e3, 3), cached=job.cached_tokens,
                               prompt=len(job.prompt),
                               **({} if job.received is None else
                                  {"http_ms": round((job.arrived - job.received) * 1e3, 3)}))
        job.last_token_at = now
        job.generated += len(tokens)
        job.output += tokens
        if scored is not None and job.logprobs is not None:
            job.deliver(("tokens", list(tokens), scored.tokens[len(scored.tokens) - len(tokens):]))
        else:
            job.deliver(("tokens", list(tokens)))
        self._observe("stream", time.perf_counter() - now)
        if job.end_checkpoint:  # the row holds exactly the prompt now (its first token is not forwarded yet)
            job.end_checkpoint = False
            if len(job.output) == 1:
                self._session.checkpoint(handle)  # taken at the end of this step
        self._checkpoint_due(job, handle)

    def _resent(self, job: Job, handle, tokens: list) -> list:
        """A resumed row's ``tokens``: those its client has already (``resend``) are taken as generated, not sent;
        the rest are returned. Ones that differ from what was sent fail the job (never a silent wrong answer)."""
        again = list(tokens[: len(job.resend)])
        if again != job.resend[: len(again)]:
            self._rows.pop(handle.row, None)
            self._session.cancel(handle)
            self._fail(job, APIError(500, "generation failed: the row resumed after a failed step generated other "
                                     "tokens than it had sent", code="engine_error"))
            return []
        del job.resend[: len(again)]
        job.output += again
        job.generated += len(again)
        job.last_token_at = time.perf_counter()
        self._checkpoint_due(job, handle)
        return list(tokens[len(again):])

    def _checkpoint_due(self, job: Job, handle) -> None:
        """Ask for the row's checkpoint when ``checkpoint_every`` more tokens were generated since its last."""
        every = self.checkpoint_every
        if every is not None and job.generated - job.checkpointed_at >= every and job.generated < job.max_tokens:
            job.checkpointed_at = job.generated
            self._session.checkpoint(handle)  # taken at the end of this step

    def _on_finish(self, handle, result) -> None:
        job = self._rows.pop(handle.row, None)
        if job is None:
            return
        job.proven = True
        with self._lock:
            self._decoding -= 1
        if job.phase_end is not None and not result.cancelled:
            job.prefilled, job.phase_end, job.row = job.phase_end, None, None
            self._pending.appendleft(job)  # the next phase (or the job itself) restores from this one
            return
        failure = _grammar_failure(job)
        if failure is not None:  # its grammar failed (``rows.grammar`` module doc): this row's own error
            job.row = None  # its row is counted off already
            self._fail(job, APIError(422, failure, param="response_format", code="invalid_schema"))
            return
        self._done(job, result.reason or ("cancelled" if result.cancelled else "length"))

    def _keeper(self, job: Job) -> Callable[[list], bool]:
        """``CachedSession``'s ``keep`` for ``job``'s row: which of its checkpoints are worth saving. None once the
        row left the batch; a prefill phase keeps only its prompt-boundary checkpoint."""
        def keep(tokens: list) -> bool:
            if self._rows.get(job.row) is not job:
                return False
            return job.phase_end is None or len(tokens) == job.phase_end
        return keep

    def _rider(self, job: Job):
        """``CachedSession``'s ``rider`` for a replayable ``job``: each checkpoint's continuation record."""
        return lambda handle, tokens: self._continuation_record(job, tokens)

    def _continuation_record(self, job: Job, tokens: list):
        """The continuation record a checkpoint of ``tokens`` supports, or None (``CachedSession`` holds it in
        memory at once and writes it with its checkpoint)."""
        if not job.replayable or job.phase_end is not None or self._continuations is None:
            return None
        if job.sampling.grammar is not None and job.sampling.grammar.failed:
            return None  # an output its grammar cut is never replayed as an answer
        ns_key = job.prepared.ns_key
        return continuation_record(job.continuation_key(ns_key, self.eos_token_ids), ns_key, job.prompt,
                                   job.output, len(tokens), finished=job.generated >= job.max_tokens or
                                   bool(job.output) and job.output[-1] in self.eos_token_ids)

    def _write_checkpoints(self) -> None:
        """Write the checkpoints the step took (the memory tier now, LMDB behind: ``CachedSession``), timed."""
        session = self._session
        if session is None or not session.pending_checkpoints:
            return
        began = time.perf_counter()
        session.write_checkpoints()
        self._observe("checkpoint", time.perf_counter() - began)

    def _done(self, job: Job, reason: str) -> None:
        if job.finished:
            return
        job.finished = True
        with self._lock:
            self._release(job)
        self._let_go(job)
        job.deliver(("done", reason, job.generated))

    def _fail(self, job: Job, error: APIError) -> None:
        if job.finished:
            return
        job.finished = True
        with self._lock:
            self._release(job)
            if job.row is not None:
                self._decoding -= 1
        self._let_go(job)
        job.deliver(("error", error))

    def _release(self, job: Job) -> None:
        """``job`` is finished: its slot goes back (globally and its tenant's). Call with the lock held."""
        self._outstanding -= 1
        key = fair_key(job.tenant)
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]

    def _shutdown(self) -> None:
        """Cancel what is left (a drain that timed out), write the checkpoints taken so far, free the batch."""
        with self._lock:
            self._accepting = False
        session = self._session
        for job in list(self._rows.values()):
            try:
                session.cancel(job.handle)
            except Exception:  # pragma: no cover - the session may be broken after a failure
                self._rows.pop(job.row, None)
                self._fail(job, APIError(503, "the server is shutting down", code="unavailable"))
        while self._pending:
            self._done(self._pending.popleft(), "cancelled")
        if self._trace is not None:
            self._trace.close()
        while True:  # submissions that raced with the stop
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._done(job, "cancelled")
            elif kind == "call":
                self._calls.append(job)
        while self._calls:  # their callers wait on them: answered (the cache is closed after this thread)
            self._calls.popleft()()
        self._write_checkpoints()
        if self._prefetcher is not None:
            # a lookup under way ends within its budget; the cache (closed after this thread) outlives it
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if session is not None:
            session.close()
