"""From a request to a scheduler job and back: what every generating route shares (OpenAI's and Anthropic's).

``Requests`` holds the machinery ``create_app`` once kept in closures: reading a bounded JSON body, tokenizing in a
worker thread (one tokenizer call at a time, never on the event loop), checking a prompt against the context and
building its ``Job``, submitting it and answering, streamed (``_EventStream``: server-sent events that notice a
disconnect) or as one body (waiting for the result or the client's disconnect, whichever comes first), and the
per-request metrics and log line. Responses are OpenAI's unless the route passes a ``shape`` (``anthropic.py``).
``run_choices`` answers several choices (``n > 1``, batched prompts), a job each: in one body, or streamed with
each chunk's choice ``index`` (``_sse_choices``).

Why one file: every generating route's answer is built from the same parts (the ``_Run`` record, the events a job
delivers turned into text pieces, the disconnect watch, the accounting); ``run_job`` and ``run_choices`` are two
answers over them, and splitting them would move those private parts across modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from spec_cache.apps.server.auth import salted_tenant, tenant_label
from spec_cache.apps.server.detokenizer import StopMatcher, StreamingDetokenizer
from spec_cache.apps.server.limits import TenantTurns
from spec_cache.apps.server.logprobs import Scoring, chat_logprobs, completion_logprobs
from spec_cache.apps.server.protocol import (
    APIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    usage,
    with_choices,
)
from spec_cache.apps.server.scheduler import Job, Scheduler, random_seed
from spec_cache.apps.server.tools import active_tools, tool_pieces, tool_style
from spec_cache.rows.grammar import Grammar, GrammarError
from spec_cache.rows.sampling import RowSampling

log = logging.getLogger("spec_cache.apps.server")

__all__ = ["Requests", "error_response", "log_request"]

_JSON_IN_THREAD = 256 << 10  # decode bodies larger than this in a worker thread


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: 413 past it (from Content-Length, or as the bytes arrive), 499 if
    the client leaves meanwhile."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    except ClientDisconnect:
        raise APIError(499, "the client went away while sending its request") from None
    return bytes(body)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def log_request(line: str, status: int, tenant: str, started: float, *, rid: str = "-", prompt: int | None = None,
                cached: int | None = None, generated: int | None = None, first: float | None = None,
                error: str | None = None) -> None:
    """One INFO line per request: method and path, status, id, tenant label (8 hex of the key's digest, never the
    key), prompt / cached / generated tokens, time to first token and in all (ms). ``cached`` is the exact count
    (the operator's log, not the client's answer)."""
    now = time.perf_counter()
    parts = [f"spec-cache serve: {line} {status} id={rid} tenant={tenant}"]
    if prompt is not None:
        parts.append(f"prompt={prompt}")
    if cached is not None:
        parts.append(f"cached={cached}")
    if generated is not None:
        parts.append(f"generated={generated}")
    if first is not None:
        parts.append(f"ttft_ms={(first - started) * 1e3:.1f}")
    parts.append(f"ms={(now - started) * 1e3:.1f}")
    if error:
        parts.append(f"error={error}")
    log.info(" ".join(parts))


@dataclass
class _Run:
    """One submitted job and what its answer, its metrics and its log line need."""

    job: Job
    rid: str
    endpoint: str
    tenant: str | None
    label: str          # tenant_label(tenant)
    line: str           # "METHOD /path"
    started: float
    prompt_tokens: int
    timing: dict


class Requests:
    """The shared machinery of the generating routes over one ``ServerState`` (``anthropic.messages_routes``
    takes it as its ``ctx``: ``state``, ``read_json``, ``tokenize``, ``run_job``, ``count``, ``log_request``,
    ``tenant_label``, ``granularity``, ``clock``)."""

    log_request = staticmethod(log_request)
    tenant_label = staticmethod(tenant_label)
    clock = staticmethod(time.perf_counter)

    def __init__(self, state) -> None:
        self.state = state
        self.config = state.config
        self.metrics = state.metrics
        self.scheduler: Scheduler = state.scheduler
        self.tokenizer = state.tokenizer
        self.granularity = max(1, int(self.config.cached_tokens_granularity))
        # one tokenizer call at a time (HF fast tokenizers are not re-entrant for every setting), in a worker
        # thread: the event loop never waits on one
        self.tokenize_limiter = anyio.CapacityLimiter(1)
        # a tenant's tokenizing, one request at a time in that worker, across every route (chat, completions,
        # messages, cache routes): with a turn per route family, one tenant flooding them all had four requests
        # queued ahead of another tenant's (issue 37, fifth attacker pass)
        self.turns = TenantTurns()

    def count(self, endpoint: str, status: int, tenant: str | None = None, known: bool = True) -> None:
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if known:  # a request whose key was refused has no tenant to count it under
            self.metrics.tenant_requests.labels(tenant=tenant_label(tenant), status=str(status)).inc()

    def tenant_of(self, request: Request) -> str | None:
        return self.state.auth.check(request.headers.get("authorization"))

    def arriving(self, request: Request):
        """Open ``request``'s ``scheduler.Arrival`` (a generation route, before it reads the body): closed at its
        submit (``run_job``, ``run_choices``) or by the route when it answers without one."""
        arrival = self.scheduler.arrival()
        request.state.arrival = arrival
        return arrival

    async def tokenize(self, fn, *args) -> list[int]:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.tokenize_limiter)

    async def tokenize_as(self, tenant, fn, *args) -> list[int]:
        """``tokenize`` in ``tenant``'s turn (``turns``): its flood waits behind itself, on every route at once."""
        async with self.turns.turn(tenant):
            return await self.tokenize(fn, *args)

    async def read_json(self, request: Request) -> Any:
        """The body as JSON: 413 past ``max_body_bytes`` (from Content-Length, or as the bytes arrive), 499 if the
        client leaves meanwhile, 400 if it is not JSON; a large body is decoded in a worker thread."""
        body = await read_body(request, self.config.max_body_bytes)
        try:
            if len(body) > _JSON_IN_THREAD:
                return await anyio.to_thread.run_sync(json.loads, bytes(body), limiter=self.tokenize_limiter)
            return json.loads(body)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def max_tokens(self, params, prompt: list[int]) -> int:
        """``params.max_tokens`` (default: the configured one, within the room left) once the prompt is checked
        against ``max_prompt_tokens`` and the context (400 ``context_length_exceeded`` otherwise)."""
        config = self.config
        if not prompt:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        limit = config.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server takes at most {limit}",
                           param="messages", code="context_length_exceeded")
        room = config.context_tokens - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; the model's context is "
                           f"{config.context_tokens}", param="messages", code="context_length_exceeded")
        max_tokens = params.max_tokens
        if max_tokens is None:
            return min(config.default_max_tokens, room)
        if max_tokens > room:
            raise APIError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                           f"context of {config.context_tokens} tokens", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def make_job(self, params, prompt: list[int], tenant: str | None, deliver, checkpoint_at=(), pinned_at=(),
                 choice: int = 0, scoring: Scoring = Scoring()) -> Job:
        """``choice``: the index of this job among a request's ``n`` choices of one prompt: an explicit seed is
        taken as ``seed + choice`` (reproducible, and the choices differ); greedy choices are all the same.
        ``scoring``: the request's logprob options (``logprobs``); a job with logprobs is never answered from a
        stored answer (which has none)."""
        max_tokens = self.max_tokens(params, prompt)
        if scoring.prompt_logprobs is not None and self.scheduler.generator.engine.plan is not None:
            raise APIError(422, "'echo' with 'logprobs' (prompt logprobs) is not supported with KV quantization",
                           param="echo", code="unsupported_parameter")
        temperature = self.config.default_temperature if params.temperature is None else params.temperature
        seed = params.seed + choice if params.seed is not None else (0 if temperature == 0 else random_seed())
        sampling = RowSampling(temperature=temperature, top_p=params.top_p, seed=int(seed), top_k=params.top_k,
                               min_p=params.min_p, grammar=self.grammar(params), **params.processors)
        return Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, deliver=deliver,
                   tenant=salted_tenant(tenant, params.cache_salt), stop_at_eos=not params.ignore_eos,
                   replayable=(temperature == 0 or params.seed is not None) and scoring.logprobs is None,
                   checkpoint_at=tuple(checkpoint_at), pinned_at=tuple(pinned_at), logprobs=scoring.logprobs,
                   prompt_logprobs=scoring.prompt_logprobs)

    def grammar(self, params) -> Grammar | None:
        """The grammar of ``params.response_format`` (None: plain text) over the served tokenizer, its EOS ids those
        the scheduler stops at; a schema llguidance refuses is a 422, ``ignore_eos`` beside it a 400."""
        spec = getattr(params, "response_format", None)
        if spec is None:
            return None
        if params.ignore_eos:
            raise APIError(400, "'ignore_eos' cannot be combined with 'response_format' (the output ends where the "
                           "JSON does)", param="ignore_eos", code="unsupported_parameter")
        eos = self.scheduler.eos_token_ids
        try:
            if spec["type"] == "json_object":
                return Grammar.json_object(self.tokenizer, eos_token_ids=eos)
            return Grammar.json_schema(self.tokenizer, spec["schema"], eos_token_ids=eos)
        except GrammarError as exc:
            raise APIError(422, f"'response_format': {str(exc).splitlines()[0] if str(exc) else 'refused'}",
                           param="response_format", code="invalid_schema") from None
        except Exception as exc:  # a tokenizer llguidance cannot read: refused, never ignored
            raise APIError(422, f"'response_format' is not available for this model's tokenizer "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})",
                           param="response_format", code="unsupported_parameter") from None

    async def run_job(self, request: Request, endpoint: str, params, prompt: list[int], tenant: str | None,
                      chat: bool, started: float, checkpoint_at=(), shape=None, pinned_at=(),
                      scoring: Scoring = Scoring()) -> Response:
        """Submits the job and answers: an event stream (``params.stream``) or one JSON body. ``shape``
        (``anthropic.py``) makes the id, the stream and the body; without it they are OpenAI's. ``scoring``: the
        logprob options (``logprobs``; OpenAI's routes only)."""
        events, deliver = _event_queue()
        job = self.make_job(params, prompt, tenant, deliver, checkpoint_at, pinned_at, scoring=scoring)
        job.received = started
        self.scheduler.submit(job)
        _arrived(request)
        rid = shape.new_id() if shape is not None else new_id("chatcmpl" if chat else "cmpl")
        run = _Run(job, rid, endpoint, tenant, tenant_label(tenant), f"{request.method} {request.url.path}",
                   started, len(prompt), {})
        pieces = _pieces(job, events, self.tokenizer, params.stop, self.scheduler, self.granularity, run.timing,
                         scoring)
        if chat and active_tools(params.tools, params.tool_choice):  # tool calls parsed out of the text
            pieces = tool_pieces(pieces, tool_style(self.tokenizer))
        if params.stream:
            return self._stream(run, pieces, params, chat, shape, scoring)
        return await self._reply(request, run, pieces, params, chat, shape, scoring)

    async def run_choices(self, request: Request, endpoint: str, params, prompts: list[list[int]],
                          tenant: str | None, chat: bool, started: float, checkpoint_at=(),
                          scoring: Scoring = Scoring()) -> Response:
        """Several choices in one body: ``params.n`` for each of ``prompts`` (OpenAI's order: prompt by prompt),
        each a job of its own in the batch; one 499 if the client leaves first (every row ends). Usage counts each
        prompt once and every choice's tokens."""
        runs, streams = [], []
        rid = new_id("chatcmpl" if chat else "cmpl")
        for p, prompt in enumerate(prompts):
            for j in range(params.n):
                events, deliver = _event_queue()
                # the prompt's boundaries are checkpointed once (by its first choice), not n times
                job = self.make_job(params, prompt, tenant, deliver, checkpoint_at if p == j == 0 else (), choice=j,
                                    scoring=scoring)
                run = _Run(job, rid, endpoint, tenant, tenant_label(tenant), f"{request.method} {request.url.path}",
                           started, len(prompt) if j == 0 else 0, {})
                pieces = _pieces(job, events, self.tokenizer, params.stop, self.scheduler, self.granularity,
                                 run.timing, scoring)
                calls: list = []
                if chat and active_tools(params.tools, params.tool_choice):
                    pieces = tool_pieces(pieces, tool_style(self.tokenizer))
                runs.append((run, calls))
                streams.append(pieces)
        submitted = []
        try:
            for run, _ in runs:
                self.scheduler.submit(run.job)  # 429 when the queue is full: the choices already in go too
                submitted.append(run.job)
        except BaseException:
            for job in submitted:
                self.scheduler.cancel(job)
            raise
        _arrived(request)
        if params.stream:
            return self._stream_choices([run for run, _ in runs], streams, params, chat, scoring)
        scores: list[list] = [[] for _ in runs]
        collects = [_collect(pieces, calls, entries) for pieces, (_, calls), entries in zip(streams, runs, scores)]
        try:
            answered, results = await _unless_gone(request, asyncio.gather(*collects))
        except BaseException:  # one choice's error (a grammar that failed its row) is the answer: the others end
            for run, _ in runs:  # now, not at their max_tokens with nobody waiting for them
                self.scheduler.cancel(run.job)
            raise
        if not answered:
            self.count(endpoint, 499, tenant)
            for run, _ in runs:
                self.scheduler.cancel(run.job)
            log_request(runs[0][0].line, 499, runs[0][0].label, started, rid=rid,
                        prompt=sum(len(p) for p in prompts))
            return Response(status_code=499)
        prompt_tokens = sum(run.prompt_tokens for run, _ in runs)
        generated = sum(r[2] for r in results)
        cached = sum(r[3] for (run, _), r in zip(runs, results) if run.prompt_tokens)
        first = min((run.timing["first"] for run, _ in runs if "first" in run.timing), default=None)
        self.metrics.account(runs[0][0].label, prompt_tokens, cached, generated)
        log_request(runs[0][0].line, 200, runs[0][0].label, started, rid=rid, prompt=prompt_tokens, cached=cached,
                    generated=generated, first=first)
        use = usage(prompt_tokens, generated, cached)
        bodies = [_scored(chat_response(rid, params.model, text, reason, use, calls) if chat
                          else completion_response(rid, params.model, text, reason, use), chat, scoring, entries)
                  for (text, reason, _, _), (_, calls), entries in zip(results, runs, scores)]
        self.count(endpoint, 200, tenant)
        return JSONResponse(with_choices(bodies))

    def _stream_choices(self, runs: list, streams: list, params, chat: bool, scoring: Scoring = Scoring()
                        ) -> Response:
        """Several choices as one event stream: each chunk carries its choice's ``index`` (OpenAI's ``n`` streamed),
        choices interleaved as their rows deliver; the usage chunk (when asked) counts each prompt once and every
        choice's tokens, after the last choice ends. A client that leaves ends every row."""
        first = runs[0]
        self.count(first.endpoint, 200, first.tenant)
        prompt_tokens = sum(run.prompt_tokens for run in runs)

        def account(ended: list[tuple[int, int]]) -> tuple[int, int]:
            """Metrics and the log line; returns (generated, cached): a prompt's cached tokens counted once."""
            generated = sum(g for g, _ in ended)
            cached = sum(c for run, (_, c) in zip(runs, ended) if run.prompt_tokens)
            self.metrics.account(first.label, prompt_tokens, cached, generated)
            stamps = [run.timing["first"] for run in runs if "first" in run.timing]
            log_request(first.line, 200, first.label, first.started, rid=first.rid, prompt=prompt_tokens,
                        cached=cached, generated=generated, first=min(stamps, default=None))
            return generated, cached

        def cancel_all() -> None:
            for run in runs:
                self.scheduler.cancel(run.job)

        def gone() -> None:
            cancel_all()
            log_request(first.line, 499, first.label, first.started, rid=first.rid, prompt=prompt_tokens)
        out = _sse_choices(streams, first.rid, params, int(time.time()), chat, prompt_tokens, account, cancel_all,
                           scoring)
        return _EventStream(out, on_disconnect=gone)

    def _account(self, run: _Run, generated: int, cached: int) -> None:
        self.metrics.account(run.label, run.prompt_tokens, cached, generated)
        log_request(run.line, 200, run.label, run.started, rid=run.rid, prompt=run.prompt_tokens,
                    cached=run.timing.get("cached", cached), generated=generated, first=run.timing.get("first"))

    def _gone(self, run: _Run) -> None:
        """The client left before the answer was complete: its row ends now."""
        self.scheduler.cancel(run.job)
        log_request(run.line, 499, run.label, run.started, rid=run.rid, prompt=run.prompt_tokens,
                    first=run.timing.get("first"))

    def _stream(self, run: _Run, pieces, params, chat: bool, shape, scoring: Scoring = Scoring()) -> Response:
        self.count(run.endpoint, 200, run.tenant)

        def account(generated: int, cached: int) -> None:
            self._account(run, generated, cached)
        out = (shape.stream(pieces, run.rid, run.timing, account) if shape is not None
               else _sse(pieces, run.rid, params, int(time.time()), chat, run.prompt_tokens, account, scoring))
        return _EventStream(out, on_disconnect=lambda: self._gone(run))

    async def _reply(self, request: Request, run: _Run, pieces, params, chat: bool, shape,
                     scoring: Scoring = Scoring()) -> Response:
        calls: list = []
        entries: list = []
        answered, result = await _unless_gone(request, _collect(pieces, calls, entries))
        if not answered:
            self.count(run.endpoint, 499, run.tenant)
            self._gone(run)
            return Response(status_code=499)
        text, reason, generated, cached = result
        self._account(run, generated, cached)
        if shape is not None:
            self.count(run.endpoint, 200, run.tenant)
            return JSONResponse(shape.body(run.rid, text, reason, generated, cached, run.timing))
        use = usage(run.prompt_tokens, generated, cached)
        body = (chat_response(run.rid, params.model, text, reason, use, calls) if chat
                else completion_response(run.rid, params.model, text, reason, use))
        self.count(run.endpoint, 200, run.tenant)
        return JSONResponse(_scored(body, chat, scoring, entries))


class _EventStream(StreamingResponse):
    """Server-sent events that always watch for the client's disconnect (whatever ASGI spec version the server
    speaks) and call ``on_disconnect`` when the stream did not end by itself."""

    def __init__(self, content, on_disconnect) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        completed = False

        async def stream() -> None:
            nonlocal completed
            try:
                await self.stream_response(send)
                completed = True
            except OSError:
                pass
            task_group.cancel_scope.cancel()

        async def listen() -> None:
            await self.listen_for_disconnect(receive)
            task_group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(stream)
                task_group.start_soon(listen)
        finally:
            if not completed:
                self.on_disconnect()


def _event_queue() -> tuple[asyncio.Queue, Any]:
    """A job's event queue on this event loop and the thread-safe ``deliver`` the scheduler thread calls."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def deliver(event: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
            loop.call_soon_threadsafe(events.put_nowait, event)
    return events, deliver


def _arrived(request: Request) -> None:
    """Close the request's ``Arrival`` (opened by ``Requests.arriving``; none on a route that opens none)."""
    arrival = getattr(request.state, "arrival", None)
    if arrival is not None:
        arrival.done()


async def _unless_gone(request: Request, work) -> tuple[bool, Any]:
    """``(True, result)`` of awaiting ``work``, or ``(False, None)`` when the client disconnects first (``work`` is
    cancelled then)."""
    collect = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if collect not in done:
        collect.cancel()
        return False, None
    return True, collect.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _pieces(job: Job, events: asyncio.Queue, tokenizer, stops: list[str], scheduler: Scheduler,
            granularity: int = 1, timing: dict | None = None, scoring: Scoring = Scoring()) -> AsyncIterator[tuple]:
    """Text pieces of a job as ``("text", str)``, then ``("end", finish_reason, completion_tokens, cached)``;
    ``cached`` rounded down to a multiple of ``granularity`` (what clients may learn about stored prefixes).
    ``timing["first"]``: when the first tokens arrived; ``timing["cached"]``: the exact cached count. A request
    with logprobs or echo (``scoring``) gets ``_scored_pieces`` instead."""
    if scoring.active:
        return _scored_pieces(job, events, tokenizer, stops, scheduler, granularity, timing, scoring)
    return _plain_pieces(job, events, tokenizer, stops, scheduler, granularity, timing)


async def _plain_pieces(job: Job, events: asyncio.Queue, tokenizer, stops: list[str], scheduler: Scheduler,
                        granularity: int = 1, timing: dict | None = None) -> AsyncIterator[tuple]:
    timing = {} if timing is None else timing
    detokenizer = StreamingDetokenizer(tokenizer)
    matcher = StopMatcher(stops)
    generated = cached = 0
    while True:
        event = await events.get()
        kind = event[0]
        if kind == "start":
            timing["cached"] = event[1]
            cached = event[1] - event[1] % granularity
        elif kind == "tokens":
            timing.setdefault("first", time.perf_counter())
            generated += len(event[1])
            stopped = False
            for token in event[1]:  # a piece per token: a replayed answer (or a drafted round) streams as
                text, stopped = matcher.feed(detokenizer.add([token]))  # generated ones do, not as one chunk
                if text:
                    yield ("text", text)
                if stopped:
                    break
            if stopped:
                scheduler.finish(job)  # the row leaves at the end of its round, its finish checkpoint written
                timing["stop_sequence"] = matcher.matched
                yield ("end", "stop", generated, cached)
                return
        elif kind == "done":
            _, reason, _ = event
            text, stopped = matcher.feed(detokenizer.flush())
            text += "" if stopped else matcher.flush()
            if text:
                yield ("text", text)
            if reason == "cancelled":
                raise APIError(503, "the request was cancelled (the server is shutting down)", code="cancelled")
            yield ("end", "length" if reason == "length" else "stop", generated, cached)
            return
        elif kind == "error":
            raise event[1]


class _TokenTexts:
    """Each token's text for logprobs: ``tokenizer.decode([id])`` (special tokens kept), memoized per request."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.memo: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.memo.get(token)
        if text is None:
            text = self.memo[token] = self.tokenizer.decode([int(token)], skip_special_tokens=False)
        return text

    def entry(self, scored, offset: int) -> dict:
        """One scored token (a ``TokenLogprob``; None: the prompt's first token, which nothing scores)."""
        if scored is None:
            return {"token": None, "logprob": None, "top": [], "offset": offset}
        return {"token": self(scored.token), "logprob": _finite(scored.logprob), "offset": offset,
                "top": [(self(t), t, _finite(lp)) for t, lp in scored.top]}


#: the logprob answered for a token the row's distribution gives (numerically) zero probability: OpenAI's value.
#: JSON has no -inf: a grammar's mask leaves every other token at -inf, and ``top_logprobs`` / ``logprobs: N`` over
#: it answered a 500 "Out of range float values are not JSON compliant" (issue 37, fourth attacker pass)
LOGPROB_FLOOR = -9999.0


def _finite(logprob) -> float:
    logprob = float(logprob)
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _echo(job: Job, tokenizer, texts: _TokenTexts, scores: list | None, scoring: Scoring) -> tuple[str, list]:
    """The echoed prompt's text and, with logprobs, one entry per prompt token (``scores``: the engine's, one per
    position, None at the first)."""
    detokenizer = StreamingDetokenizer(tokenizer)
    entries = []
    for position, token in enumerate(job.prompt):
        offset = len(detokenizer.text)
        detokenizer.add([token])
        if scoring.logprobs is not None:
            entry = texts.entry(None if scores is None else scores[position], offset)
            if entry["token"] is None:
                entry["token"] = texts(token)
            entries.append(entry)
    detokenizer.flush()
    if scoring.logprobs is not None and (scores is None or len(scores) != len(job.prompt)):
        raise APIError(500, "the prompt's logprobs did not come back whole", code="engine_error")
    return detokenizer.text, entries


async def _scored_pieces(job: Job, events: asyncio.Queue, tokenizer, stops: list[str], scheduler: Scheduler,
                         granularity: int, timing: dict | None, scoring: Scoring) -> AsyncIterator[tuple]:
    """``_pieces`` for a request with logprobs or echo: text pieces are ``("text", str, entries)``, ``entries``
    the scored tokens whose text the piece completes (``_TokenTexts.entry``; ``text_offset`` counts characters
    of the answer, the echoed prompt included). The echoed prompt comes first, as one piece; every delivered
    token has an entry (the one that completed a stop string included; not the end-of-sequence token a row stops
    at, whose text the answer leaves out, as OpenAI's logprobs do, except with echo: a loglikelihood client such as
    lm-eval counts one entry per prompt and generated token and drops the last), and one
    whose text is held (an incomplete character, a possible stop string) goes with the next piece. With
    ``scoring.zero`` the row's one token is not part of the answer."""
    timing = {} if timing is None else timing
    texts = _TokenTexts(tokenizer)
    detokenizer = StreamingDetokenizer(tokenizer)
    matcher = StopMatcher(stops)
    generated = cached = base = 0
    prompt_scores, echoed, waiting = None, not scoring.echo, []
    while True:
        event = await events.get()
        kind = event[0]
        if (kind == "tokens" or kind == "done" and event[1] != "cancelled") and not echoed:
            echoed = True
            text, entries = _echo(job, tokenizer, texts, prompt_scores, scoring)
            base = len(text)
            yield ("text", text, entries)
        if kind == "start":
            timing["cached"] = event[1]
            cached = event[1] - event[1] % granularity
        elif kind == "prompt_logprobs":
            prompt_scores = event[1]
        elif kind == "tokens":
            timing.setdefault("first", time.perf_counter())
            if scoring.zero:
                continue
            scores = event[2] if len(event) > 2 else None
            if scoring.logprobs is not None and (scores is None or len(scores) != len(event[1])):
                raise APIError(500, "the tokens' logprobs did not come back", code="engine_error")
            generated += len(event[1])
            stopped = False
            for i, token in enumerate(event[1]):
                offset = base + len(detokenizer.text)
                text, stopped = matcher.feed(detokenizer.add([token]))
                if scores is not None and (scoring.echo or int(token) not in detokenizer.hidden):  # echo: every token
                    waiting.append(texts.entry(scores[i], offset))
                if text or (stopped and waiting):
                    yield ("text", text, waiting)
                    waiting = []
                if stopped:
                    break
            if stopped:
                scheduler.finish(job)
                timing["stop_sequence"] = matcher.matched
                yield ("end", "stop", generated, cached)
                return
        elif kind == "done":
            _, reason, _ = event
            text, stopped = matcher.feed(detokenizer.flush())
            text += "" if stopped else matcher.flush()
            if text or waiting:
                yield ("text", text, waiting)
            if reason == "cancelled":
                raise APIError(503, "the request was cancelled (the server is shutting down)", code="cancelled")
            yield ("end", "length" if reason == "length" or scoring.zero else "stop", generated, cached)
            return
        elif kind == "error":
            raise event[1]


def _scored(body: dict, chat: bool, scoring: Scoring, entries: list) -> dict:
    """``body`` (a whole answer or a chunk, one choice) with its choice's ``logprobs`` when asked."""
    if scoring.logprobs is not None and body["choices"]:
        body["choices"][0]["logprobs"] = chat_logprobs(entries) if chat else completion_logprobs(entries)
    return body


async def _collect(pieces: AsyncIterator[tuple], calls: list | None = None,
                   entries: list | None = None) -> tuple[str, str, int, int]:
    """The text, finish reason, completion tokens and cached tokens; ``("tool_call", call)`` pieces go to
    ``calls``, the scored tokens of text pieces (``_scored_pieces``) to ``entries``."""
    parts = []
    async for piece in pieces:
        if piece[0] == "text":
            parts.append(piece[1])
            if entries is not None and len(piece) > 2:
                entries.extend(piece[2])
        elif piece[0] == "tool_call":
            if calls is not None:
                calls.append(piece[1])
        else:
            return "".join(parts), piece[1], piece[2], piece[3]
    raise APIError(500, "generation ended without a result")  # pragma: no cover


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _sse(pieces: AsyncIterator[tuple], rid: str, params, created: int, chat: bool, prompt_tokens: int,
               account=None, scoring: Scoring = Scoring()):
    """OpenAI's stream: ``chat.completion.chunk`` / ``text_completion`` events, the usage chunk when asked,
    ``data: [DONE]``; an error met midway is one error event before ``[DONE]``."""
    model = params.model
    try:
        if chat:
            yield _event(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        calls = 0
        async for piece in pieces:
            if piece[0] == "text":
                yield _event(_scored(chat_chunk(rid, model, created, {"content": piece[1]}) if chat
                                     else completion_chunk(rid, model, created, piece[1]), chat, scoring,
                                     piece[2] if len(piece) > 2 else []))
                continue
            if piece[0] == "tool_call":  # one delta per call, whole (index, id, type, name, arguments)
                yield _event(chat_chunk(rid, model, created, {"tool_calls": [piece[1].openai(calls)]}))
                calls += 1
                continue
            _, reason, generated, cached = piece
            if account is not None:
                account(generated, cached)
            yield _event(chat_chunk(rid, model, created, {}, reason) if chat
                         else completion_chunk(rid, model, created, "", reason))
            if params.include_usage:
                use = usage(prompt_tokens, generated, cached)
                yield _event(chat_chunk(rid, model, created, None, use=use) if chat
                             else completion_chunk(rid, model, created, None, use=use))
            break
    except APIError as error:
        yield _event(error.body())
    yield b"data: [DONE]\n\n"


async def _sse_choices(streams: list, rid: str, params, created: int, chat: bool, prompt_tokens: int, account,
                       cancel_all, scoring: Scoring = Scoring()):
    """``_sse`` for several choices: each choice's pieces pumped into one queue by a task of its own, every chunk
    tagged with the choice's index; ``account`` gets each choice's (generated, cached) once all have ended. An
    error met in any choice is one error event (the other rows end) before ``[DONE]``."""
    model = params.model
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, pieces) -> None:
        try:
            async for piece in pieces:
                await queue.put((index, piece))
                if piece[0] == "end":
                    return
        except APIError as error:
            await queue.put((index, ("error", error)))
        except Exception as exc:  # a bug in one choice's pieces: the stream says so instead of hanging
            log.exception("spec-cache serve: a streamed choice failed")
            await queue.put((index, ("error", APIError(500, f"internal error: {type(exc).__name__}",
                                                       code="internal_error"))))

    tasks = [asyncio.create_task(pump(i, pieces)) for i, pieces in enumerate(streams)]
    ended: dict[int, tuple[int, int]] = {}
    calls = [0] * len(streams)
    try:
        if chat:
            for i in range(len(streams)):
                yield _event(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, index=i))
        while len(ended) < len(streams):
            i, piece = await queue.get()
            if piece[0] == "text":
                yield _event(_scored(chat_chunk(rid, model, created, {"content": piece[1]}, index=i) if chat
                                     else completion_chunk(rid, model, created, piece[1], index=i), chat, scoring,
                                     piece[2] if len(piece) > 2 else []))
            elif piece[0] == "tool_call":
                yield _event(chat_chunk(rid, model, created, {"tool_calls": [piece[1].openai(calls[i])]}, index=i))
                calls[i] += 1
            elif piece[0] == "error":
                cancel_all()
                yield _event(piece[1].body())
                break
            else:
                _, reason, generated, cached = piece
                ended[i] = (generated, cached)
                yield _event(chat_chunk(rid, model, created, {}, reason, index=i) if chat
                             else completion_chunk(rid, model, created, "", reason, index=i))
        else:
            generated, cached = account([ended[i] for i in range(len(streams))])
            if params.include_usage:
                use = usage(prompt_tokens, generated, cached)
                yield _event(chat_chunk(rid, model, created, None, use=use) if chat
                             else completion_chunk(rid, model, created, None, use=use))
    finally:
        for task in tasks:
            task.cancel()
    yield b"data: [DONE]\n\n"
