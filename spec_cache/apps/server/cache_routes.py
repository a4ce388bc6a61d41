"""``/v1/cache/...``: cache controls over HTTP, per tenant and behind the API key (``spec_cache.tiers.cache_controls``).

Why one file: the six routes share one parsing of a prompt into its tenant's namespace key, one rounding of what a
route may report (``--cached-tokens-granularity``) and one per-tenant turn; split, each would re-derive them.

Routes (all answer OpenAI's error JSON on failure, never a traceback):

* ``POST /v1/cache/pin`` — pin the longest stored prefix of a prompt for ``ttl_s`` seconds (at most the server's
  ``--max-pin-ttl``): neither the memory tier nor LMDB's budget evicts it until then or ``unpin``.
* ``POST /v1/cache/unpin`` — by ``id`` or by the same prefix.
* ``GET /v1/cache/pins`` — the caller's pins in its namespace (``cache_salt`` in the query string selects a salted
  one; the operator key: everyone's).
* ``POST /v1/cache/prefetch`` — restore the longest stored prefix into the memory tier now (from LMDB or the
  shared tier), so the next request restores from memory.
* ``POST /v1/cache/export`` — the stored prefix as an mlx-lm prompt-cache file (``save_prompt_cache`` format).
* ``POST /v1/cache/import`` — such a file (+ its tokens) stored once every layer fits the model (``prefix_files``).
  An API key imports only with a ``cache_salt`` (a namespace only requests with that salt reach); into a namespace
  others share, only the operator key (403 ``operator_key_required``): imported KV would answer for them.

A prefix is named by ``messages`` (rendered through the chat template as ``/v1/chat/completions`` renders them: with the
generation prompt, unless ``"add_generation_prompt": false``; ``tools`` passed to the template when given), by
``prompt`` (text, encoded as ``/v1/completions`` encodes it) or by ``tokens`` (ids). Tenants: an API key acts on its own
namespace only (``cache_salt`` splits it as in chat requests); an operator key (``--operator-key-file``) acts on the
namespace of ``"tenant": "<label>"`` (the 8 hex digits ``/metrics`` and ``/v1/cache/pins`` show; ``"open"`` or none: the
keyless namespace) and sees and ends every pin. Everything that touches the cache runs on the scheduler thread
(``Scheduler.call``), which owns it.

What a reply tells of stored prefixes follows ``--cached-tokens-granularity`` as ``cached_tokens`` does (else these
routes would be the token-by-token probe it closes): token counts rounded down to it, a tenant's pin covering (and its
``id`` and ``bytes`` naming) only that many tokens, an export cut to that many tokens, and a prefix shorter than one
multiple answered as nothing stored (prefetch: ``tokens`` 0, ``tier`` null; pin and export: 404). An operator key sees
exact counts.

Pins count against the caller's share even without tenant quotas (``quotas``): all pins together hold at most half
the memory tier and half of ``--max-bytes``, one tenant at most that divided by the API keys (at least 2); so one
tenant's pins never make a budget evict another tenant within its fair share, nor leave another tenant no room to
pin. A refusal (409) names the caller's own share and pins only.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spec_cache.apps.server.auth import salted_tenant, tenant_label
from spec_cache.apps.server.errors import api_error
from spec_cache.apps.server.jobs import log_request, read_body
from spec_cache.apps.server.limits import TenantTurns
from spec_cache.apps.server.protocol import APIError, check_text, parse_chat
from spec_cache.apps.server.tools import TemplateError, chat_ids
from spec_cache.convert import interop
from spec_cache.errors import SpecCacheError
from spec_cache.store import StoreError
from spec_cache.tiers import cache_controls as controls

__all__ = ["cache_routes", "DEFAULT_MAX_PIN_TTL_S"]

log = logging.getLogger("spec_cache.apps.server")

#: ``--max-pin-ttl``'s default: the longest pin a client may ask for
DEFAULT_MAX_PIN_TTL_S = 3600.0
#: a pin without ``ttl_s`` lasts this long (or the maximum, if shorter)
DEFAULT_PIN_TTL_S = 300.0
#: how long a route waits for its turn on the scheduler thread
CALL_TIMEOUT_S = 120.0


def cache_routes(state, tokenize) -> list[Route]:
    """The ``/v1/cache`` routes for ``state`` (an ``app.ServerState``); ``tokenize(tenant, fn, *args)`` runs ``fn``
    where the app runs its tokenizer calls (one at a time, off the event loop), in ``tenant``'s one turn across
    every route (``jobs.Requests.tokenize_as``): else a key flooding these routes beside the generating ones had one
    more request queued ahead of another key's (issue 37, fifth attacker pass)."""
    routes = _CacheRoutes(state, tokenize)
    return [
        routes.route("/v1/cache/pin", "cache_pin", routes.pin),
        routes.route("/v1/cache/unpin", "cache_unpin", routes.unpin),
        routes.route("/v1/cache/prefetch", "cache_prefetch", routes.prefetch),
        routes.route("/v1/cache/export", "cache_export", routes.export),
        routes.route("/v1/cache/import", "cache_import", routes.import_, raw=True),
        routes.route("/v1/cache/pins", "cache_pins", routes.pins_route, method="GET"),
    ]


class _CacheRoutes:
    """The handlers and what they share, in sections: who asks (for which namespace), the prefix a body names, the
    body itself, the scheduler thread (which owns the cache), then the handlers and the ``route`` around each."""

    def __init__(self, state, tokenize) -> None:
        self.state, self.tokenize = state, tokenize
        self.turns = TenantTurns()  # a tenant's cache calls one at a time: its loop never queues ahead of others
        self.generator, self.scheduler, self.tokenizer = state.generator, state.scheduler, state.tokenizer
        self.config = state.config
        self.cache = cache = self.generator.cache
        self.max_ttl = float(getattr(self.config, "max_pin_ttl_s", None) or DEFAULT_MAX_PIN_TTL_S)
        self.granularity = max(1, int(getattr(self.config, "cached_tokens_granularity", 1) or 1))
        self.vocab = self.generator.engine.target.vocab_size
        self.tenants = {tenant_label(t): t for t in (state.auth.check("Bearer " + k.decode("utf-8"))
                                                     for k in state.auth.keys)}
        if cache is not None:
            state.metrics.gauge("spec_cache_memory_tier_hits", "memory-tier lookups that found a prefix",
                                lambda: cache.memory_stats().get("hits", 0))
            state.metrics.gauge("spec_cache_memory_tier_misses", "memory-tier lookups that found nothing",
                                lambda: cache.memory_stats().get("misses", 0))
            state.metrics.gauge("spec_cache_memory_tier_pinned", "memory-tier entries pinned",
                                lambda: cache.memory_stats().get("pinned", 0))

    # --- who asks, for which namespace -------------------------------------------------------------------
    def caller(self, request: Request, body: dict) -> tuple[Any, bool]:
        """``(tenant, operator)``: the API key's tenant, or the one an operator names; 401 otherwise."""
        auth = self.state.auth
        header = request.headers.get("authorization")
        named = body.get("tenant")
        if auth.viewer(header).operator:
            if named is None or named == "open":
                return None, True
            if not isinstance(named, str) or named not in self.tenants:
                raise APIError(400, f"unknown tenant {named!r}: give a tenant label as /v1/cache/pins or /metrics "
                               "show it (8 hex digits), or 'open'", param="tenant")
            return self.tenants[named], True
        tenant = auth.check(header)
        if named is not None and named != tenant_label(tenant):
            raise APIError(400, "only an operator key (--operator-key) may name another tenant", param="tenant")
        return tenant, False

    @staticmethod
    def salted(tenant, body: dict):
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise APIError(400, "'cache_salt' must be a string", param="cache_salt")
        return salted_tenant(tenant, salt)

    def ns_key(self, tenant):
        return self.generator.namespace_key(tenant)

    # --- the prefix --------------------------------------------------------------------------------------
    def render(self, messages: list[dict], generation_prompt: bool, tools) -> list[int]:
        """As chat completions render the conversation (tools through ``tools.render_chat``), so a pinned or
        prefetched prefix is the one a chat request with the same messages and tools restores."""
        try:
            return chat_ids(self.tokenizer, messages, tools or None, generation_prompt=generation_prompt)
        except TemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="chat_template_error") from None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    async def prefix_of(self, body: dict, tenant, required: bool = True) -> list[int] | None:
        """The token ids ``body`` names by ``messages``, ``prompt`` or ``tokens`` (exactly one), tokenized in
        ``tenant``'s turn."""
        config = self.config
        given = [k for k in ("messages", "prompt", "tokens") if body.get(k) is not None]
        if len(given) != 1:
            if not given and not required:
                return None
            raise APIError(400, "name the prefix by exactly one of 'messages', 'prompt' or 'tokens'",
                           param=given[1] if len(given) > 1 else "messages")
        if given[0] == "messages":
            ids = await self._rendered(body, tenant)
        elif given[0] == "prompt":
            if not isinstance(body["prompt"], str):
                raise APIError(400, "'prompt' must be a string (token ids go in 'tokens')", param="prompt")
            ids = await self.tokenize(tenant, self.encode, body["prompt"])
        else:
            ids = self._token_ids(body["tokens"])
        if not ids:
            raise APIError(400, "the prefix is empty", param=given[0])
        if len(ids) > config.context_tokens:
            raise APIError(400, f"the prefix has {len(ids)} tokens; the model's context is {config.context_tokens}",
                           param=given[0], code="context_length_exceeded")
        return [int(t) for t in ids]

    async def _rendered(self, body: dict, tenant) -> list[int]:
        generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(generation_prompt, bool):
            raise APIError(400, "'add_generation_prompt' must be true or false", param="add_generation_prompt")
        model_id = self.config.model_id
        chat = {"model": model_id, "messages": body["messages"]}
        if body.get("tools") is not None:
            chat["tools"] = body["tools"]
        params, messages = parse_chat(chat, (model_id,))  # tools checked as chat completions checks them
        return await self.tokenize(tenant, self.render, messages, generation_prompt, params.tools)

    def _token_ids(self, ids) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "'tokens' must be a list of token ids", param="tokens")
        if any(t < 0 or t >= self.vocab for t in ids):
            raise APIError(400, f"token ids must be in 0..{self.vocab - 1}", param="tokens")
        return ids

    # --- the body ----------------------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    async def read_json(self, request: Request) -> dict:
        raw = await self.read_body(request)
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    # --- the scheduler thread and the tiers ---------------------------------------------------------------
    async def on_scheduler(self, fn):
        """``fn()`` on the scheduler thread; the cache's typed errors as API errors."""
        future = self.scheduler.call(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            future.cancel()
            raise APIError(503, "the cache did not answer in time; retry", code="unavailable") from None
        except (SpecCacheError, StoreError) as exc:  # typed: mapped in one place (errors.STATUSES)
            raise api_error(exc) from None

    async def from_shared(self, space, tokens: list[int], drafter: Any = "generator's") -> None:
        """With a shared tier: fetch what it holds beyond LMDB now, on a worker thread (never the scheduler's),
        into the handoff the scheduler's restore takes it from (as a request's prefetch does)."""
        cache, generator = self.cache, self.generator
        if cache is None or cache.shared is None:
            return
        rule = self.usable(tokens)
        if rule is None:
            return
        key = await self.on_scheduler(lambda: self.ns_key(space))
        drafter = generator.drafter_namespace if drafter == "generator's" else drafter
        await anyio.to_thread.run_sync(lambda: cache.prefetch_shared(key, tokens, drafter, usable=rule))

    def usable(self, tokens: list[int]):
        return self.generator.usable_rule(len(tokens) + 1)  # what a request continuing this prefix may restore

    def quotas(self) -> tuple[int | None, int | None]:
        """(bytes one tenant may pin, bytes all pins may hold). All pins: half the memory tier and half of LMDB's
        ``--max-bytes``, the smaller (the rest stays for unpinned traffic). One tenant, even without tenant quotas:
        that total divided by the tenants this server knows (its API keys, at least 2), and within the tenant
        quotas of the memory tier and the store. Why: a pinned entry is never evicted, so pins beyond a tenant's
        share would make a budget evict another tenant that stays within its own share, and a tenant allowed the
        whole total would leave the others no pin at all."""
        cache = self.cache
        memory, store = cache.memory.budget_bytes or None, cache.store.max_bytes or None
        halves = [b // 2 for b in (memory, store) if b]
        total = min(halves) if halves else None
        share = None if total is None else total // max(2, len(self.tenants))
        limits = [q for q in (cache.memory.tenant_quota, cache.store.tenants.quota(store), share) if q is not None]
        return (min(limits) if limits else None), total

    def told(self, length: int, operator: bool) -> int:
        """``length`` stored tokens as the caller may learn them: rounded down to the granularity (operator: exact)."""
        return length if operator else length - length % self.granularity

    def pin_body(self, p: controls.Pin, operator: bool) -> dict:
        """A pin as its caller sees it (a tenant's pins cover a multiple of the granularity: ``controls.pin``)."""
        return {"object": "cache.pin", "id": p.pin_id, "tenant": tenant_label(p.owner),
                "tokens": self.told(p.length, operator), "ttl_s": round(max(0.0, p.until - time.monotonic()), 3),
                "expires_at": round(p.expires_at, 3), "bytes": p.nbytes, "tier": p.tier}

    # --- handlers ----------------------------------------------------------------------------------------
    async def pin(self, request: Request, body: dict, tenant, operator: bool) -> Response:
        max_ttl = self.max_ttl
        ttl = body.get("ttl_s", min(DEFAULT_PIN_TTL_S, max_ttl))
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < float("inf"):
            raise APIError(400, "'ttl_s' must be a positive number of seconds", param="ttl_s")
        if ttl > max_ttl:
            raise APIError(400, f"'ttl_s' is at most {max_ttl:g} on this server (--max-pin-ttl)", param="ttl_s",
                           code="ttl_too_long")
        tokens = await self.prefix_of(body, tenant)
        space = self.salted(tenant, body)
        await self.from_shared(space, tokens)

        def run():
            rule = self.usable(tokens)
            if rule is None:
                raise controls.NotStored("this server restores no stored prefix (its drafter needs rows it "
                                         "does not store)")
            per_tenant, total = self.quotas()
            record = self.cache.pin(self.ns_key(space), tokens, float(ttl), owner=tenant, quota_bytes=per_tenant,
                                    total_quota_bytes=total, drafter_namespace=self.generator.drafter_namespace,
                                    usable=rule, granularity=1 if operator else self.granularity)
            return {**self.pin_body(record, operator), "prompt_tokens": len(tokens)}
        return JSONResponse(await self.on_scheduler(run))

    async def unpin(self, request: Request, body: dict, tenant, operator: bool) -> Response:
        pid = body.get("id")
        if pid is not None and not isinstance(pid, str):
            raise APIError(400, "'id' must be a pin id (a string)", param="id")
        tokens = await self.prefix_of(body, tenant, required=pid is None)
        space = self.salted(tenant, body)

        def run():
            target = pid
            key = self.ns_key(space)
            if target is None:  # the caller's pin of the longest pinned prefix of these tokens
                mine = [p for p in controls.pins(self.cache, any_owner=True)
                        if p.ns_key == key and list(p.tokens) == tokens[:p.length]]
                if not mine:
                    raise controls.NotStored("no pin of these tokens")
                target = max(mine, key=lambda p: p.length).pin_id
            elif not operator and not any(p.pin_id == target for p in self.own_pins(tenant, key)):
                raise controls.NotStored(f"no pin {target!r}")  # another salt's: as if there were none
            record = self.cache.unpin(target, owner=tenant, any_owner=operator)
            return {"object": "cache.unpin", "id": record.pin_id, "tokens": self.told(record.length, operator),
                    "unpinned": True}
        return JSONResponse(await self.on_scheduler(run))

    async def prefetch(self, request: Request, body: dict, tenant, operator: bool) -> Response:
        tokens = await self.prefix_of(body, tenant)
        space = self.salted(tenant, body)
        await self.from_shared(space, tokens)

        def run():
            rule = self.usable(tokens)
            got = controls.Resident(0, None, False) if rule is None else self.cache.prefetch(
                self.ns_key(space), tokens, drafter_namespace=self.generator.drafter_namespace, usable=rule)
            told = self.told(got.length, operator)
            return {"object": "cache.prefetch", "tokens": told, "prompt_tokens": len(tokens),
                    "tier": got.tier if told else None, "resident": got.resident and told > 0}
        return JSONResponse(await self.on_scheduler(run))

    async def export(self, request: Request, body: dict, tenant, operator: bool) -> Response:
        tokens = await self.prefix_of(body, tenant)
        space = self.salted(tenant, body)
        await self.from_shared(space, tokens, drafter=None)  # the target's state only: what an mlx-lm file holds
        granularity = 1 if operator else self.granularity
        data, length = await self.on_scheduler(lambda: interop.export_prefix(
            self.cache, self.ns_key(space), tokens, model=self.config.model_id, granularity=granularity))
        return Response(data, media_type="application/octet-stream", headers={
            "X-Spec-Cache-Tokens": str(length), "Content-Disposition": 'attachment; filename="prefix.safetensors"'})

    async def import_(self, request: Request, body: dict, tenant, operator: bool, data: bytes) -> Response:
        """Imported KV is what every request of its namespace continues from, unchecked against any prompt: a
        tenant's import goes to a namespace of its own (``cache_salt`` required: only requests with the same salt
        reach it); the operator key imports into a tenant's shared namespace (``tenant``, or the keyless one)."""
        if not operator and body.get("cache_salt") is None:
            raise APIError(403, "an import into a namespace other callers share needs the operator key "
                           "(--operator-key); give a 'cache_salt' to import into a namespace only requests with "
                           "that salt reach", type="permission_error", param="cache_salt",
                           code="operator_key_required")
        tokens = await self.prefix_of(body, tenant, required=False)
        space = self.salted(tenant, body)
        generator = self.generator
        engine = generator.engine

        def run():
            length = controls.import_prefix(self.cache, self.ns_key(space), tokens, data, engine.target,
                                            target_identity=generator.target_identity,
                                            quantized=engine.plan is not None, plan=engine.plan)
            return {"object": "cache.import", "tokens": length, "stored": True}
        return JSONResponse(await self.on_scheduler(run))

    def own_pins(self, tenant, key: bytes) -> list:
        """``tenant``'s pins in namespace ``key`` only: inside one shared key a ``cache_salt`` is the privacy (the
        README), so one salt never lists nor ends another's pins, nor the unsalted namespace's (issue 37, fifth
        attacker pass: a caller with salt "y" listed salt "x"'s pin and ended it by its id). They still count
        against the key's one pin share."""
        return [p for p in controls.pins(self.cache, owner=tenant) if p.ns_key == key]

    async def pins_route(self, request: Request, body: dict, tenant, operator: bool) -> Response:
        if operator:
            listed = controls.pins(self.cache, owner=tenant, any_owner=True)
        else:
            space = self.salted(tenant, body)
            listed = await self.on_scheduler(lambda: self.own_pins(tenant, self.ns_key(space)))
        return JSONResponse({"object": "list", "data": [self.pin_body(p, operator) for p in listed]})

    # --- around every handler: the body, the caller, errors, metrics, the log line --------------------------
    def route(self, path: str, name: str, handler, method: str = "POST", raw: bool = False) -> Route:
        metrics = self.state.metrics

        async def handle(request: Request) -> Response:
            started, label, known = time.perf_counter(), "-", False
            try:
                data, body = await self._body(request, method, raw)
                check_text(body)  # a lone surrogate is no text: a 400 here, not the tokenizer's TypeError (a 500)
                tenant, operator = self.caller(request, body)
                label, known = tenant_label(tenant), True
                if self.cache is None:
                    raise APIError(400, "this server runs without a cache (--no-cache)", code="no_cache")
                async with self.turns.turn(tenant):
                    if raw:
                        response = await handler(request, body, tenant, operator, data or _file_of(body))
                    else:
                        response = await handler(request, body, tenant, operator)
                status = response.status_code
            except APIError as error:
                response, status = JSONResponse(error.body(), status_code=error.status,
                                                headers=error.headers), error.status
            metrics.requests.labels(endpoint=name, status=str(status)).inc()
            if known:
                metrics.tenant_requests.labels(tenant=label, status=str(status)).inc()
            log_request(f"{request.method} {request.url.path}", status, label, started)
            return response
        return Route(path, handle, methods=[method])

    async def _body(self, request: Request, method: str, raw: bool) -> tuple[bytes, dict]:
        """``(file bytes, fields)``: an octet-stream upload (``raw`` routes) with its fields in the query string, a
        JSON object (POST), or the query string (GET)."""
        if raw and request.headers.get("content-type", "").startswith("application/octet-stream"):
            return await self.read_body(request), dict(request.query_params)
        if method == "POST":
            return b"", await self.read_json(request)
        return b"", dict(request.query_params)


def _file_of(body: dict) -> bytes:
    """The file of a JSON ``/v1/cache/import`` body: ``file`` in base64."""
    text = body.get("file")
    if not isinstance(text, str) or not text:
        raise APIError(400, "'file' is required: the prompt-cache file in base64 (or send the file itself as "
                       "application/octet-stream)", param="file")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "'file' is not valid base64", param="file") from None
