"""The OpenAI request and response shapes the server speaks: parsing with typed errors, and response builders.

Why one file: OpenAI's request rules and response shapes are one contract, and the parsers share one set of field
checkers (``_number``, ``_integer``, ``_common``) and error helpers.

``parse_chat`` / ``parse_completion`` turn a decoded JSON body into a ``GenerationParams`` (plus the messages or
the prompt) or raise ``APIError`` with the status OpenAI-compatible clients expect: 400 for a malformed body
(not an object, a missing field, a wrong type), 422 for a value out of range or a feature this server does not
offer, 404 for an unknown model. Nothing here touches the model or the engine.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from spec_cache.rows.sampling import means_greedy

__all__ = ["APIError", "GenerationParams", "PromptBatch", "parse_chat", "parse_completion", "with_choices",
           "error_body", "usage", "chat_response", "chat_chunk", "completion_response",
           "completion_chunk", "new_id"]

#: the most choices one request may ask for (``n`` x prompts): each is a row of the batch
MAX_CHOICES = 16
#: the most stop strings a request may give (OpenAI's limit)
MAX_STOPS = 4
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")

#: OpenAI parameters this server does not implement, each with the values that mean "off". A request that leaves
#: one out or sends one of those values is served (OpenAI clients and frameworks often send the neutral defaults,
#: e.g. ``frequency_penalty: 0``); any other value is refused with 400 ``unsupported_parameter``, never ignored
#: (silently ignoring a penalty or a JSON schema would be a wrong answer the client cannot see). ``logprobs``, chat's
#: ``top_logprobs`` and ``echo`` are served: ``logprobs.take`` reads them before these parsers see the body.
UNSUPPORTED: dict[str, tuple] = {
    "top_logprobs": (0,), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "parallel_tool_calls": (True, False),
    "best_of": (1,), "suffix": ("",), "min_tokens": (0,),
}


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class GenerationParams:
    """What one request asks of the engine, checked. ``max_tokens`` None: the server's default."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: the server's default
    top_p: float = 1.0
    top_k: int = 0      # <= 0: off (the row sampler applies it, as min_p, top_p and temperature)
    min_p: float = 0.0  # 0: off; likewise
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the EOS ids
    tools: list[dict] = field(default_factory=list)  # chat: OpenAI function tools, checked
    tool_choice: Any = None  # chat: None (no tools) / "none" / "auto" / "required" / {"type": "function", ...}
    n: int = 1  # choices per prompt (each its own row; greedy ones are equal, seeded ones use seed + index)
    #: logits processors as mlx_lm.server applies them, by ``RowSampling``'s names (only those set: ``logit_bias``,
    #: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, their ``*_context_size``)
    processors: dict = field(default_factory=dict)
    #: ``response_format`` checked: None (text), ``{"type": "json_object"}`` or ``{"type": "json_schema", "schema":
    #: {...}}``; ``jobs.make_job`` turns it into the row's grammar (``spec_cache.rows.grammar``)
    response_format: dict | None = None


class PromptBatch(tuple):
    """Several prompts of one ``/v1/completions`` request (each a string or token ids), answered as choices
    ``prompt_index * n + j`` in one body (lm-eval's ``batch_size > 1``)."""


def _malformed(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _bad_value(message: str, param: str | None = None) -> APIError:
    return APIError(422, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default: float | None, low: float, high: float, *,
            low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(f"'{name}' must be a number", name)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise _bad_value(f"'{name}' must be in {bound}, got {value}", name)
    return float(value)


def greedy_floor(temperature: float | None, top_p: float) -> float | None:
    """``temperature`` as the sampler reads it: 0 when it or ``top_p`` is below its floor (``means_greedy``: such a
    request is greedy, so its tokens are a function of it, as a retry's replay and the seed the server picks
    assume), else unchanged (None: the server's default)."""
    if temperature is not None and temperature > 0 and means_greedy(temperature, top_p):
        return 0.0
    return temperature


#: a lone UTF-16 surrogate: JSON's ``"\\ud800"`` decodes to one, and no UTF-8 text (a tokenizer's input, a digest's
#: bytes) can hold it
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(body: Any) -> None:
    """400 when a string of ``body`` (a key or a value, at any depth) holds a lone surrogate. Why here, once: every
    string of a request ends up encoded as UTF-8 somewhere (the tokenizer, the ``cache_salt`` digest, the chat
    template), and each of those raised its own non-HTTP error (a plain-text 500). Iterative: a body nests as deep
    as the JSON decoder allowed."""
    stack: list[tuple[Any, str | None]] = [(body, None)]
    while stack:
        value, field_name = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                where = f"'{field_name}'" if field_name is not None else "the request body"
                raise _malformed(f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                                 field_name)
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key if field_name is None and isinstance(key, str) and not _SURROGATE.search(key) \
                    else field_name
                stack.append((key, field_name))
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, field_name) for item in value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _malformed(f"'{name}' must be an integer", name)
    if value < low or (high is not None and value > high):
        raise _bad_value(f"'{name}' must be >= {low}" + (f" and <= {high}" if high is not None else "")
                         + f", got {value}", name)
    return value


def _processors(body: dict, vocab_size: int | None) -> dict:
    """The logits processors a body sets, checked, as ``RowSampling`` keyword arguments (``spec_cache.rows.sampling``:
    exactly mlx-lm's ``make_logits_processors``, over the last ``*_context_size`` tokens, prompt included, default
    20, as mlx_lm.server). Ranges: ``frequency_penalty`` / ``presence_penalty`` in [-2, 2] (OpenAI's; 0: off),
    ``repetition_penalty`` > 0 (1, and mlx_lm.server's default 0: off), ``logit_bias`` token ids (as strings) of the
    vocabulary -> values in [-100, 100]."""
    out: dict = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name, 0.0, -2.0, 2.0)
        if value:
            out[name] = value
    repetition = body.get("repetition_penalty")
    if repetition is not None:
        if isinstance(repetition, bool) or not isinstance(repetition, (int, float)):
            raise _malformed("'repetition_penalty' must be a number", "repetition_penalty")
        if not math.isfinite(repetition) or repetition < 0:
            raise _bad_value(f"'repetition_penalty' must be > 0 (1: off), got {repetition}", "repetition_penalty")
        if repetition not in (0, 1):  # 0 is mlx_lm.server's "off"
            out["repetition_penalty"] = float(repetition)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = _integer(body, name, 0)
        if value is not None:
            out[name] = value
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _malformed("'logit_bias' must be an object of token ids (strings) to numbers", "logit_bias")
        checked: dict[int, float] = {}
        for key, value in bias.items():
            if not isinstance(key, str) or not re.fullmatch(r"[0-9]{1,10}", key):
                raise _bad_value(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
            token = int(key)
            if vocab_size is not None and token >= vocab_size:
                raise _bad_value(f"'logit_bias' token {token} is not in [0, {vocab_size})", "logit_bias")
            if token in checked:
                raise _bad_value(f"'logit_bias' names token {token} twice", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _malformed(f"'logit_bias' values must be numbers (token {key})", "logit_bias")
            if not math.isfinite(value) or not -100 <= value <= 100:
                raise _bad_value(f"'logit_bias' values must be in [-100, 100], got {value} for token {key}",
                                 "logit_bias")
            checked[token] = float(value)
        if checked:
            out["logit_bias"] = checked
    if not any(name in out for name in ("frequency_penalty", "presence_penalty", "repetition_penalty",
                                        "logit_bias")):
        return {}  # context sizes alone change nothing
    return out


def _response_format(body: dict) -> dict | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (or none) is plain text; ``json_object`` and
    ``json_schema`` (``{"name", "schema"?, "strict"?, "description"?}``) constrain the output (``make_job``)."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _malformed("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _bad_value(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                         "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _malformed("'response_format.json_schema' must be an object with a 'name' (a string)", "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _malformed("'response_format.json_schema.schema' must be a JSON Schema object", "response_format")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise _malformed("'response_format.json_schema.strict' must be a boolean", "response_format")
    return {"type": "json_schema", "schema": schema}


def _common(body: Any, models: tuple[str, ...], max_tokens_names: tuple[str, ...],
            supported: tuple[str, ...] = (), vocab_size: int | None = None) -> GenerationParams:
    if not isinstance(body, dict):
        raise _malformed("the request body must be a JSON object")
    check_text(body)
    for name, neutral in UNSUPPORTED.items():
        if name in supported:
            continue
        value = body.get(name)
        if value is not None and not any(_same(value, n) for n in neutral):
            off = " or ".join(json.dumps(n) for n in neutral)
            if isinstance(value, int) and not isinstance(value, bool) and isinstance(neutral[0], bool):
                off = "null"  # an integer form (/v1/completions' ``logprobs: N``): its "off" is null, not false
            raise APIError(400, f"'{name}' is not supported by this server (leave it out, or send {off})",
                           param=name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _malformed("'model' is required (a string)", "model")
    if model not in models:
        raise APIError(404, f"The model '{model}' does not exist; this server serves {', '.join(models)}",
                       param="model", code="model_not_found")
    max_tokens = None
    for name in max_tokens_names:
        value = _integer(body, name, 1)
        if value is not None:
            max_tokens = value
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _malformed("'seed' must be an integer", "seed")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise _bad_value("'seed' is out of range", "seed")
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _malformed("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad_value(f"'stop' takes at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                         "characters", "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _malformed("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _malformed("'stream_options' must be an object", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 1024):
        raise _malformed("'cache_salt' must be a non-empty string of at most 1024 characters", "cache_salt")
    user = body.get("user")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _malformed("'ignore_eos' must be a boolean", "ignore_eos")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise _malformed("'top_k' must be an integer", "top_k")
    temperature, top_p = _number(body, "temperature", None, 0.0, 2.0), _number(body, "top_p", 1.0, 0.0, 1.0,
                                                                              low_open=True)
    return GenerationParams(
        model=model, max_tokens=max_tokens, temperature=greedy_floor(temperature, top_p), top_p=top_p,
        top_k=max(0, top_k or 0), min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed, stop=stops, stream=stream, include_usage=include_usage, cache_salt=salt,
        user=user if isinstance(user, str) else None, ignore_eos=ignore_eos, n=n,
        processors=_processors(body, vocab_size), response_format=_response_format(body),
    )


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` without bool/number confusion (``False == 0`` in Python, not in JSON)."""
    return type(value) is type(neutral) and value == neutral or (
        isinstance(neutral, (int, float)) and not isinstance(neutral, bool) and not isinstance(value, bool)
        and isinstance(value, (int, float)) and value == neutral)


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad_value(f"{where}: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise _malformed(f"{where}: 'content' must be a string or a list of text parts", "messages")


#: OpenAI's rule for function names
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tool_error(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_tools")


def _parse_tools(body: dict) -> list[dict]:
    """``tools``: a list of ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _tool_error("'tools' must be a list of function tools", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _tool_error(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (only function "
                              "tools are supported)", "tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise _tool_error(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", "tools")
        if name in names:
            raise _tool_error(f"{where}: the function name {name!r} is declared twice", "tools")
        names.add(name)
        if "description" in function and not isinstance(function["description"], (str, type(None))):
            raise _tool_error(f"{where}.function.description must be a string", "tools")
        if "parameters" in function and not isinstance(function["parameters"], (dict, type(None))):
            raise _tool_error(f"{where}.function.parameters must be a JSON Schema object", "tools")
        clean = {"name": name}
        for key in ("description", "parameters", "strict"):
            if function.get(key) is not None:
                clean[key] = function[key]
        out.append({"type": "function", "function": clean})
    return out


def _parse_tool_choice(body: dict, tools: list[dict]) -> Any:
    """``tool_choice``: "none" / "auto" / "required" / ``{"type": "function", "function": {"name"}}`` naming a
    declared tool; None when there are no tools and no choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _tool_error(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, "
                              f"got {choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise _tool_error("'tool_choice' is \"required\" but no 'tools' were given", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise _tool_error("'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": "
                          "...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise _tool_error(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _parse_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, with ``arguments`` as JSON text (an object is accepted and encoded)."""
    if not isinstance(calls, list) or not calls:
        raise _tool_error(f"{where}.tool_calls must be a non-empty list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise _tool_error(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}}}", "messages")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _tool_error(f"{at}.id is required (a string)", "messages")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _tool_error(f"{at}.function.name is required (a string)", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise _tool_error(f"{at}.function.arguments must be a JSON string", "messages")
        try:
            if arguments.strip():
                json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            raise _tool_error(f"{at}.function.arguments is not valid JSON (or nests too deeply)", "messages") \
                from None
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def parse_chat(body: Any, models: tuple[str, ...], vocab_size: int | None = None,
               ) -> tuple[GenerationParams, list[dict]]:
    """A ``/v1/chat/completions`` body: its parameters (``tools`` / ``tool_choice`` checked) and its messages as
    ``{"role", "content": str}``, plus ``tool_calls`` on an assistant message that called tools and
    ``tool_call_id`` / ``name`` on a tool result (which must answer a call of the assistant message before it)."""
    params = _common(body, models, ("max_tokens", "max_completion_tokens"), supported=("tools", "tool_choice"),
                     vocab_size=vocab_size)
    params.tools = _parse_tools(body)
    params.tool_choice = _parse_tool_choice(body, params.tools)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _malformed("'messages' is required (a non-empty list)", "messages")
    out: list[dict] = []
    open_calls: dict[str, str] = {}  # id -> function name, of the last assistant message's calls
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _malformed(f"{where} must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise _malformed(f"{where}: 'role' is required", "messages")
        if role not in ROLES:
            raise _bad_value(f"{where}: unknown role {role!r}", "messages")
        content = message.get("content")
        if content is None and role != "assistant":  # OpenAI: only an assistant turn (one that called tools) may
            raise _malformed(f"{where}: 'content' is required for a {role!r} message (a string or a list of text "
                             "parts; null only in an assistant message)", "messages")
        entry = {"role": "system" if role == "developer" else role,
                 "content": "" if content is None else _text_content(content, where)}
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = _parse_tool_calls(message["tool_calls"], where)
            open_calls = {c["id"]: c["function"]["name"] for c in entry["tool_calls"]}
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _tool_error(f"{where}: a 'tool' message needs 'tool_call_id' (a string)", "messages")
            if call_id not in open_calls:
                raise _tool_error(f"{where}: 'tool_call_id' {call_id!r} answers no tool call of the assistant "
                                  "message before it", "messages")
            entry["tool_call_id"], entry["name"] = call_id, open_calls[call_id]
        if role != "tool":
            open_calls = {} if role != "assistant" or "tool_calls" not in entry else open_calls
        out.append(entry)
    return params, out


def parse_completion(body: Any, models: tuple[str, ...], vocab_size: int,
                     ) -> tuple[GenerationParams, str | list[int] | PromptBatch]:
    """A ``/v1/completions`` body: its parameters and its prompt (text, or token ids), or a ``PromptBatch`` of
    several."""
    params = _common(body, models, ("max_tokens",), vocab_size=vocab_size)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) * params.n > MAX_CHOICES:
            raise _bad_value(f"{len(prompt)} prompts x n={params.n} choices: at most {MAX_CHOICES} a request",
                             "prompt")
        return params, PromptBatch(_one_prompt(p, vocab_size) for p in prompt)
    return params, _one_prompt(prompt, vocab_size)


def _one_prompt(prompt: Any, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad_value("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise _bad_value(f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
        return list(prompt)
    raise _malformed("'prompt' is required: a string, a list of token ids, or a list of those", "prompt")


def with_choices(bodies: list[dict]) -> dict:
    """One response body of several choices: the first body with every body's choice, indexed in order."""
    out = dict(bodies[0])
    out["choices"] = [dict(body["choices"][0], index=i) for i, body in enumerate(bodies)]
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, model: str, text: str, finish_reason: str, use: dict, tool_calls: list | None = None
                  ) -> dict:
    """``tool_calls``: parsed calls (``tools.ToolCall``); then ``content`` is null when no text is left."""
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": [c.openai() for c in tool_calls]}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               use: dict | None = None, index: int = 0) -> dict:
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if use is not None:
        chunk["usage"] = use
    return chunk


def completion_response(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish_reason: str | None = None,
                     use: dict | None = None, index: int = 0) -> dict:
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": None,
                                        "finish_reason": finish_reason}]
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        chunk["usage"] = use
    return chunk
