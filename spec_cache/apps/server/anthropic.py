"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over the same scheduler.

Why a module of its own: the request and response shapes, the SSE event sequence and the error shape are
Anthropic's, not OpenAI's; everything else (auth, body limits, tokenizing off the loop, the job, its text pieces,
disconnects, metrics) is the machinery the OpenAI routes use too (``jobs.Requests``, handed in by ``create_app`` as
``messages_routes(ctx)``). Why one file: one protocol, read in the order a request flows (errors, parsing, the
conversion to a chat, the prompt and its breakpoints, the response shape, the routes); its parts share
``MessagesRequest`` and change together when Anthropic's API does.

A request is converted to the internal OpenAI-format conversation (``to_chat``): ``system`` becomes a system
message, text blocks are joined with blank lines, ``tool_use`` blocks become the assistant's ``tool_calls``,
``tool_result`` blocks become ``tool`` messages, tools become OpenAI function tools; it is rendered by
``tools.render_chat`` (the model's chat template, or its documented fallback). A trailing assistant message is a
prefill: the reply continues its text. Generated tool calls (``tools.ToolCallStream``) come back as ``tool_use``
blocks with ``stop_reason: "tool_use"``.

``cache_control`` breakpoints (on tools, system blocks, message blocks; at most 4): the token offset where the
marked block ends in the rendered prompt is found by rendering the request cut after that block and taking its
common prefix with the prompt; those offsets (plus the last message boundaries, ``seam``) go to the scheduler as
``Job.checkpoint_at``, so a later request sharing the prefix up to a breakpoint restores it.

Usage, as Anthropic counts it (the three input fields add up to the prompt's tokens):
``cache_read_input_tokens``: prompt tokens restored from the cache (rounded down to the server's
``--cached-tokens-granularity``); ``cache_creation_input_tokens``: prompt tokens up to the last ``cache_control``
breakpoint that were not read from the cache (this request checkpoints them: 0 once the breakpoint is stored, the
new part when an earlier prefix was; 0 without a breakpoint, without a cache, or under KV quantization; under a
granularity above 1 the breakpoint is rounded down to it too); ``input_tokens``: the rest of the prompt;
``output_tokens``: generated tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spec_cache.apps.server.auth import salted_tenant
from spec_cache.apps.server.protocol import MAX_STOP_CHARS, APIError, GenerationParams, check_text, greedy_floor
from spec_cache.apps.server.scheduler import MAX_CHECKPOINT_AT
from spec_cache.apps.server.seam import TextLocator, message_boundaries
from spec_cache.apps.server.tools import TemplateError, ToolCall, ToolCallStream, render_chat, tool_style

__all__ = ["messages_routes", "parse_messages", "to_chat", "error_payload", "anthropic_status",
           "MessagesRequest", "MAX_BREAKPOINTS"]

#: fields about Anthropic's service that do not change what a local model generates: accepted, not acted on
IGNORED = ("service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id", "diagnostics")
#: Anthropic's limit on ``cache_control`` breakpoints a request
MAX_BREAKPOINTS = 4
MAX_STOP_SEQUENCES = 16
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                    "tools", "tool_choice", "stream", "metadata", "thinking", "cache_control", "output_config",
                    "container", *IGNORED})
#: Anthropic's error ``type`` for each status this server answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


# -- errors ----------------------------------------------------------------------------------------------------
def anthropic_status(error: APIError) -> int:
    """The status Anthropic's clients expect: 422 is a 400 there; a full queue or a draining server is 529
    (overloaded, which the client retries); other 5xx are 500."""
    status = error.status
    if status == 422:
        return 400
    if (status == 429 and error.code == "overloaded") or status == 503:
        return 529
    if status >= 500 and status != 529:
        return 500
    return status


def error_payload(error: APIError) -> dict:
    status = anthropic_status(error)
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    headers = {k: v for k, v in error.headers.items() if k.lower() != "www-authenticate"}
    return JSONResponse(error_payload(error), status_code=anthropic_status(error), headers=headers)


def _bad(message: str) -> APIError:
    return APIError(400, message, code="invalid_request")


# -- the request -----------------------------------------------------------------------------------------------
@dataclass
class MessagesRequest:
    """A checked ``/v1/messages`` body. ``messages``: Anthropic messages with ``content`` as a list of blocks;
    ``tools``: OpenAI function tools; ``tool_choice``: in ``tools.render_chat``'s terms; ``breakpoints``:
    where ``cache_control`` marks end a block (``("tools", k)``, ``("system", j)``, ``("message", i, j)``)."""

    params: GenerationParams
    system: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tools: bool = True
    prefill: str | None = None  # a trailing assistant message's text: the reply continues it
    breakpoints: list[tuple] = field(default_factory=list)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _cache_control(block: dict, where: str, point: tuple, out: list) -> None:
    control = block.get("cache_control")
    if control is None:
        return
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise _bad(f"{where}.cache_control: must be {{\"type\": \"ephemeral\"}} (optionally with \"ttl\")")
    ttl = control.get("ttl")
    if ttl is not None and ttl not in ("5m", "1h"):
        raise _bad(f"{where}.cache_control.ttl: must be \"5m\" or \"1h\"")
    out.append(point)


def _text_of(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for k, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise _bad(f"{where}[{k}]: only text blocks are supported here")
            parts.append(block["text"])
        return "\n\n".join(parts)
    raise _bad(f"{where}: must be a string or a list of text blocks")


def _blocks(content: Any, role: str, where: str, points: list, i: int) -> list[dict]:
    """``content`` as a checked list of blocks (thinking blocks, which this server never produces, dropped)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or a list of content blocks")
    out = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{at}: must be an object with a 'type'")
        kind = block["type"]
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{at}.text: must be a string")
            checked = {"type": "text", "text": block["text"]}
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not block["name"]:
                raise _bad(f"{at}: a tool_use block needs 'id' and 'name' strings")
            if not isinstance(block.get("input", {}), dict):
                raise _bad(f"{at}.input: must be an object")
            checked = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": block.get("input", {})}
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id: must be a string")
            text = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error") is True:
                text = "Error: " + text
            checked = {"type": "tool_result", "tool_use_id": block["tool_use_id"], "content": text}
        else:
            raise _bad(f"{at}: content blocks of type {kind!r} are not supported in a {role} message (this "
                       "server takes text, tool_use in assistant messages, tool_result in user messages)")
        _cache_control(block, at, ("message", i, len(out)), points)
        out.append(checked)
    return out


def _tools(body: dict, points: list) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools: must be a list")
    out, names = [], set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where}: must be an object")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"{where}: server tools ({tool.get('type')!r}) are not supported; give custom tools "
                       "(name, description, input_schema)")
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise _bad(f"{where}.name: must match {TOOL_NAME.pattern}")
        if name in names:
            raise _bad(f"{where}.name: {name!r} is given twice")
        names.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema: must be a JSON schema object")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.description: must be a string")
        function = {"name": name, "description": description or "", "parameters": schema}
        _cache_control(tool, where, ("tools", k), points)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[Any, bool]:
    """(``render_chat``'s tool_choice, whether several calls may come in one reply)."""
    choice = body.get("tool_choice")
    if choice is None:
        return None, True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    parallel = choice.get("disable_parallel_tool_use") is not True
    kind = choice["type"]
    if kind in ("auto", "none"):
        return kind, parallel
    if not tools:
        raise _bad(f"tool_choice: {kind!r} needs 'tools'")
    if kind == "any":
        return "required", parallel
    name = choice.get("name")
    if not any(t["function"]["name"] == name for t in tools):
        raise _bad(f"tool_choice.name: no tool named {name!r}")
    return {"type": "function", "function": {"name": name}}, parallel


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (low < value if low_open else low <= value) and value <= high):
        raise _bad(f"{name}: must be a number in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def parse_messages(body: Any, models: tuple[str, ...], default_temperature: float = 0.0, *,
                   counting: bool = False) -> MessagesRequest:
    """A ``/v1/messages`` body (``counting``: a ``count_tokens`` body, no ``max_tokens``), checked; raises
    ``APIError`` (400, 404 for an unknown model). Checked in this order: the fields, the model, the generation
    parameters, the tools, the system prompt, the messages and their breakpoints, a final prefill."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    try:
        check_text(body)
    except APIError as error:
        raise _bad(error.message) from None
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise _bad(f"{unknown[0]}: Extra inputs are not permitted (this server takes {', '.join(sorted(FIELDS))})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: Field required (a string)")
    if model not in models:
        raise APIError(404, f"model: {model} (this server serves {', '.join(models)})", code="model_not_found")
    params = _params(body, model, default_temperature, counting)
    points: list[tuple] = []
    tools = _tools(body, points)
    tool_choice, parallel = _tool_choice(body, tools)
    system_blocks = _system(body.get("system"), points)
    checked = _messages(body, points)
    return MessagesRequest(params=params, system=system_blocks, messages=checked, tools=tools,
                           tool_choice=tool_choice, parallel_tools=parallel, prefill=_prefill(checked),
                           breakpoints=points)


def _params(body: dict, model: str, default_temperature: float, counting: bool) -> GenerationParams:
    """``max_tokens``, stop sequences, streaming, metadata and sampling; ``thinking`` checked and ignored; the
    features this server does not offer (structured outputs, containers) refused by name."""
    max_tokens = body.get("max_tokens")
    if not counting and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad("max_tokens: Field required (an integer >= 1)")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop_sequences: must be a list of non-empty strings")
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"stop_sequences: at most {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_CHARS} characters")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not isinstance(metadata.get("user_id", ""), str)):
        raise _bad("metadata: must be an object with an optional 'user_id' string")
    _thinking(body.get("thinking"), None if counting else max_tokens)
    _unsupported(body)
    temperature = _number(body, "temperature", 0.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):  # 0 (or less): off
        raise _bad("top_k: must be an integer")
    top_p = 1.0 if top_p is None else top_p
    return GenerationParams(model=model, max_tokens=max_tokens if not counting else None,
                            temperature=greedy_floor(temperature, top_p), top_p=top_p, stop=list(stops),
                            stream=stream, user=(metadata or {}).get("user_id"), top_k=max(0, top_k or 0))


#: the smallest ``thinking.budget_tokens`` Anthropic takes
MIN_THINKING_BUDGET = 1024


def _thinking(thinking: Any, max_tokens: int | None) -> None:
    """``thinking`` as Anthropic checks it (``enabled`` with an integer ``budget_tokens`` >= 1024 and below
    ``max_tokens``, ``adaptive``, ``disabled``), then ignored: the served model does not think in a separate
    channel, so a reply carries no ``thinking`` blocks: a client that asks for thinking gets the answer alone,
    as from a turn in which the model did not think (a 400 here broke its first call)."""
    if thinking is None:
        return
    kinds = ("enabled", "adaptive", "disabled")
    if not isinstance(thinking, dict) or thinking.get("type") not in kinds:
        raise _bad("thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or "
                   "{\"type\": \"disabled\"}")
    if thinking["type"] != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise _bad(f"thinking.budget_tokens: must be an integer >= {MIN_THINKING_BUDGET}")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("max_tokens: must be greater than thinking.budget_tokens")


def _unsupported(body: dict) -> None:
    output = body.get("output_config")
    if output is not None and (not isinstance(output, dict) or output.get("format") is not None):
        raise _bad("output_config.format: structured outputs are not supported by this server")
    if body.get("container") is not None:
        raise _bad("container: code-execution containers are not supported by this server")


def _system(system: Any, points: list) -> list[dict]:
    """``system`` (a string or text blocks, each may carry a breakpoint) as text blocks."""
    if isinstance(system, str):
        return [{"type": "text", "text": system}] if system else []
    if system is None:
        return []
    if not isinstance(system, list):
        raise _bad("system: must be a string or a list of text blocks")
    blocks = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"system[{j}]: must be a text block")
        _cache_control(block, f"system[{j}]", ("system", j), points)
        blocks.append({"type": "text", "text": block["text"]})
    return blocks


def _messages(body: dict, points: list) -> list[dict]:
    """The messages as ``{"role", "content": blocks}``, their breakpoints (and the body's automatic one, on the
    last block) added to ``points``, at most ``MAX_BREAKPOINTS`` in all."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: Field required (a non-empty list)")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}: must be an object with role \"user\" or \"assistant\"")
        role = message["role"]
        checked.append({"role": role, "content": _blocks(message.get("content"), role, where, points, i)})
    if body.get("cache_control") is not None:  # automatic caching: a breakpoint on the last block
        last = checked[-1]
        _cache_control(body, "cache_control", ("message", len(checked) - 1, len(last["content"]) - 1), points)
    if len(points) > MAX_BREAKPOINTS:
        raise _bad(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(points)}.")
    return checked


def _prefill(checked: list[dict]) -> str | None:
    """A final assistant message's text (the reply continues it), or None."""
    if checked[-1]["role"] != "assistant":
        return None
    last = checked[-1]["content"]
    if any(b["type"] != "text" for b in last):
        raise _bad("messages: a final assistant message (a prefill) may hold only text")
    prefill = "".join(b["text"] for b in last)
    if prefill != prefill.rstrip():
        raise _bad("messages: final assistant content cannot end with trailing whitespace")
    if len(checked) == 1:
        raise _bad("messages: the conversation must start with a user message")
    return prefill


# -- the conversation, as the template sees it ------------------------------------------------------------------
def to_chat(system: list[dict], messages: list[dict]) -> list[dict]:
    """Anthropic ``system`` blocks and messages as OpenAI-format messages (``tools.render_chat``'s input)."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": "\n\n".join(b["text"] for b in system)})
    names: dict[str, str] = {}
    for message in messages:
        texts: list[str] = []
        if message["role"] == "assistant":
            calls = []
            for block in message["content"]:
                if block["type"] == "text":
                    texts.append(block["text"])
                else:
                    names[block["id"]] = block["name"]
                    arguments = json.dumps(block["input"], ensure_ascii=False)
                    calls.append({"id": block["id"], "type": "function",
                                  "function": {"name": block["name"], "arguments": arguments}})
            turn: dict = {"role": "assistant", "content": "\n\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
            continue
        for block in message["content"]:
            if block["type"] == "text":
                texts.append(block["text"])
                continue
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            result = {"role": "tool", "tool_call_id": block["tool_use_id"], "content": block["content"]}
            if block["tool_use_id"] in names:
                result["name"] = names[block["tool_use_id"]]
            out.append(result)
        if texts or not message["content"]:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


@dataclass
class Prompt:
    ids: list[int]
    checkpoint_at: tuple[int, ...] = ()
    breakpoint_end: int = 0  # where the last cache_control breakpoint ends (0: none)
    breakpoints: tuple[int, ...] = ()  # where each cache_control breakpoint ends (checkpointed warm or not)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class HeadMemo:
    """The token ids of the breakpoint heads each tenant rendered lately. Why: an agent sends the same system prompt
    and tool definitions on every request, with a breakpoint after them; its head was rendered and tokenized each
    time (~20 ms for an 8k-token head with SmolLM2's tokenizer, on the tokenizer thread before the job exists).

    Tenancy: heads are kept per API key's tenant (``group``), ``per_tenant`` each (the least recently used go), for
    at most ``tenants`` groups (the least recently active go): one tenant's flood of heads, or of cache salts, evicts
    only its own. Within a group a head is keyed by the namespace tenant (salted) and a digest of exactly what is
    rendered (messages, tools, tool choice), so one tenant's renders never answer another's: a hit is faster, and
    its timing would tell. Thread-safe (the tokenizer threads share it)."""

    def __init__(self, per_tenant: int = 8, tenants: int = 64) -> None:
        self.per_tenant, self.tenants = per_tenant, tenants
        self._groups: OrderedDict[str | None, OrderedDict[tuple, array]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def ids(self, group: str | None, tenant: str | None, parts: tuple, render: Callable[[], list[int]]) -> list[int]:
        """``render()``'s ids for ``parts`` under ``tenant`` (of API key tenant ``group``), rendered once while
        remembered."""
        blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False).encode()
        key = (tenant, hashlib.blake2b(blob, digest_size=20).digest())
        with self._lock:
            held = self._groups.get(group, {}).get(key)
            if held is not None:
                self._groups.move_to_end(group)
                self._groups[group].move_to_end(key)
                self.hits += 1
                return held.tolist()
        ids = render()
        with self._lock:
            mine = self._groups.setdefault(group, OrderedDict())
            self._groups.move_to_end(group)
            mine[key] = array("I", ids)  # (token ids, 4 bytes each)
            while len(mine) > self.per_tenant:
                mine.popitem(last=False)
            while len(self._groups) > self.tenants:
                self._groups.popitem(last=False)
        return ids

    def held(self, group: str | None) -> int:
        """How many heads ``group`` holds (for tests and stats)."""
        with self._lock:
            return len(self._groups.get(group, ()))


def build_prompt(tokenizer, request: MessagesRequest, boundaries: bool,
                 seam_floor: Callable[[list[int]], int | None] | None = None,
                 heads: tuple[HeadMemo, str | None, str | None] | None = None) -> Prompt:
    """The prompt's token ids and, when ``boundaries`` (a cache that takes checkpoints), the offsets to checkpoint
    (the breakpoints first, then the last message boundaries) and where the last breakpoint ends. Runs on the
    tokenizer thread. ``seam_floor(ids)`` (``Scheduler.seam_floor`` for the request's tenant): the message heads
    the cache already covers are not rendered, none on a warm turn whose tail is not split, as on the OpenAI
    routes. ``heads``: ``(memo, API key tenant, namespace tenant)``, the breakpoint heads' ids remembered across
    requests (``HeadMemo``)."""
    def render(messages: list[dict], generation_prompt: bool, tools=request.tools) -> list[int]:
        return render_chat(tokenizer, messages, tools, request.tool_choice, add_generation_prompt=generation_prompt)

    def head_ids(messages: list[dict], generation_prompt: bool, tools=request.tools) -> list[int]:
        if heads is None:
            return render(messages, generation_prompt, tools)
        memo, group, tenant = heads
        return memo.ids(group, tenant, (messages, tools, request.tool_choice, generation_prompt),
                        lambda: render(messages, generation_prompt, tools))

    messages = request.messages[:-1] if request.prefill is not None else request.messages
    chat = to_chat(request.system, messages)
    try:
        ids = render(chat, True)
    except TemplateError as exc:
        raise APIError(400, str(exc), code="chat_template_error") from None
    if request.prefill:
        ids = ids + [int(t) for t in tokenizer.encode(request.prefill, add_special_tokens=False)]
    if not boundaries:  # nothing is checkpointed (no cache, or only counting)
        return Prompt(ids)
    points = []
    for point in request.breakpoints:
        end = _breakpoint_end(head_ids, request, point, ids)
        if end:
            points.append(end)
    marked = set(points)
    floor = 0 if seam_floor is None else seam_floor(ids)

    def render_text(messages: list[dict], generation_prompt: bool) -> str:
        return render_chat(tokenizer, messages, request.tools, request.tool_choice, tokenize=False,
                           add_generation_prompt=generation_prompt)

    locate = TextLocator(tokenizer, render_text, chat, ids)  # the heads' ends from one tokenization of the prompt
    found = [len(ids)] if floor is None else message_boundaries(lambda head, gp: render(head, gp), chat, ids,
                                                                floor=floor, locate=locate)
    seams = sorted(set(found) - marked)
    keep = max(0, MAX_CHECKPOINT_AT - len(marked))  # the scheduler keeps the largest offsets: breakpoints first
    return Prompt(ids, tuple(sorted(marked | set(seams[len(seams) - keep:]))), max(points, default=0),
                  tuple(sorted(marked)))


def _breakpoint_end(render: Callable, request: MessagesRequest, point: tuple, ids: list[int]) -> int:
    """The prompt offset where the block ``point`` names ends: the request cut after that block, rendered without
    a generation prompt, as far as it agrees with the prompt (0 when the template refuses every cut)."""
    tools = request.tools
    if point[0] == "tools":
        head, tools = to_chat(request.system, []), (request.tools or [])[: point[1] + 1]
    elif point[0] == "system":
        head = to_chat(request.system[: point[1] + 1], [])
    else:
        i, j = point[1], point[2]
        if request.prefill is not None and i == len(request.messages) - 1:
            return 0  # a breakpoint inside the prefill: the prompt ends there anyway
        cut = dict(request.messages[i], content=request.messages[i]["content"][: j + 1])
        head = to_chat(request.system, request.messages[:i] + [cut])
    heads = [head]
    if point[0] != "message":  # a template that cannot render a system turn alone (or no turn): an empty user turn
        heads.append(head + [{"role": "user", "content": ""}])  # after it; the common prefix stops where they differ
    for candidate in heads:
        try:
            return _common_prefix(render(candidate, False, tools), ids)
        except Exception:  # a template that refuses this head (it must end with a user turn, say)
            continue
    return 0


# -- the response ------------------------------------------------------------------------------------------------
def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments_object()}


def usage_of(prompt_tokens: int, cached: int, generated: int, breakpoint_end: int, caching: bool,
             granularity: int = 1) -> dict:
    """Anthropic's usage; ``cached``: the restored count as told (rounded down to ``granularity``). Creation is what
    this request writes up to its last breakpoint beyond what it read, counted in the same multiples: from the exact
    restored count it would tell a prober whether the breakpoint is stored (the breakpoint is theirs to place), so
    under a granularity a breakpoint inside the first multiple is never counted, and one already stored is 0 (not
    the whole prefix again, turn after turn)."""
    end = breakpoint_end - breakpoint_end % max(1, granularity)
    creation = max(0, end - cached) if caching else 0
    return {"input_tokens": prompt_tokens - cached - creation, "output_tokens": generated,
            "cache_creation_input_tokens": creation, "cache_read_input_tokens": cached}


def stop_reason(reason: str, timing: dict, calls: int) -> tuple[str, str | None]:
    if calls:
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    stop = timing.get("stop_sequence")
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def _sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


class MessagesShape:
    """How ``run_job`` answers a ``/v1/messages`` request: ``body`` (the whole message) or ``stream`` (the SSE
    event sequence). One per request."""

    def __init__(self, request: MessagesRequest, prompt: Prompt, style: str, caching: bool, granularity: int):
        self.request, self.prompt, self.style = request, prompt, style
        self.caching, self.granularity = caching, granularity

    def new_id(self) -> str:
        return new_message_id()

    def _usage(self, cached: int, generated: int) -> dict:
        return usage_of(len(self.prompt.ids), cached, generated, self.prompt.breakpoint_end, self.caching,
                        self.granularity)

    def _message(self, rid: str, content: list, reason: str | None, stop: str | None, use: dict) -> dict:
        return {"id": rid, "type": "message", "role": "assistant", "model": self.request.params.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": use}

    def _parser(self) -> ToolCallStream | None:
        return ToolCallStream(self.style) if self.request.calls_tools else None

    def _keep(self, events: list[tuple], calls: list) -> list[tuple]:
        """Events past a first call are dropped under ``disable_parallel_tool_use``."""
        out = []
        for event in events:
            if event[0] == "tool_call":
                if calls and not self.request.parallel_tools:
                    continue
                calls.append(event[1])
            elif calls and not self.request.parallel_tools:
                continue
            out.append(event)
        return out

    def body(self, rid: str, text: str, reason: str, generated: int, cached: int, timing: dict) -> dict:
        parser, calls = self._parser(), []
        events = [("text", text)] if parser is None else parser.feed(text) + parser.finish()
        content = []
        for kind, value in self._keep(events, calls):
            if kind == "text":
                if value:
                    content.append({"type": "text", "text": value})
            else:
                content.append(tool_use_block(value))
        why, stop = stop_reason(reason, timing, len(calls))
        return self._message(rid, content, why, stop, self._usage(cached, generated))

    async def stream(self, pieces: AsyncIterator[tuple], rid: str, timing: dict, account) -> AsyncIterator[bytes]:
        parser, calls = self._parser(), []
        blocks = _Blocks()
        started = False
        try:
            async for piece in pieces:
                if not started:  # after the first piece the restored prefix is known: message_start carries it
                    exact = timing.get("cached", 0)
                    use = self._usage(exact - exact % self.granularity, 0)
                    yield _sse("message_start", {"type": "message_start",
                                                 "message": self._message(rid, [], None, None, use)})
                    started = True
                if piece[0] == "text":
                    events = [("text", piece[1])] if parser is None else parser.feed(piece[1])
                    for chunk in blocks.emit(self._keep(events, calls)):
                        yield chunk
                    continue
                _, reason, generated, cached = piece
                if parser is not None:
                    for chunk in blocks.emit(self._keep(parser.finish(), calls)):
                        yield chunk
                for chunk in blocks.close():
                    yield chunk
                if account is not None:
                    account(generated, cached)
                why, stop = stop_reason(reason, timing, len(calls))
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": why, "stop_sequence": stop},
                                             "usage": self._usage(cached, generated)})
                yield _sse("message_stop", {"type": "message_stop"})
                return
        except APIError as error:
            yield _sse("error", error_payload(error))


class _Blocks:
    """The content blocks of a streamed message: a text block opens on the first text and closes before a
    ``tool_use`` block, which is sent whole (start, one ``input_json_delta``, stop)."""

    def __init__(self) -> None:
        self.index = -1
        self.open_text = False

    def emit(self, events: list[tuple]) -> list[bytes]:
        out = []
        for kind, value in events:
            if kind == "text":
                if not value:
                    continue
                if not self.open_text:
                    self.index += 1
                    self.open_text = True
                    out.append(_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                            "content_block": {"type": "text", "text": ""}}))
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                        "delta": {"type": "text_delta", "text": value}}))
                continue
            out += self.close()
            self.index += 1
            block = dict(tool_use_block(value), input={})
            out.append(_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block}))
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": {"type": "input_json_delta",
                                                              "partial_json": value.arguments}}))
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def close(self) -> list[bytes]:
        if not self.open_text:
            return []
        self.open_text = False
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]


# -- the routes --------------------------------------------------------------------------------------------------
def authorization(headers) -> str | None:
    """The credential to check: ``Authorization`` as given, else ``x-api-key`` (what Anthropic's clients send) as
    a bearer token; the same keys and tenants as the OpenAI routes."""
    given = headers.get("authorization")
    if given:
        return given
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else None


def messages_routes(ctx) -> list[Route]:
    """The routes, over ``create_app``'s machinery: ``ctx`` has ``state``, ``read_json``, ``tokenize``, ``tokenize_as``,
    ``run_job``, ``count``, ``log_request``, ``granularity``."""
    state = ctx.state
    tokenizer = state.tokenizer
    cache = state.generator.cache
    caching = cache is not None and getattr(state.generator.engine, "plan", None) is None
    styles: list[str] = []
    heads = HeadMemo()  # breakpoint heads' ids per tenant (an agent's system prompt and tools: once, not each request)

    def style() -> str:
        if not styles:
            styles.append(tool_style(tokenizer))
        return styles[0]

    def tenant_of(request: Request) -> str | None:
        try:
            return state.auth.check(authorization(request.headers))
        except APIError as error:
            if error.status != 401:
                raise
            raise APIError(401, "invalid x-api-key: send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')",
                           code="invalid_api_key") from None

    def handler(name: str, counting: bool):
        async def handle(request: Request) -> Response:
            tenant, known = None, False
            started = ctx.clock()
            # closed at the submit, or here (``scheduler.Arrival``); counting tokens submits nothing
            arrival = None if counting else ctx.arriving(request)
            try:
                tenant = tenant_of(request)
                known = True
                body = await ctx.read_json(request)
                parsed = parse_messages(body, state.models, state.config.default_temperature, counting=counting)
                # a tenant's tokenizing: one request at a time, in one turn with its other routes' (jobs.Requests)
                salted = salted_tenant(tenant, getattr(parsed.params, "cache_salt", None))
                seam_floor = None if counting or not caching else partial(ctx.scheduler.seam_floor, salted)
                prompt = await ctx.tokenize_as(tenant, build_prompt, tokenizer, parsed, caching and not counting,
                                               seam_floor, (heads, tenant, salted))
                if counting:
                    ctx.count(name, 200, tenant)
                    return JSONResponse({"input_tokens": len(prompt.ids)})
                room = state.config.context_tokens - len(prompt.ids)
                if 1 <= room < parsed.params.max_tokens:  # Anthropic clients send a large fixed max_tokens: the
                    parsed.params.max_tokens = room  # reply stops at the context's end, with stop_reason max_tokens
                parse_style = styles[0] if styles else await ctx.tokenize(style)  # probes the template once
                shape = MessagesShape(parsed, prompt, parse_style, caching, ctx.granularity)
                return await ctx.run_job(request, name, parsed.params, prompt.ids, tenant, False, started,
                                         prompt.checkpoint_at, shape=shape, pinned_at=prompt.breakpoints)
            except APIError as error:
                ctx.count(name, anthropic_status(error), tenant, known)
                ctx.log_request(f"{request.method} {request.url.path}", anthropic_status(error),
                                ctx.tenant_label(tenant) if known else "-", started, error=error.code or error.type)
                return error_response(error)
            finally:
                if arrival is not None:
                    arrival.done()
        return handle

    return [Route("/v1/messages", handler("messages", False), methods=["POST"]),
            Route("/v1/messages/count_tokens", handler("count_tokens", True), methods=["POST"])]
