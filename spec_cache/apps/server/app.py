"""The ASGI app (Starlette): what ``spec-cache serve`` serves, assembled from its route groups.

Routes: OpenAI's ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true``: server-sent events ending
in ``data: [DONE]``) and ``GET /v1/models`` (``openai_routes.py``); Anthropic's ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (``anthropic.py``); ``/v1/cache/...`` (``cache_routes.py``); ``GET /health`` and
``GET /metrics`` (here). Handlers never touch the engine: they tokenize (chat template), submit a ``scheduler.Job``
and read its events from an asyncio queue (``jobs.py``); the scheduler thread hops events onto the loop with
``call_soon_threadsafe``. A request body larger than ``max_body_bytes`` (derived from the context length) is answered
413 from its Content-Length, or as soon as that many bytes arrived, before anything is tokenized; tokenizing (and
decoding a large body) runs in a worker thread, never on the event loop, so one big prompt does not stall every other
client's stream. A client that disconnects (streaming or not) ends its row at once (cancelled; or finished with its
checkpoint when a retry could resume it). Errors are OpenAI's error JSON with the right status (see ``protocol``);
``/v1/messages`` answers Anthropic's. Whatever a handler raises past its own error handling is answered in that
JSON too (``JSONErrors``, the catch-all): 400 for what only a client's body causes (text that is not Unicode,
nesting deeper than Python recurses), the library's own statuses (``errors.api_error``), else 500; never
Starlette's plain-text "Internal Server Error".
``LoadingApp`` answers 503 while the model loads, then serves ``create_app(state)``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spec_cache.apps.server.anthropic import error_response as anthropic_error_response
from spec_cache.apps.server.anthropic import messages_routes
from spec_cache.apps.server.auth import Auth
from spec_cache.apps.server.cache_routes import cache_routes
from spec_cache.apps.server.errors import api_error
from spec_cache.apps.server.jobs import Requests, error_response
from spec_cache.apps.server.metrics import CONTENT_TYPE_LATEST, Metrics
from spec_cache.apps.server.openai_routes import openai_routes
from spec_cache.apps.server.protocol import APIError, error_body
from spec_cache.apps.server.scheduler import Scheduler

log = logging.getLogger("spec_cache.apps.server")

__all__ = ["ServerConfig", "ServerState", "create_app", "LoadingApp", "JSONErrors"]


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


def create_app(state: ServerState) -> Starlette:
    """The Starlette app for ``state``; its lifespan starts the scheduler and, on shutdown, drains it and closes
    the cache."""
    _register_gauges(state.metrics, state.scheduler, state.generator.cache)
    requests = Requests(state)  # the machinery every generating route shares (jobs.py)
    routes = [
        *openai_routes(requests),  # /v1/chat/completions, /v1/completions, /v1/models (openai_routes.py)
        Route("/health", _health(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        *cache_routes(state, requests.tokenize_as),  # /v1/cache/... (cache_routes.py)
        *messages_routes(requests),  # /v1/messages (anthropic.py), over the same machinery
    ]
    return Starlette(routes=routes, lifespan=_lifespan(state), middleware=[Middleware(JSONErrors)],
                     exception_handlers={404: _not_found, 405: _not_found})


class JSONErrors:
    """ASGI middleware, the catch-all (module doc): an exception a route lets out before its response started is
    answered as the API's error JSON (Anthropic's under ``/v1/messages``, OpenAI's elsewhere) and logged once;
    after the response started (a stream), nothing can be answered any more, and it propagates as before."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            error = caught_error(exc)
            where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
            if error.status >= 500:
                log.error("spec-cache serve: %s: unhandled %s answered %d: %s", where, type(exc).__name__,
                          error.status, error.message, exc_info=exc)
            else:
                log.warning("spec-cache serve: %s: %s answered %d: %s", where, type(exc).__name__, error.status,
                            error.message)
            anthropic = str(scope.get("path", "")).startswith("/v1/messages")
            response = anthropic_error_response(error) if anthropic else error_response(error)
            await response(scope, receive, send)


def caught_error(exc: BaseException) -> APIError:
    """The ``APIError`` the catch-all answers for ``exc``: a client's body that is not Unicode text (a lone
    surrogate some check missed) or nests deeper than Python recurses is 400; the library's errors keep their
    statuses (``api_error``); anything else is a 500 with one line naming the exception."""
    if isinstance(exc, UnicodeError):
        return APIError(400, "the request holds text that is not valid Unicode (a lone surrogate?)",
                        code="invalid_text")
    if isinstance(exc, RecursionError):
        return APIError(400, "the request nests too deeply", code="too_deep")
    error = api_error(exc, context="the request failed")
    if error.status >= 500 and error.code is None:
        line = " ".join(str(exc).split())[:300] or type(exc).__name__
        error = APIError(500, f"the request failed: {type(exc).__name__}: {line}", code="internal_error")
    return error


def _register_gauges(metrics: Metrics, scheduler: Scheduler, cache) -> None:
    """The scheduler's gauges and, with a cache, the memory tier's, the write queue's and the store file's."""
    metrics.gauge("spec_cache_queue_depth", "requests waiting for a row", lambda: scheduler.queue_depth)
    metrics.gauge("spec_cache_active_rows", "rows decoding", lambda: scheduler.active_rows)
    metrics.gauge("spec_cache_replayed_tokens", "generated tokens answered from stored continuations (retries)",
                  lambda: scheduler.replayed_tokens)
    metrics.gauge("spec_cache_requests_arriving", "generation requests being read and tokenized (not yet queued)",
                  lambda: scheduler.arriving)
    metrics.gauge("spec_cache_arrival_waits", "requests that waited for requests arriving with them, to prefill "
                  "in one step", lambda: scheduler.arrival_waits)
    metrics.gauge("spec_cache_first_token_waits", "requests whose LMDB restore waited one step for rows due a first "
                  "token", lambda: scheduler.first_token_waits)
    if cache is None:
        return
    metrics.gauge("spec_cache_memory_tier_bytes", "bytes held by the memory tier",
                  lambda: cache.memory_stats().get("bytes", 0))
    metrics.gauge("spec_cache_memory_tier_entries", "checkpoints held by the memory tier",
                  lambda: cache.memory_stats().get("entries", 0))
    metrics.gauge("spec_cache_checkpoints_not_durable", "checkpoints not yet written to LMDB",
                  lambda: cache.memory_stats().get("not_durable", 0))
    metrics.gauge("spec_cache_write_queue_bytes", "checkpoint bytes waiting for their LMDB write",
                  lambda: cache.memory_stats().get("writes", {}).get("pending_bytes", 0))
    metrics.gauge("spec_cache_store_bytes", "bytes in use in the LMDB store file", lambda: _store_bytes(cache))


def _health(state: ServerState):
    """``GET /health``: ``{"status": "ok" | "failed"}`` (503 once the scheduler failed); with an API key, the model
    too; with an operator key (or on an open server), the rows, queue and the write-behind backlog as well. Those
    are server-wide: shown to an API key they would tell a tenant when another one decodes, and whether its prompt
    was new to the cache (issue 37)."""
    config, scheduler, cache = state.config, state.scheduler, state.generator.cache

    async def health(request: Request) -> Response:
        ok = scheduler.error is None
        body = {"status": "ok" if ok else "failed"}
        viewer = state.auth.viewer(request.headers.get("authorization"))
        if not viewer.known:  # liveness only, without a key
            return JSONResponse(body, status_code=200 if ok else 503)
        body["model"] = config.model_id
        if not viewer.operator:  # an API key: nothing server-wide
            return JSONResponse(body, status_code=200 if ok else 503)
        body.update({"active_rows": scheduler.active_rows, "queue_depth": scheduler.queue_depth})
        if cache is not None:
            stats = cache.memory_stats()
            body["checkpoints_not_durable"] = stats.get("not_durable", 0)
            body["write_queue_pending"] = stats.get("writes", {}).get("pending", 0)
        return JSONResponse(body, status_code=200 if ok else 503)
    return health


def _metrics(state: ServerState):
    """``GET /metrics``: Prometheus text, every series for an operator key, its own tenant's for an API key."""
    async def metrics_route(request: Request) -> Response:
        viewer = state.auth.viewer(request.headers.get("authorization"))
        if not viewer.known:
            return error_response(APIError(401, "/metrics needs 'Authorization: Bearer <key>': an operator key "
                                           "(--operator-key) for every series, an API key for its own tenant's",
                                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        body = await anyio.to_thread.run_sync(state.metrics.render, viewer)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
    return metrics_route


async def _not_found(request: Request, exc) -> Response:
    status = getattr(exc, "status_code", 404)
    message = "not found" if status == 404 else getattr(exc, "detail", "error")
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {message}"), status_code=status)


def _lifespan(state: ServerState):
    """Starts the scheduler; on shutdown drains it (``drain_timeout_s``) and closes the cache, off the loop."""
    scheduler = state.scheduler

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(lambda: scheduler.stop(state.config.drain_timeout_s))
            if state.cache is not None:
                await anyio.to_thread.run_sync(state.cache.close)
    return lifespan


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
