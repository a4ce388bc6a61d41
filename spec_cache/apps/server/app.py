"""The ASGI app (Starlette): OpenAI-compatible routes over the scheduler.

Why one file of ~450 lines: every route shares the request parsing, the error shapes and the streaming
response; protocol types live in ``protocol.py``, auth in ``auth.py``, metrics in ``metrics.py``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true``: server-sent events ending in
``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``; Anthropic's ``POST /v1/messages``
(``anthropic.py``, over ``run_job`` with its own response ``shape``). Handlers never touch the engine: they
tokenize (chat template), submit a ``scheduler.Job`` and read its events from an asyncio queue; the scheduler
thread hops events onto the loop with ``call_soon_threadsafe``. A request body larger than ``max_body_bytes``
(derived from the context length) is answered 413 from its Content-Length, or as soon as that many bytes arrived,
before anything is tokenized; tokenizing (and decoding a large body) runs in a worker thread, never on the event
loop, so one big prompt does not stall every other client's stream. A client that disconnects (streaming or not)
ends its row at once (cancelled; or finished with its checkpoint when a retry could resume it). Errors are
OpenAI's error JSON with the right status (see ``protocol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from spec_cache.apps.server.anthropic import messages_routes
from spec_cache.apps.server.auth import Auth, salted_tenant, tenant_label
from spec_cache.apps.server.cache_routes import cache_routes
from spec_cache.apps.server.detokenizer import StopMatcher, StreamingDetokenizer
from spec_cache.apps.server.metrics import CONTENT_TYPE_LATEST, Metrics
from spec_cache.apps.server.protocol import (
    APIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
    parse_chat,
    parse_completion,
    usage,
)
from spec_cache.apps.server.scheduler import Job, Scheduler, random_seed
from spec_cache.apps.server.seam import message_boundaries
from spec_cache.apps.server.tools import (
    TemplateError,
    active_tools,
    chat_ids,
    render_chat,
    tool_pieces,
    tool_style,
    uses_tools,
)
from spec_cache.sampling import RowSampling

log = logging.getLogger("spec_cache.apps.server")

__all__ = ["ServerConfig", "ServerState", "create_app", "LoadingApp"]


@dataclass
class ServerConfig:
    """Limits and defaults. ``context_tokens``: prompt + completion must fit (the model's
    ``max_position_embeddings``); ``max_prompt_tokens``: a prompt longer than this is refused (400) even when it
    fits; ``max_body_bytes``: larger request bodies get 413 (None: ``default_max_body_bytes(context_tokens)``);
    ``cached_tokens_granularity``: ``cached_tokens`` is reported rounded down to a multiple of it."""

    model_id: str
    context_tokens: int = 4096
    max_prompt_tokens: int | None = None
    default_max_tokens: int = 512
    default_temperature: float = 0.0
    max_body_bytes: int | None = None
    drain_timeout_s: float = 30.0
    cached_tokens_granularity: int = 1
    max_pin_ttl_s: float = 3600.0  # /v1/cache/pin's longest ttl_s (--max-pin-ttl)

    def __post_init__(self) -> None:
        if self.max_body_bytes is None:
            self.max_body_bytes = default_max_body_bytes(self.context_tokens)


def default_max_body_bytes(context_tokens: int) -> int:
    """16 bytes per token of context plus 64 KiB of JSON framing: a body larger than this cannot hold a prompt
    that fits the context (a token is a few bytes of text; JSON escapes at most ~6 bytes a character)."""
    return context_tokens * 16 + (64 << 10)


_JSON_IN_THREAD = 256 << 10  # decode bodies larger than this in a worker thread


@dataclass
class ServerState:
    """What the app serves: the loaded generator, its tokenizer, the scheduler that owns them, metrics, auth."""

    generator: Any
    tokenizer: Any
    scheduler: Scheduler
    config: ServerConfig
    auth: Auth = field(default_factory=Auth)
    metrics: Metrics = field(default_factory=Metrics)
    cache: Any = None  # closed on shutdown
    store_path: str | None = None  # where the store lives (the ready line names it)

    @property
    def models(self) -> tuple[str, ...]:
        return (self.config.model_id,)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


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


def create_app(state: ServerState) -> Starlette:
    """The Starlette app for ``state``; its lifespan starts the scheduler and, on shutdown, drains it and closes
    the cache."""
    config, metrics, scheduler = state.config, state.metrics, state.scheduler
    tokenizer = state.tokenizer
    vocab = state.generator.engine.target.vocab_size

    cache = state.generator.cache
    metrics.gauge("spec_cache_queue_depth", "requests waiting for a row", lambda: scheduler.queue_depth)
    metrics.gauge("spec_cache_active_rows", "rows decoding", lambda: scheduler.active_rows)
    metrics.gauge("spec_cache_replayed_tokens", "generated tokens answered from stored continuations (retries)",
                  lambda: scheduler.replayed_tokens)
    if cache is not None:
        metrics.gauge("spec_cache_memory_tier_bytes", "bytes held by the memory tier",
                      lambda: cache.memory_stats().get("bytes", 0))
        metrics.gauge("spec_cache_memory_tier_entries", "checkpoints held by the memory tier",
                      lambda: cache.memory_stats().get("entries", 0))
        metrics.gauge("spec_cache_checkpoints_not_durable", "checkpoints not yet written to LMDB",
                      lambda: cache.memory_stats().get("not_durable", 0))
        metrics.gauge("spec_cache_write_queue_bytes", "checkpoint bytes waiting for their LMDB write",
                      lambda: cache.memory_stats().get("writes", {}).get("pending_bytes", 0))
        metrics.gauge("spec_cache_store_bytes", "bytes in use in the LMDB store file", lambda: _store_bytes(cache))

    def count(endpoint: str, status: int, tenant: str | None = None, known: bool = True) -> None:
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if known:  # a request whose key was refused has no tenant to count it under
            metrics.tenant_requests.labels(tenant=tenant_label(tenant), status=str(status)).inc()

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise APIError(413, f"the request body is larger than {config.max_body_bytes} bytes",
                           code="request_too_large")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > config.max_body_bytes:
                    raise APIError(413, f"the request body is larger than {config.max_body_bytes} bytes",
                                   code="request_too_large")
        except ClientDisconnect:
            raise APIError(499, "the client went away while sending its request") from None
        try:
            if len(body) > _JSON_IN_THREAD:
                return await anyio.to_thread.run_sync(json.loads, bytes(body), limiter=tokenize_limiter)
            return json.loads(body)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def tenant_of(request: Request) -> str | None:
        return state.auth.check(request.headers.get("authorization"))

    tokenize_limiter = anyio.CapacityLimiter(1)  # one tokenizer call at a time (HF fast tokenizers are not re-entrant
    # for every setting), in a worker thread: the event loop never waits on one

    async def tokenize(fn, *args) -> list[int]:
        return await anyio.to_thread.run_sync(fn, *args, limiter=tokenize_limiter)

    def encode_text(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text)]

    def encode_chat(messages: list[dict], params=None) -> list[int]:
        tools, choice = (None, None) if params is None else (params.tools, params.tool_choice)
        try:
            return chat_ids(tokenizer, messages, tools, choice)
        except TemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="chat_template_error") from None

    def chat_boundaries(messages: list[dict], prompt: list[int], params=None) -> list[int]:
        """Where the last messages end in ``prompt`` (and its end): checkpointed while prefilling (``seam``); each
        head is rendered the way ``encode_chat`` rendered the whole conversation (tool turns included: a head of a
        conversation that uses tools renders through ``render_chat`` as the whole did)."""
        tools, choice = (None, None) if params is None else (params.tools, params.tool_choice)
        tooled = uses_tools(tools, choice, messages)

        def render(head: list[dict], generation_prompt: bool):
            if tooled:
                return render_chat(tokenizer, head, tools, choice, add_generation_prompt=generation_prompt)
            return chat_ids(tokenizer, head, generation_prompt=generation_prompt)
        return message_boundaries(render, messages, prompt)

    def make_job(params, prompt: list[int], tenant: str | None, deliver, checkpoint_at=()) -> Job:
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
            max_tokens = min(config.default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                           f"context of {config.context_tokens} tokens", param="max_tokens",
                           code="context_length_exceeded")
        temperature = config.default_temperature if params.temperature is None else params.temperature
        seed = params.seed if params.seed is not None else (0 if temperature == 0 else random_seed())
        sampling = RowSampling(temperature=temperature, top_p=params.top_p, seed=int(seed))
        return Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, deliver=deliver,
                   tenant=salted_tenant(tenant, params.cache_salt), stop_at_eos=not params.ignore_eos,
                   replayable=temperature == 0 or params.seed is not None, checkpoint_at=tuple(checkpoint_at))

    granularity = max(1, int(config.cached_tokens_granularity))

    async def run_job(request: Request, endpoint: str, params, prompt: list[int], tenant: str | None, chat: bool,
                      started: float, checkpoint_at=(), shape=None):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody is listening
                loop.call_soon_threadsafe(events.put_nowait, event)

        job = make_job(params, prompt, tenant, deliver, checkpoint_at)
        scheduler.submit(job)
        rid = shape.new_id() if shape is not None else new_id("chatcmpl" if chat else "cmpl")  # shape: anthropic.py
        created = int(time.time())
        timing: dict = {}
        pieces = _pieces(job, events, tokenizer, params.stop, scheduler, granularity, timing)
        if chat and active_tools(params.tools, params.tool_choice):  # tool calls parsed out of the text
            pieces = tool_pieces(pieces, tool_style(tokenizer))
        label = tenant_label(tenant)
        line = f"{request.method} {request.url.path}"

        def account(generated: int, cached: int) -> None:
            metrics.account(label, len(prompt), cached, generated)
            log_request(line, 200, label, started, rid=rid, prompt=len(prompt), cached=timing.get("cached", cached),
                        generated=generated,
                        first=timing.get("first"))

        if params.stream:
            count(endpoint, 200, tenant)

            def gone() -> None:
                scheduler.cancel(job)
                log_request(line, 499, label, started, rid=rid, prompt=len(prompt), first=timing.get("first"))
            out = (shape.stream(pieces, rid, timing, account) if shape is not None
                   else _sse(pieces, rid, params, created, chat, len(prompt), account))
            return _EventStream(out, on_disconnect=gone)
        calls: list = []
        collect = asyncio.ensure_future(_collect(pieces, calls))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if collect not in done:
            collect.cancel()
            scheduler.cancel(job)
            count(endpoint, 499, tenant)
            log_request(line, 499, label, started, rid=rid, prompt=len(prompt), first=timing.get("first"))
            return Response(status_code=499)
        text, reason, generated, cached = collect.result()
        account(generated, cached)
        if shape is not None:
            count(endpoint, 200, tenant)
            return JSONResponse(shape.body(rid, text, reason, generated, cached, timing))
        use = usage(len(prompt), generated, cached)
        model = params.model
        body = (chat_response(rid, model, text, reason, use, calls) if chat
                else completion_response(rid, model, text, reason, use))
        count(endpoint, 200, tenant)
        return JSONResponse(body)

    def endpoint(name: str, chat: bool):
        async def handle(request: Request) -> Response:
            tenant, known, checkpoint_at = None, False, ()
            started = time.perf_counter()
            try:
                tenant = tenant_of(request)
                known = True
                body = await read_json(request)
                if chat:
                    params, messages = parse_chat(body, state.models)
                    prompt = await tokenize(encode_chat, messages, params)
                    if cache is not None:
                        checkpoint_at = await tokenize(chat_boundaries, messages, prompt, params)
                else:
                    params, text = parse_completion(body, state.models, vocab)
                    prompt = text if isinstance(text, list) else await tokenize(encode_text, text)
                return await run_job(request, name, params, prompt, tenant, chat, started, checkpoint_at)
            except APIError as error:
                count(name, error.status, tenant, known)
                log_request(f"{request.method} {request.url.path}", error.status,
                            tenant_label(tenant) if known else "-", started, error=error.code or error.type)
                return _error_response(error)
        return handle

    async def models_route(request: Request) -> Response:
        try:
            tenant = tenant_of(request)
        except APIError as error:
            count("models", error.status, known=False)
            return _error_response(error)
        count("models", 200, tenant)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_id, "object": "model", "created": 0, "owned_by": "spec-cache"}]})

    async def health(request: Request) -> Response:
        ok = scheduler.error is None
        body = {"status": "ok" if ok else "failed"}
        if not state.auth.viewer(request.headers.get("authorization")).known:  # liveness only, without a key
            return JSONResponse(body, status_code=200 if ok else 503)
        body.update({"model": config.model_id, "active_rows": scheduler.active_rows,
                     "queue_depth": scheduler.queue_depth})
        if cache is not None:
            stats = cache.memory_stats()
            body["checkpoints_not_durable"] = stats.get("not_durable", 0)
            body["write_queue_pending"] = stats.get("writes", {}).get("pending", 0)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics_route(request: Request) -> Response:
        viewer = state.auth.viewer(request.headers.get("authorization"))
        if not viewer.known:
            return _error_response(APIError(401, "/metrics needs 'Authorization: Bearer <key>': an operator key "
                                            "(--operator-key) for every series, an API key for its own tenant's",
                                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        body = await anyio.to_thread.run_sync(metrics.render, viewer)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        message = "not found" if status == 404 else getattr(exc, "detail", "error")
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {message}"), status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(lambda: scheduler.stop(config.drain_timeout_s))
            if state.cache is not None:
                await anyio.to_thread.run_sync(state.cache.close)

    routes = [
        Route("/v1/chat/completions", endpoint("chat", chat=True), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", chat=False), methods=["POST"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        *cache_routes(state, tokenize),  # /v1/cache/... (cache_routes.py)
        *messages_routes(SimpleNamespace(  # /v1/messages (anthropic.py), over this app's machinery
            state=state, read_json=read_json, tokenize=tokenize, run_job=run_job, count=count,
            log_request=log_request, tenant_label=tenant_label, granularity=granularity, clock=time.perf_counter)),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})


def _store_bytes(cache) -> int:
    """Pages in use in the LMDB file, times the page size (cheap: LMDB's own counters); 0 when closed."""
    store_env = getattr(cache.store, "env", None)
    env = getattr(store_env, "env", None)
    if env is None:
        return 0
    try:
        check = getattr(store_env, "check_data", None)
        if check is not None:
            check()  # LMDB's counters live in the map: a data file shrunk under us must not SIGBUS a scrape
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except Exception:  # closed meanwhile
        return 0


class LoadingApp:
    """The ASGI app ``spec-cache serve`` runs: it listens at once and answers 503 (``/health``: ``{"status":
    "loading"}``) while ``load()`` (a ``ServerState`` factory) runs in a thread, then serves ``create_app(state)``.
    Its lifespan shutdown waits for the load, drains the scheduler and closes the cache. ``on_failure(exc)`` is
    called (from the loading thread) if the load fails; the app then answers 503 with the reason."""

    def __init__(self, load, on_failure=None) -> None:
        self._load = load
        self._on_failure = on_failure
        self._thread: threading.Thread | None = None
        self.state: ServerState | None = None
        self.app: Starlette | None = None
        self.error: BaseException | None = None
        self.url: str | None = None  # where the server listens (the ready line names it)

    def _run_load(self) -> None:
        try:
            state = self._load()
            app = create_app(state)
            state.scheduler.start()
            self.state, self.app = state, app
            log.info("spec-cache serve: ready: model %s on %s/v1; store %s", state.config.model_id,
                     self.url or "(unknown address)", state.store_path or "none (--no-cache)")
        except BaseException as exc:
            self.error = exc
            expected = isinstance(exc, (ValueError, OSError, NotImplementedError)) or type(exc).__name__ == "CliError"
            log.error("spec-cache serve: loading failed: %s", exc, exc_info=not expected)
            if self._on_failure is not None:
                self._on_failure(exc)

    def _shutdown(self) -> None:
        if self._thread is not None:
            self._thread.join()
        state = self.state
        if state is not None:
            state.scheduler.stop(state.config.drain_timeout_s)
            if state.cache is not None:
                state.cache.close()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._thread = threading.Thread(target=self._run_load, name="spec-cache-load", daemon=True)
                    self._thread.start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await anyio.to_thread.run_sync(self._shutdown)
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if self.error is None:
            body = error_body("the model is loading; retry shortly", "server_error", code="model_loading")
        else:
            body = error_body(f"the model failed to load: {self.error}", "server_error", code="model_load_failed")
        if scope.get("path") == "/health":
            body = {"status": "loading" if self.error is None else "failed", **body}
        await JSONResponse(body, status_code=503, headers={"Retry-After": "2"})(scope, receive, send)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


async def _pieces(job: Job, events: asyncio.Queue, tokenizer, stops: list[str], scheduler: Scheduler,
                  granularity: int = 1, timing: dict | None = None) -> AsyncIterator[tuple]:
    """Text pieces of a job as ``("text", str)``, then ``("end", finish_reason, completion_tokens, cached)``;
    ``cached`` rounded down to a multiple of ``granularity`` (what clients may learn about stored prefixes).
    ``timing["first"]``: when the first tokens arrived; ``timing["cached"]``: the exact cached count."""
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
            text, stopped = matcher.feed(detokenizer.add(event[1]))
            if text:
                yield ("text", text)
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


async def _collect(pieces: AsyncIterator[tuple], calls: list | None = None) -> tuple[str, str, int, int]:
    """The text, finish reason, completion tokens and cached tokens; ``("tool_call", call)`` pieces go to
    ``calls``."""
    parts = []
    async for piece in pieces:
        if piece[0] == "text":
            parts.append(piece[1])
        elif piece[0] == "tool_call":
            if calls is not None:
                calls.append(piece[1])
        else:
            return "".join(parts), piece[1], piece[2], piece[3]
    raise APIError(500, "generation ended without a result")  # pragma: no cover


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _sse(pieces: AsyncIterator[tuple], rid: str, params, created: int, chat: bool, prompt_tokens: int,
               account=None):
    model = params.model
    try:
        if chat:
            yield _event(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        calls = 0
        async for piece in pieces:
            if piece[0] == "text":
                yield _event(chat_chunk(rid, model, created, {"content": piece[1]}) if chat
                             else completion_chunk(rid, model, created, piece[1]))
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
