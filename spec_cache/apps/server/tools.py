"""Tool calls: rendering tools and tool turns through the chat template, and parsing calls out of generated text.

Why one file: rendering and parsing are the two halves of one contract with the chat template (the fallback renders
a call as the very ``<tool_call>`` text the parser reads back), so they are read and tested together.

Why a module of its own: both APIs (OpenAI chat completions in ``app``, Anthropic messages) render the same
OpenAI-format conversation and parse the same model output; nothing here touches the engine or HTTP.

Rendering (``render_chat``): messages in OpenAI's format (``system`` / ``user`` / ``assistant`` with optional
``tool_calls`` / ``tool`` with ``tool_call_id``) and the request's ``tools`` go through the model's own chat
template (``apply_chat_template(messages, tools=...)``) when that template renders tools, tool calls and tool
results (``supports_tools`` probes it once per template). Otherwise the documented fallback: the tools are listed
as JSON in a system block that asks for Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
output, assistant tool calls are rendered as that text and tool results as a user turn of
``<tool_response>...</tool_response>`` blocks; the template then only sees plain system / user / assistant text.

Parsing (``parse_tool_calls`` / ``ToolCallStream``): the style comes from the template (``tool_style``):
``hermes`` (Hermes, Qwen 2.5/3, the fallback): ``<tool_call>{json}</tool_call>`` blocks anywhere in the text;
``llama3`` (Llama 3.1-3.3 JSON tool calling): a reply that starts with ``{"name": ..., "parameters": ...}``
objects (optionally after ``<|python_tag|>``, separated by ``;`` or whitespace). Text that looks like a call but
does not parse as one (bad JSON, no ``name``) stays text, never a guessed call. Whitespace next to a call is
dropped. ``parse_tool_calls`` is the stream run over the whole text, so streamed and whole answers agree.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["ToolCall", "TemplateError", "ToolCallStream", "parse_tool_calls", "tool_style", "supports_tools",
           "render_chat", "FALLBACK_INSTRUCTIONS", "STYLES"]

STYLES = ("hermes", "llama3")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

#: the fallback's system block (Qwen 2.5's own wording, so Hermes-trained models recognise it); ``{tools}`` is
#: one JSON object per line
FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


class TemplateError(ValueError):
    """The chat template refused the conversation (the caller answers 400)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is a JSON text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def arguments_object(self) -> Any:
        """The arguments decoded (Anthropic's ``tool_use.input``); ``{}`` for an empty text."""
        return json.loads(self.arguments) if self.arguments.strip() else {}

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls[]`` entry (with ``index`` for a streamed delta)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """A ``ToolCall`` from a decoded ``{"name": str, <args key>: object}``, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in keys:
        if key in obj:
            arguments = obj[key]
            break
    else:
        if set(obj) - {"name", "type"}:  # a JSON answer that merely has a "name" field
            return None
    if isinstance(arguments, str):  # some models emit the arguments already as JSON text
        try:
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder goes
            return None
        arguments = decoded
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


# -- streaming parser ----------------------------------------------------------------------------------------
class _Emitter:
    """Collects events, merging text and dropping the whitespace next to a call (held until known)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.pending_ws = ""
        self.after_call = False

    def text(self, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        full = self.pending_ws + text
        body = full.rstrip()
        self.pending_ws = full[len(body):]
        if body:
            if self.events and self.events[-1][0] == "text":
                self.events[-1] = ("text", self.events[-1][1] + body)
            else:
                self.events.append(("text", body))

    def call(self, call: ToolCall) -> None:
        self.pending_ws, self.after_call = "", True
        self.events.append(("tool_call", call))

    def finish(self) -> None:
        if self.pending_ws:
            pending, self.pending_ws = self.pending_ws, ""
            if self.events and self.events[-1][0] == "text":
                self.events[-1] = ("text", self.events[-1][1] + pending)
            else:
                self.events.append(("text", pending))

    def take(self) -> list[tuple]:
        events, self.events = self.events, []
        return events


def _prefix_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStream:
    """``feed(text) -> events``, ``finish() -> events``; an event is ``("text", str)`` or ``("tool_call",
    ToolCall)``. Text that may still become a call is held back (for ``llama3``: the whole reply while it may
    be a JSON call) and released as text once it cannot."""

    def __init__(self, style: str) -> None:
        if style not in STYLES:
            raise ValueError(f"unknown tool-call style {style!r}; known: {', '.join(STYLES)}")
        self.style = style
        self.calls = 0  # tool calls emitted so far
        self._out = _Emitter()
        self._buf = ""
        self._inside = False  # hermes: within <tool_call>
        self._mode = "start"  # llama3: start (undecided) / json / text
        self._json_calls = 0
        self._finished = False

    def feed(self, text: str) -> list[tuple]:
        if self._finished:
            raise ValueError("feed() after finish()")
        self._buf += text
        self._hermes(final=False) if self.style == "hermes" else self._llama3(final=False)
        return self._take()

    def finish(self) -> list[tuple]:
        if not self._finished:
            self._finished = True
            self._hermes(final=True) if self.style == "hermes" else self._llama3(final=True)
            self._out.finish()
        return self._take()

    def _take(self) -> list[tuple]:
        events = self._out.take()
        self.calls += sum(1 for kind, _ in events if kind == "tool_call")
        return events

    def _hermes(self, final: bool) -> None:
        while True:
            buf = self._buf
            if not self._inside:
                at = buf.find(HERMES_OPEN)
                if at >= 0:
                    self._out.text(buf[:at])
                    self._buf, self._inside = buf[at + len(HERMES_OPEN):], True
                    continue
                keep = 0 if final else _prefix_tail(buf, HERMES_OPEN)
                self._out.text(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return
            at = buf.find(HERMES_CLOSE)
            if at < 0 and not final:
                return
            body = buf if at < 0 else buf[:at]
            self._buf = "" if at < 0 else buf[at + len(HERMES_CLOSE):]
            self._inside = False
            call = _hermes_call(body)
            if call is not None:
                self._out.call(call)
            else:  # not a call after all: the text as written
                self._out.text(HERMES_OPEN + body + ("" if at < 0 else HERMES_CLOSE))
            if at < 0:
                return

    def _llama3(self, final: bool) -> None:
        if self._mode == "text":
            self._out.text(self._buf)
            self._buf = ""
            return
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._mode = "json"
            elif not final and (not head or PYTHON_TAG.startswith(head)):
                return  # may still become a call
            else:
                self._mode = "text"
                return self._llama3(final)
        decoder = json.JSONDecoder()
        while True:
            rest = self._buf.lstrip()
            if self._json_calls == 0:
                rest = rest[len(PYTHON_TAG):].lstrip() if rest.startswith(PYTHON_TAG) else rest
            else:
                rest = rest.lstrip(";").lstrip()
            if not rest:
                if final:
                    self._out.text(self._buf)
                    self._buf = ""
                return
            if rest.startswith("{"):
                try:
                    obj, end = decoder.raw_decode(rest)
                except ValueError:
                    if not final:
                        return  # may be incomplete: hold
                    obj, end = None, 0
                call = _call_from(obj, ("parameters", "arguments")) if end else None
                if call is not None:
                    self._out.call(call)
                    self._json_calls += 1
                    self._buf = rest[end:]
                    continue
            self._mode = "text"  # not (or no longer) a call: the rest is text as written
            self._out.text(self._buf)
            self._buf = ""
            return


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder goes
        return None
    return _call_from(obj, ("arguments", "parameters"))


def parse_tool_calls(text: str, style: str) -> tuple[str, list[ToolCall]]:
    """The text outside the calls (whitespace next to a call dropped) and the calls, in order."""
    stream = ToolCallStream(style)
    parts, calls = [], []
    for kind, value in stream.feed(text) + stream.finish():
        (parts if kind == "text" else calls).append(value)
    return "".join(parts), calls


# -- the template ------------------------------------------------------------------------------------------------
def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    if isinstance(template, (list, tuple)):  # [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in template)
    return template if isinstance(template, str) else ""


_PROBE_TOOL = "spec_cache_probe_tool_q7"
_PROBE_CALL = "spec_cache_probe_call_k3"
_PROBE_RESULT = "spec_cache_probe_result_z9"


def supports_tools(tokenizer) -> bool:
    """Whether the chat template renders ``tools``, assistant ``tool_calls`` and ``tool`` results (probed by
    rendering each with a unique name and looking for it in the output; remembered per template text)."""
    template = _template_text(tokenizer)
    if not template:
        return False
    return _probe(template, tokenizer)


_PROBED: dict[tuple[int, str], bool] = {}


def _probe(template: str, tokenizer) -> bool:
    key = (id(tokenizer), template)
    if key not in _PROBED:
        if len(_PROBED) > 64:
            _PROBED.clear()
        _PROBED[key] = _probe_render(tokenizer)
    return _PROBED[key]


def _probe_render(tokenizer) -> bool:
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "call_probe0001", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_probe0001", "name": _PROBE_CALL, "content": _PROBE_RESULT}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False)
    except Exception:
        return False
    return isinstance(text, str) and all(name in text for name in (_PROBE_TOOL, _PROBE_CALL, _PROBE_RESULT))


def tool_style(tokenizer) -> str:
    """How this model writes calls: ``llama3`` for Llama 3.x JSON templates that render tools, else ``hermes``
    (Hermes / Qwen templates, and the fallback, which asks for Hermes blocks)."""
    if not supports_tools(tokenizer):
        return "hermes"
    template = _template_text(tokenizer)
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3"
    return "hermes"


def active_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict]:
    """The tools to render: none for ``tool_choice: "none"``, only the named one for a named choice."""
    if not tools or tool_choice == "none":
        return []
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return [t for t in tools if (t.get("function") or {}).get("name") == name]
    return list(tools)


def _arguments_object(arguments: Any) -> Any:
    """Templates expect ``arguments`` as an object (they ``tojson`` it); OpenAI sends JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder goes
            return arguments
    return arguments


def _template_messages(messages: Iterable[dict]) -> list[dict]:
    out = []
    for message in messages:
        message = copy.deepcopy(message)
        if message.get("content") is None:
            message["content"] = ""
        for call in message.get("tool_calls") or ():
            function = call.setdefault("function", {})
            function["arguments"] = _arguments_object(function.get("arguments"))
        out.append(message)
    return out


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments"))}
    return f"{HERMES_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{HERMES_CLOSE}"


def _choice_note(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "\n\nYou must call at least one function."
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return f"\n\nYou must call the function \"{name}\"."
    return ""


def fallback_messages(messages: Iterable[dict], tools: list[dict], tool_choice: Any = None) -> list[dict]:
    """The conversation as plain system / user / assistant text for a template without tool support."""
    out: list[dict] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = FALLBACK_INSTRUCTIONS.format(tools=lines) + _choice_note(tool_choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _apply(tokenizer, messages: list[dict], tokenize: bool, generation_prompt: bool, **kwargs) -> list[int] | str:
    result = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=tokenize,
                                           **kwargs)
    if not tokenize:
        return result
    if isinstance(result, dict) or hasattr(result, "input_ids"):
        result = result["input_ids"]
    return [int(t) for t in result]


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, tool_choice: Any = None, *,
                tokenize: bool = True, add_generation_prompt: bool = True) -> list[int] | str:
    """The prompt (token ids; text with ``tokenize=False``) for OpenAI-format ``messages`` and ``tools``, through
    the template when it supports tools, else through the fallback. ``TemplateError`` when the template refuses
    the conversation. ``add_generation_prompt=False``: a head of the conversation as the template renders it
    inside a longer one (for checkpoints at message boundaries)."""
    tools = active_tools(tools, tool_choice)
    gp = add_generation_prompt
    try:
        if supports_tools(tokenizer):
            return _apply(tokenizer, _template_messages(messages), tokenize, gp, **({"tools": tools} if tools else {}))
        plain = fallback_messages(messages, tools, tool_choice)
        try:
            return _apply(tokenizer, plain, tokenize, gp)
        except Exception:
            if not (plain and plain[0]["role"] == "system" and len(plain) > 1 and plain[1]["role"] == "user"):
                raise
            # a template without a system role: the system text leads the first user turn instead
            merged = [{"role": "user", "content": plain[0]["content"] + "\n\n" + plain[1]["content"]}] + plain[2:]
            return _apply(tokenizer, merged, tokenize, gp)
    except TemplateError:
        raise
    except Exception as exc:
        raise TemplateError(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from None


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, tool_choice: Any = None, *,
             generation_prompt: bool = True) -> list[int]:
    """A chat request's prompt ids, the one way every route renders one: ``render_chat`` when the request uses
    tools (tool turns, the fallback), else the template as it is. ``TemplateError`` when the template refuses."""
    if uses_tools(tools, tool_choice, messages):
        return render_chat(tokenizer, messages, tools, tool_choice, add_generation_prompt=generation_prompt)
    try:
        return _apply(tokenizer, messages, True, generation_prompt)
    except Exception as exc:
        raise TemplateError(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from None


def chat_text(tokenizer, messages: list[dict], tools: list[dict] | None = None, tool_choice: Any = None, *,
              generation_prompt: bool = True) -> str:
    """``chat_ids``'s prompt as the template's text (what it tokenizes): the same render, ``tokenize=False``."""
    if uses_tools(tools, tool_choice, messages):
        return render_chat(tokenizer, messages, tools, tool_choice, tokenize=False,
                           add_generation_prompt=generation_prompt)
    try:
        return _apply(tokenizer, messages, False, generation_prompt)
    except Exception as exc:
        raise TemplateError(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from None


def uses_tools(tools: list[dict] | None, tool_choice: Any, messages: Iterable[dict]) -> bool:
    """Whether a chat request needs ``render_chat`` (tools to offer, or tool turns in its history)."""
    return bool(active_tools(tools, tool_choice)) or any(
        m.get("role") == "tool" or m.get("tool_calls") for m in messages)


async def tool_pieces(pieces, style: str, reason: str = "tool_calls"):
    """The app's generation pieces (``("text", str)`` ..., then ``("end", finish_reason, ...)``) with tool calls
    parsed out: text pieces become ``("text", str)`` / ``("tool_call", ToolCall)``; the end piece's finish reason
    becomes ``reason`` when any call was made."""
    stream = ToolCallStream(style)
    async for piece in pieces:
        if piece[0] == "text":
            for event in stream.feed(piece[1]):
                yield event
            continue
        if piece[0] == "end":
            for event in stream.finish():
                yield event
            if stream.calls:
                piece = (piece[0], reason, *piece[2:])
        yield piece
