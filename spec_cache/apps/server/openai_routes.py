"""OpenAI's routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Each generating handler authenticates, reads the body (``protocol.parse_chat`` / ``parse_completion``), turns it into
prompt ids (the chat template, tools included, or the text's tokens; a token-id prompt is taken as is) and, for a
chat with a cache, the message boundaries checkpointed while prefilling (``seam``); ``jobs.Requests.run_job`` does
the rest. An ``APIError`` anywhere is counted, logged and answered as OpenAI's error JSON.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spec_cache.apps.server.auth import tenant_label
from spec_cache.apps.server.jobs import Requests, error_response, log_request
from spec_cache.apps.server.protocol import APIError, parse_chat, parse_completion
from spec_cache.apps.server.seam import message_boundaries
from spec_cache.apps.server.tools import TemplateError, chat_ids, render_chat, uses_tools

__all__ = ["openai_routes"]


def openai_routes(requests: Requests) -> list[Route]:
    prompts = _Prompts(requests.tokenizer)
    return [
        Route("/v1/chat/completions", _generating(requests, prompts, "chat", chat=True), methods=["POST"]),
        Route("/v1/completions", _generating(requests, prompts, "completions", chat=False), methods=["POST"]),
        Route("/v1/models", _models(requests), methods=["GET"]),
    ]


class _Prompts:
    """Prompt ids from a parsed request (run in a worker thread through ``Requests.tokenize``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def chat(self, messages: list[dict], params=None) -> list[int]:
        tools, choice = (None, None) if params is None else (params.tools, params.tool_choice)
        try:
            return chat_ids(self.tokenizer, messages, tools, choice)
        except TemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="chat_template_error") from None

    def boundaries(self, messages: list[dict], prompt: list[int], params=None) -> list[int]:
        """Where the last messages end in ``prompt`` (and its end): checkpointed while prefilling (``seam``); each
        head is rendered the way ``chat`` rendered the whole conversation (tool turns included: a head of a
        conversation that uses tools renders through ``render_chat`` as the whole did)."""
        tokenizer = self.tokenizer
        tools, choice = (None, None) if params is None else (params.tools, params.tool_choice)
        tooled = uses_tools(tools, choice, messages)

        def render(head: list[dict], generation_prompt: bool):
            if tooled:
                return render_chat(tokenizer, head, tools, choice, add_generation_prompt=generation_prompt)
            return chat_ids(tokenizer, head, generation_prompt=generation_prompt)
        return message_boundaries(render, messages, prompt)


def _generating(requests: Requests, prompts: _Prompts, name: str, chat: bool):
    state = requests.state
    cache = state.generator.cache
    vocab = state.generator.engine.target.vocab_size

    async def handle(request: Request) -> Response:
        tenant, known, checkpoint_at = None, False, ()
        started = time.perf_counter()
        try:
            tenant = requests.tenant_of(request)
            known = True
            body = await requests.read_json(request)
            if chat:
                params, messages = parse_chat(body, state.models)
                prompt = await requests.tokenize(prompts.chat, messages, params)
                if cache is not None:
                    checkpoint_at = await requests.tokenize(prompts.boundaries, messages, prompt, params)
            else:
                params, text = parse_completion(body, state.models, vocab)
                prompt = text if isinstance(text, list) else await requests.tokenize(prompts.text, text)
            return await requests.run_job(request, name, params, prompt, tenant, chat, started, checkpoint_at)
        except APIError as error:
            requests.count(name, error.status, tenant, known)
            log_request(f"{request.method} {request.url.path}", error.status,
                        tenant_label(tenant) if known else "-", started, error=error.code or error.type)
            return error_response(error)
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
