"""OpenAI's routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Each generating handler authenticates, reads the body (``protocol.parse_chat`` / ``parse_completion``), turns it into
prompt ids (the chat template, tools included, or the text's tokens; a token-id prompt is taken as is) and, for a
chat with a cache, the message boundaries checkpointed while prefilling (``seam``); ``jobs.Requests.run_job`` does
the rest. An ``APIError`` anywhere is counted, logged and answered as OpenAI's error JSON.

A ``response_format`` grammar is compiled before the job is made, in a worker thread (``_Grammars``: at most
``GRAMMAR_THREADS`` at once, one at a time per API key), never on the event loop: a schema's check may take up to
``rows.grammar.CHECK_SECONDS`` (issue 37, third attacker pass: one 700-byte schema held the loop for minutes).
A tenant's tokenizing also waits its turn (``jobs.Requests.tokenize_as``): one of its requests at a time in the
tokenizer's queue, which is one worker for every tenant (third attacker pass: 100 concurrent 168 KB prompts of
one key, each refused as too long after tokenizing, held another key's request 5 s); one turn across every route
(fifth pass: a turn per route let a key flooding all four queue four requests ahead of another key's).
"""

from __future__ import annotations

import time

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spec_cache.apps.server.auth import salted_tenant, tenant_label
from spec_cache.apps.server.jobs import Requests, error_response, log_request
from spec_cache.apps.server.limits import TenantTurns
from spec_cache.apps.server.logprobs import take as take_logprobs
from spec_cache.apps.server.protocol import APIError, PromptBatch, parse_chat, parse_completion
from spec_cache.apps.server.seam import TextLocator, message_boundaries
from spec_cache.apps.server.tools import TemplateError, active_tools, chat_ids, chat_text, render_chat, uses_tools

__all__ = ["openai_routes"]

#: grammars compiled at once (each may run a child check of up to ``rows.grammar.CHECK_SECONDS``)
GRAMMAR_THREADS = 2


def openai_routes(requests: Requests) -> list[Route]:
    prompts = _Prompts(requests.tokenizer, requests.scheduler)
    grammars = _Grammars(requests)
    return [
        Route("/v1/chat/completions", _generating(requests, prompts, grammars, "chat", chat=True), methods=["POST"]),
        Route("/v1/completions", _generating(requests, prompts, grammars, "completions", chat=False),
              methods=["POST"]),
        Route("/v1/models", _models(requests), methods=["GET"]),
    ]


class _Prompts:
    """Prompt ids from a parsed request (run in a worker thread through ``Requests.tokenize``)."""

    def __init__(self, tokenizer, scheduler=None) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # ``held_prefix``: what the memory tier covers already
        self.renders = 0  # message heads rendered for boundaries, as text or ids (a counter for tests)
        self.tokenized = 0  # of them, those tokenized (the rest found in the prompt's text: ``seam.TextLocator``)

    def text(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def chat(self, messages: list[dict], params=None) -> list[int]:
        tools, choice = (None, None) if params is None else (params.tools, params.tool_choice)
        try:
            return chat_ids(self.tokenizer, messages, tools, choice)
        except TemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="chat_template_error") from None

    def seams(self, messages: list[dict], prompt: list[int], params, tenant: str | None) -> list[int]:
        """``boundaries`` past what the memory tier holds of ``prompt`` for ``tenant`` (a namespace tenant,
        ``Scheduler.seam_floor``); only the end of the prompt for a warm turn whose tail the scheduler will not
        split: no head is rendered then."""
        floor = 0 if self.scheduler is None else self.scheduler.seam_floor(tenant, prompt)
        if floor is None:
            return [len(prompt)]
        return self.boundaries(messages, prompt, params, floor)

    def boundaries(self, messages: list[dict], prompt: list[int], params=None, floor: int = 0) -> list[int]:
        """Where the last messages end in ``prompt`` (and its end): checkpointed while prefilling (``seam``); each
        head is rendered the way ``chat`` rendered the whole conversation (tool turns included: a head of a
        conversation that uses tools renders through ``render_chat`` as the whole did). ``floor``: offsets at or
        below it give no checkpoint, and heads that short are not rendered (``seam.message_boundaries``);
        ``renders`` counts the heads rendered."""
        tokenizer = self.tokenizer
        tools, choice = (None, None) if params is None else (params.tools, params.tool_choice)
        tooled = uses_tools(tools, choice, messages)

        def render(head: list[dict], generation_prompt: bool):
            self.renders += 1
            self.tokenized += 1
            if tooled:
                return render_chat(tokenizer, head, tools, choice, add_generation_prompt=generation_prompt)
            return chat_ids(tokenizer, head, generation_prompt=generation_prompt)

        def text_of(head: list[dict], generation_prompt: bool) -> str:
            if tooled:
                return render_chat(tokenizer, head, tools, choice, tokenize=False,
                                   add_generation_prompt=generation_prompt)
            return chat_text(tokenizer, head, generation_prompt=generation_prompt)

        def render_text(head: list[dict], generation_prompt: bool) -> str:
            self.renders += 1
            return text_of(head, generation_prompt)
        locate = TextLocator(tokenizer, render_text, messages, prompt, full_text=lambda: text_of(messages, True))
        return message_boundaries(render, messages, prompt, floor=floor, locate=locate)


class _Grammars:
    """Compiles a request's ``response_format`` grammar in a worker thread before its job is made (module doc);
    ``jobs.Requests.grammar`` then finds it compiled (``rows.grammar`` keeps it). A tenant's compiles run one at a
    time, so one API key's hostile schemas hold at most one of the ``GRAMMAR_THREADS``."""

    def __init__(self, requests: Requests) -> None:
        self.requests = requests
        self.limiter = anyio.CapacityLimiter(GRAMMAR_THREADS)
        self.turns = TenantTurns()

    async def ready(self, params, tenant: str | None):
        """The compiled grammar (None without ``response_format``): held by the handler until its job is made, so
        ``jobs.Requests.grammar`` finds it (``rows.grammar`` keeps live grammars) however many were compiled since."""
        if getattr(params, "response_format", None) is None:
            return None
        async with self.turns.turn(tenant):
            return await anyio.to_thread.run_sync(self.requests.grammar, params, limiter=self.limiter)


def _generating(requests: Requests, prompts: _Prompts, grammars: _Grammars, name: str, chat: bool):
    state = requests.state
    cache = state.generator.cache
    vocab = state.generator.engine.target.vocab_size

    async def handle(request: Request) -> Response:
        tenant, known, checkpoint_at = None, False, ()
        started = time.perf_counter()

        async def tokenize(fn, *args):  # a tenant's tokenizing: one request at a time, every route (module doc)
            return await requests.tokenize_as(tenant, fn, *args)
        arrival = requests.arriving(request)  # closed at the submit, or here (``scheduler.Arrival``)
        try:
            tenant = requests.tenant_of(request)
            known = True
            body, scoring = take_logprobs(await requests.read_json(request), chat)  # logprobs / echo: theirs
            if chat:
                params, messages = parse_chat(body, state.models, vocab)
                compiled = await grammars.ready(params, tenant)  # noqa: F841  (held)
                prompt = await tokenize(prompts.chat, messages, params)
                if cache is not None:
                    checkpoint_at = await tokenize(prompts.seams, messages, prompt, params,
                                                   salted_tenant(tenant, params.cache_salt))
            else:
                params, text = parse_completion(body, state.models, vocab)
                compiled = await grammars.ready(params, tenant)  # noqa: F841  (held)
                if isinstance(text, PromptBatch):  # several prompts: choices of one body
                    batch = [t if isinstance(t, list) else await tokenize(prompts.text, t) for t in text]
                    return await requests.run_choices(request, name, params, batch, tenant, chat, started,
                                                      scoring=scoring)
                prompt = text if isinstance(text, list) else await tokenize(prompts.text, text)
            if scoring.logprobs is not None and chat and active_tools(params.tools, params.tool_choice):
                raise APIError(422, "'logprobs' with tools is not supported (tool calls are parsed out of the "
                               "text)", param="logprobs", code="unsupported_parameter")
            if params.n > 1:
                return await requests.run_choices(request, name, params, [prompt], tenant, chat, started,
                                                  checkpoint_at, scoring=scoring)
            return await requests.run_job(request, name, params, prompt, tenant, chat, started, checkpoint_at,
                                          scoring=scoring)
        except APIError as error:
            requests.count(name, error.status, tenant, known)
            log_request(f"{request.method} {request.url.path}", error.status,
                        tenant_label(tenant) if known else "-", started, error=error.code or error.type)
            return error_response(error)
        finally:
            arrival.done()
    return handle


def _models(requests: Requests):
    model_id = requests.config.model_id

    async def models_route(request: Request) -> Response:
        try:
            tenant = requests.tenant_of(request)
        except APIError as error:
            requests.count("models", error.status, known=False)
            return error_response(error)
        requests.count("models", 200, tenant)
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "spec-cache"}]})
    return models_route
