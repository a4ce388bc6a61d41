"""Coding-agent workload (``tools/bench_serve.py --workload agent``): concurrent agent sessions that share one long
system prompt of tool definitions and grow by tool calls and tool results, against ``mlx_lm.server``, ``spec-cache
serve`` and our ``mlx-lm-server`` launcher.

    .venv/bin/python tools/bench_serve.py --workload agent [--servers mlx-lm,serve,spec-cache] [--sessions 4]
        [--clients 4] [--turns 8] [--system-words 8000] [--tools 20] [--max-tokens 64]
        [--tool-result-words 300-1500] [--user-words 10-20] [--tool-turns text|blocks] [--no-cache-control]
        [--json OUT] [--warmup tiny|shapes] [--serve-arg=ARG ...] [--launcher-arg=ARG ...] [--mlx-lm-arg=ARG ...]
        [--cwd DIR] [--keep]

Why a module of its own: the chat workload (``tools/bench_mlx_lm_server.py``) owns the server processes, the
OpenAI streaming client, the summaries and the report; this file adds only what an agent session is (its
deterministic text, its two wire formats, the Anthropic streaming client) and reuses the rest. It imports that
module, never the other way round. Why one file: one workload, read in the order a run flows (its text, the wire
formats, the clients, a server's run, the report, the command line), whose parts share one argument set.

The workload (every text deterministic, made of ``w<N>`` words so the tiny test model tokenizes one token a word):

* one system prompt of ``--system-words`` words shared by every session: a preamble and ``--tools`` tool
  definitions (a two-word name, a description, parameter lines);
* ``--sessions`` sessions, ``--clients`` at a time, ``--turns`` turns each. A turn sends the conversation so far and
  times the streamed, greedy ``--max-tokens`` reply (TTFT, tokens); then the history grows by the reply (the
  server's own, less special-token words: ``without_special``) with a scripted tool call after it, the tool's
  result (``--tool-result-words``: session s, turn t gets ``lo + (389 s + 577 t) mod (hi - lo + 1)`` words,
  code-like lines or prose) and a short user line (``--user-words``);
* after the turns each server is stopped (SIGTERM) and started again on the same store, and every session sends
  its next turn (its whole history, the last tool result and a new user line): "after restart". mlx_lm.server
  lost its RAM cache; ours restore the history from the store.

``spec-cache serve`` is driven through Anthropic's streaming ``/v1/messages`` (TTFT: the first ``text_delta``;
prompt and cached tokens from ``usage``: ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``
and ``cache_read_input_tokens``), with ``cache_control`` on the system prompt and on the last block as coding agents
send it (``--no-cache-control``: none); mlx_lm.server and the launcher get the same conversation on streaming
``/v1/chat/completions``. Every server must see the same prompt tokens each turn, so the greedy replies can be
compared: the report counts the requests whose ``prompt_tokens`` agree with the first server's.

Tool turns, ``--tool-turns``: ``text`` (default) sends the tool call as text after the reply in the assistant
message and the tool result as text of the next user message (before the new user line), in both APIs. ``blocks``
sends real tool turns: Anthropic ``tool_use`` / ``tool_result`` blocks to serve, an assistant ``tool_calls`` message
and a ``role: "tool"`` message to the others. Why ``text`` is the default: the prompts differ under ``blocks`` on
a template without tool support (the tiny model's, which knows only system / user / assistant): serve renders
tool turns through its documented fallback (Hermes ``<tool_call>`` text, tool results as a ``<tool_response>`` user
turn) while mlx_lm.server hands ``tool_calls`` and ``role: "tool"`` to the template as they are (it drops the call,
renders an empty role word); ``blocks`` is for a model whose template renders tools natively, where the equality
check in the report says whether the two APIs agree.

The report is the chat workload's (TTFT p50/p95 per turn, the turns >= 2 pooled, after restart; tokens/s; serve's
stage means; identical replies) plus the prompt tokens per turn and server; ``figures`` carries
``agent_{serve,launcher}_{warm_ttft,restart_ttft,tok_s}_c<clients>`` (TTFT: mlx_lm.server's p50 / ours; tokens/s:
ours / mlx_lm.server's; > 1: ours faster). Without ``--model`` the tiny llama is written with a context long enough
for the longest prompt (serve refuses prompts past the model's ``max_position_embeddings``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import bench_mlx_lm_server as base

VOCAB = 253  # w3 .. w255: the tiny tokenizer's words (ids 0-2 are <unk>, <s>, </s>)
CALL_ARGUMENT_WORDS = (3, 6)  # the scripted call's "path" and "query" arguments


# -- the workload's text ---------------------------------------------------------------------------------------------
def vocab_words(n: int, salt: int) -> list[str]:
    """``n`` pseudo-random ``w<N>`` words for ``salt``. Why not ``bench_mlx_lm_server.words``: its sequence repeats
    every 240 words and a salt only shifts it, so two sessions' tool results could share long runs (accidental
    prefix hits); a mixed hash of (salt, i) gives texts that share nothing beyond chance."""
    out = []
    for i in range(n):
        x = (salt * 0x9E3779B1 + (i + 1) * 0x85EBCA77) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 12
        out.append(f"w{x % VOCAB + 3}")
    return out


def lines(ws: list[str], per_line: int, indent: str = "") -> str:
    return "\n".join(indent + " ".join(ws[i:i + per_line]) for i in range(0, len(ws), per_line))


def tool_name(k: int) -> list[str]:
    """Tool ``k``'s name: two words (``_``-joined in the APIs' ``name`` fields, spaces in text); the first differs
    between tools (up to 253 of them), so no two share a name."""
    return [f"w{(k * 37) % VOCAB + 3}", *vocab_words(1, 100 + k)]


def system_prompt(n_words: int, tools: int) -> str:
    """Exactly ``n_words`` words: a preamble (about a sixth) and ``tools`` definitions of equal size, each a name,
    a description line and parameter lines of name, type and description."""
    if n_words < 12 * tools + 4:
        raise ValueError(f"--system-words {n_words} is too few for {tools} tools (at least {12 * tools + 4})")
    per_tool = (n_words - n_words // 6) // tools if tools else 0
    parts = [lines(vocab_words(n_words - per_tool * tools, 1), 24)]
    for k in range(tools):
        body = vocab_words(per_tool - 2, 200 + k)
        description, params = body[: len(body) // 3], body[len(body) // 3:]
        parts.append(" ".join(tool_name(k)) + "\n" + lines(description, 24) + "\n" + lines(params, 6, "  "))
    return "\n\n".join(parts)


def spread(lo: int, hi: int, session: int, turn: int, a: int, b: int) -> int:
    """A deterministic size in [lo, hi] that varies with session and turn; ``a`` and ``b`` large against the
    range's width, so the first few sessions and turns already cover it (small ones would keep them near ``lo``)."""
    return lo + (session * a + turn * b) % (hi - lo + 1)


def user_line(session: int, turn: int, sizes: tuple[int, int] = (10, 20)) -> str:
    return " ".join(vocab_words(spread(*sizes, session, turn, 5, 3), 2_000_000 + session * 1000 + turn))


class ToolRound(NamedTuple):
    """The scripted call that follows a reply and what the tool gave back."""

    id: str
    name: str        # the APIs' name: the tool's two words joined by "_"
    arguments: dict  # {"path": words, "query": words}
    result: str


def tool_round(session: int, turn: int, tools: int, sizes: tuple[int, int] = (300, 1500)) -> ToolRound:
    """Session ``session``'s call after turn ``turn`` (a tool of the system prompt) and its result: code-like short
    indented lines on even session + turn, prose otherwise."""
    k = (session * 3 + turn * 5) % max(tools, 1)
    salt = session * 1000 + turn
    path, query = (vocab_words(n, 3_000_000 + 10 * salt + j) for j, n in enumerate(CALL_ARGUMENT_WORDS))
    body = vocab_words(spread(*sizes, session, turn, 389, 577), 1_000_000 + salt)
    result = lines(body, 8, "    ") if (session + turn) % 2 == 0 else lines(body, 40)
    return ToolRound(f"toolu_{session:03d}_{turn:03d}", "_".join(tool_name(k)),
                     {"path": " ".join(path), "query": " ".join(query)}, result)


def call_text(call: ToolRound) -> str:
    """The call as plain text (``--tool-turns text``): the tool's name words, then the argument values."""
    return " ".join([call.name.replace("_", " "), call.arguments["path"], call.arguments["query"]])


SPECIAL_WORD = re.compile(r"(^|\s)<[^\s<>]+>(?=\s|$)")


def without_special(reply: str) -> str:
    """The reply without special-token words (``<unk>``, ``<s>``; with the whitespace before each), the rest as
    it came. Why: mlx_lm.server streams a generated special token's text, serve decodes with
    ``skip_special_tokens=True``; a history carrying the text as sent would differ between them after the first such
    token (the tiny model generates ``<unk>`` often), so every server's history carries the reply without them
    (``bench_mlx_lm_server.visible``'s rule, which compares replies)."""
    return SPECIAL_WORD.sub("", reply)


class Step(NamedTuple):
    """A finished turn: the user line that opened it, the model's reply, the tool round after it."""

    line: str
    reply: str  # as the history carries it: without special-token words
    tool: ToolRound


def assistant_text(step: Step) -> str:
    return f"{step.reply}\n\n{call_text(step.tool)}" if step.reply else call_text(step.tool)


# -- the two wire formats --------------------------------------------------------------------------------------------
def openai_messages(system: str, steps: list[Step], line: str, mode: str = "text") -> list[dict]:
    """The conversation as ``/v1/chat/completions`` messages: ``steps`` done, ``line`` the new user text."""
    out = [{"role": "system", "content": system}]
    pending: list[str] = []  # text mode: the last tool result opens the next user message
    for step in steps:
        out.append({"role": "user", "content": "\n\n".join(pending + [step.line])})
        pending = []
        if mode == "text":
            out.append({"role": "assistant", "content": assistant_text(step)})
            pending = [step.tool.result]
            continue
        call = {"id": step.tool.id, "type": "function",
                "function": {"name": step.tool.name, "arguments": json.dumps(step.tool.arguments)}}
        out.append({"role": "assistant", "content": step.reply, "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": step.tool.id, "content": step.tool.result})
    out.append({"role": "user", "content": "\n\n".join(pending + [line])})
    return out


def anthropic_messages(steps: list[Step], line: str, mode: str = "text") -> list[dict]:
    """The same conversation as ``/v1/messages`` messages (the system prompt goes in the body's ``system``). Text
    blocks of one message are joined with a blank line by serve, as ``openai_messages`` joins them."""
    out: list[dict] = []
    pending: list[dict] = []
    for step in steps:
        out.append({"role": "user", "content": pending + [{"type": "text", "text": step.line}]})
        if mode == "text":
            out.append({"role": "assistant", "content": [{"type": "text", "text": assistant_text(step)}]})
            pending = [{"type": "text", "text": step.tool.result}]
            continue
        said = [{"type": "text", "text": step.reply}] if step.reply else []
        use = {"type": "tool_use", "id": step.tool.id, "name": step.tool.name, "input": step.tool.arguments}
        out.append({"role": "assistant", "content": said + [use]})
        pending = [{"type": "tool_result", "tool_use_id": step.tool.id, "content": step.tool.result}]
    out.append({"role": "user", "content": pending + [{"type": "text", "text": line}]})
    return out


def anthropic_body(system: str, steps: list[Step], line: str, max_tokens: int, mode: str = "text",
                   cache_control: bool = True) -> dict:
    """A streaming, greedy ``/v1/messages`` body; ``cache_control``: breakpoints on the system prompt and the last
    block, where a coding agent puts them."""
    messages = anthropic_messages(steps, line, mode)
    block = {"type": "text", "text": system}
    if cache_control:
        block["cache_control"] = {"type": "ephemeral"}
        messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return {"model": base.MODEL_NAME, "system": [block], "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}


# -- the clients -----------------------------------------------------------------------------------------------------
def messages(port: int, body: dict) -> base.Reply:
    """One streaming ``/v1/messages`` request. TTFT: the first ``text_delta``; usage from ``message_delta`` (the
    final counts; ``message_start``'s as a fallback)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/messages", json.dumps(body),
              {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"port {port}: HTTP {r.status}: {r.read()[:300]!r}")
    ttft, parts, usage, tokens = None, [], {}, 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        event = json.loads(line[5:].strip())
        kind = event.get("type")
        if kind == "message_start":
            usage = event["message"].get("usage") or {}
        elif kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(event["delta"]["text"])
            tokens += 1
        elif kind == "message_delta":
            usage = event.get("usage") or usage
        elif kind == "error":
            raise SystemExit(f"port {port}: stream error {event}")
        elif kind == "message_stop":
            break
    end = time.perf_counter() - t0
    c.close()
    prompt = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
    return base.Reply(ttft if ttft is not None else end, "".join(parts), usage.get("cache_read_input_tokens"),
                      usage.get("output_tokens", tokens), end, prompt if usage else None)


def ask(kind: str, port: int, system: str, steps: list[Step], line: str, args) -> base.Reply:
    """One turn: serve through ``/v1/messages``, the mlx-lm servers through ``/v1/chat/completions``."""
    if kind == "serve":
        return messages(port, anthropic_body(system, steps, line, args.max_tokens, args.tool_turns,
                                             args.cache_control))
    return base.chat(port, openai_messages(system, steps, line, args.tool_turns), args.max_tokens)


# -- a server's run --------------------------------------------------------------------------------------------------
def run_sessions(kind: str, port: int, args, system: str) -> dict:
    """Every session's turns in order, ``--clients`` sessions at a time: {"replies": [session][turn] Reply,
    "steps": [session][turn] Step, "wall"}. Each server's histories hold its own replies (``without_special``)."""
    replies: list[list[base.Reply]] = [[] for _ in range(args.sessions)]
    steps: list[list[Step]] = [[] for _ in range(args.sessions)]

    def session(s):
        for t in range(args.turns):
            line = user_line(s, t, args.user_words)
            got = ask(kind, port, system, steps[s], line, args)
            steps[s].append(Step(line, without_special(got.text), tool_round(s, t, args.tools, args.tool_result_words)))
            replies[s].append(got)

    wall = base.pool(args.sessions, args.clients, session)
    return {"replies": replies, "steps": steps, "wall": wall}


def resume(kind: str, port: int, args, system: str, steps: list[list[Step]]) -> dict:
    """Each session's next turn (its whole history, the last tool result, a new user line) after the restart."""
    replies: list[base.Reply | None] = [None] * len(steps)

    def next_turn(s):
        replies[s] = ask(kind, port, system, steps[s], user_line(s, args.turns, args.user_words), args)

    wall = base.pool(len(steps), args.clients, next_turn)
    return {"replies": replies, "wall": wall}


def warmup_args(args) -> argparse.Namespace:
    """``args`` as the chat workload's ``warm_up`` reads them (its longest prompt is system + turns x (user words +
    reply)): "user words" is what a turn adds on average besides the reply (user line, call, tool result), and the
    restart turn counts."""
    grown = (sum(args.user_words) + sum(args.tool_result_words)) // 2 + sum(CALL_ARGUMENT_WORDS) + 2
    return argparse.Namespace(**{**vars(args), "user_words": grown, "turns": args.turns + 1})


def bench(kind: str, model: str, args, system: str, tmp: Path) -> dict:
    """One server: the turns, a restart on the same store, the next turns; summaries as the chat workload's."""
    warm = warmup_args(args)
    s = base.start(kind, model, tmp, "1", warm)
    try:
        turns, stages = base.staged(kind, s.port, lambda: run_sessions(kind, s.port, args, system))
    finally:
        s.stop()
    s = base.start(kind, model, tmp, "2", warm)
    try:
        after, restart_stages = base.staged(kind, s.port, lambda: resume(kind, s.port, args, system, turns["steps"]))
    finally:
        s.stop()
    replies = turns["replies"]
    per_turn = [[replies[c][t] for c in range(args.sessions)] for t in range(args.turns)]
    return {"turns": {t + 1: base.summary(v, None) for t, v in enumerate(per_turn)},
            "all_turns": base.summary([r for conv in replies for r in conv], turns["wall"]),
            "warm_turns": base.summary([r for conv in replies for r in conv[1:]], None),
            "after_restart": base.summary(after["replies"], after["wall"]),
            "texts": [[r.text for r in conv] for conv in replies],
            "texts_after_restart": [[r.text] for r in after["replies"]], "stages": stages,
            "stages_after_restart": restart_stages,
            "prompt_tokens": [[r.prompt_tokens for r in conv] for conv in replies],
            "prompt_tokens_after_restart": [r.prompt_tokens for r in after["replies"]],
            "cached_tokens": [[r.cached for r in conv] for conv in replies],
            "cached_tokens_after_restart": [r.cached for r in after["replies"]],
            "answered_warm": base.answered([r for conv in replies for r in conv[1:]]),
            "answered_after_restart": base.answered(after["replies"])}


# -- the report ------------------------------------------------------------------------------------------------------
def mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def prompt_tokens(results: dict, kinds: list[str]) -> dict:
    """Each server's mean prompt tokens per turn and after restart, and how many requests counted the same prompt
    tokens as the first server's (the check that every server saw the same prompt)."""
    first = kinds[0]
    per_turn = {t + 1: {k: mean(conv[t] for conv in results[k]["prompt_tokens"]) for k in kinds}
                for t in range(len(results[first]["prompt_tokens"][0]))}
    after = {k: mean(results[k]["prompt_tokens_after_restart"]) for k in kinds}
    equal = total = 0
    differences = []
    for k in kinds[1:]:
        rows = list(zip(results[first]["prompt_tokens"], results[k]["prompt_tokens"]))
        pairs = [(s, t + 1, a, b) for s, (ca, cb) in enumerate(rows) for t, (a, b) in enumerate(zip(ca, cb))]
        pairs += [(s, "after restart", a, b) for s, (a, b) in enumerate(
            zip(results[first]["prompt_tokens_after_restart"], results[k]["prompt_tokens_after_restart"]))]
        for s, t, a, b in pairs:
            total += 1
            equal += a is not None and a == b
            if a != b and len(differences) < 5:
                differences.append({"server": k, "session": s, "turn": t, first: a, k: b})
    return {"per_turn": per_turn, "after_restart": after, "equal": equal, "total": total,
            "all_equal": equal == total, "differences": differences}


def print_prompt_tokens(check: dict, kinds: list[str]) -> None:
    print(f"{'prompt tokens':<15}" + "".join(f"{base.LABELS[k] + ' mean':>30}" for k in kinds))
    rows = [(f"turn {t}", v) for t, v in check["per_turn"].items()] + [("after restart", check["after_restart"])]
    for name, by_kind in rows:
        print(f"{name:<15}" + "".join(f"{by_kind[k]:>30.1f}" for k in kinds))
    print(f"prompt tokens equal to {base.LABELS[kinds[0]]}'s: {check['equal']}/{check['total']} requests"
          + (f"; first differences {check['differences']}" if check["differences"] else ""))


def report(results: dict, kinds: list[str], args) -> dict:
    """The chat workload's report (its figures renamed ``agent_*``) and the prompt-token check."""
    title = (f"agent workload; model {args.model or 'tiny llama (spec_cache.testing.tiny)'}; {args.sessions} "
             f"sessions x {args.turns} turns, {args.clients} clients, system {args.system_words} words with "
             f"{args.tools} tools, tool results {args.tool_result_words[0]}-{args.tool_result_words[1]} words, "
             f"{args.max_tokens} tokens/reply, tool turns as {args.tool_turns}; serve on /v1/messages, the others "
             "on /v1/chat/completions")
    extra = base.report(results, kinds, args, title=title, warm_row=True)
    extra["figures"] = {f"agent_{name}": value for name, value in extra["figures"].items()}
    check = prompt_tokens(results, kinds)
    print_prompt_tokens(check, kinds)
    print(f"figures {json.dumps(extra['figures'])}")
    return {**extra, "prompt_tokens": check}


# -- the command -----------------------------------------------------------------------------------------------------
def longest_prompt(args) -> int:
    """An upper bound on the longest prompt in tokens (the restart turn's): words, a few template tokens a message,
    slack for the ``<unk>`` pieces of JSON punctuation under ``--tool-turns blocks``."""
    per_turn = args.user_words[1] + args.max_tokens + sum(CALL_ARGUMENT_WORDS) + 2 + args.tool_result_words[1] + 40
    return args.system_words + 8 + (args.turns + 1) * per_turn + args.max_tokens


def tiny_model(tmp: Path, args) -> str:
    """The tiny llama, its ``max_position_embeddings`` raised to fit the longest prompt (a power of two, at least
    the writer's 4096): serve takes the model's context from there and refuses longer prompts."""
    from spec_cache.testing.tiny import write_tiny_target

    path = write_tiny_target(tmp / "tiny")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max(4096, 2 ** math.ceil(math.log2(longest_prompt(args))))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(path)


def word_range(text: str) -> tuple[int, int]:
    """``LO-HI`` (or one number) as (lo, hi)."""
    lo, _, hi = text.partition("-")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO-HI with 1 <= LO <= HI")
    return low, high


def parse(argv=None, servers: str = "mlx-lm,serve,spec-cache"):
    p = argparse.ArgumentParser(prog="bench_serve.py --workload agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--servers", default=servers,
                   help=f"comma-separated, of {', '.join(base.KINDS)} (default {servers})")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--clients", type=int, default=4, help="sessions at a time")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-words", type=int, default=8000)
    p.add_argument("--tools", type=int, default=20, help="tool definitions in the system prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tool-result-words", type=word_range, default=(300, 1500), metavar="LO-HI")
    p.add_argument("--user-words", type=word_range, default=(10, 20), metavar="LO-HI", help="each user line")
    p.add_argument("--tool-turns", choices=("text", "blocks"), default="text",
                   help="tool calls and results as plain text (default) or as the APIs' tool blocks / messages")
    p.add_argument("--no-cache-control", dest="cache_control", action="store_false",
                   help="no cache_control breakpoints in serve's requests")
    base.add_server_options(p)
    args = base.server_options(p, p.parse_args(argv))
    if min(args.sessions, args.clients, args.turns, args.max_tokens) < 1:
        p.error("--sessions, --clients, --turns and --max-tokens must be at least 1")
    args.paired = False  # the chat report's and figures' switches
    args.conversations = args.sessions
    return args


def main(argv=None, servers: str = "mlx-lm,serve,spec-cache") -> int:
    args = parse(argv, servers)
    if args.cwd:
        base.REPO = Path(args.cwd)
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    done = False
    started = time.perf_counter()
    try:
        model = args.model or tiny_model(tmp, args)
        system = system_prompt(args.system_words, args.tools)
        results = {}
        for kind in args.kinds:
            t0 = time.perf_counter()
            results[kind] = bench(kind, model, args, system, tmp)
            results[kind]["bench_s"] = time.perf_counter() - t0
            print(f"{base.LABELS[kind]}: {results[kind]['bench_s']:.1f} s (both starts, turns, restart)", flush=True)
        done = True
    finally:
        if args.keep or not done:  # a failed run keeps its servers' logs for a look
            print(f"logs and stores: {tmp}" + ("" if done else " (kept: the run failed)"))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    extra = report(results, args.kinds, args)
    print(f"run took {time.perf_counter() - started:.1f} s")
    if args.json:
        out = {"args": {k: v for k, v in vars(args).items()}, "workload": "agent", **extra, **results}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
