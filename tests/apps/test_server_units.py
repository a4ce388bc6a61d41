"""spec-cache serve, the parts without a model: streaming detokenization, stop strings, request parsing and its
statuses, API keys and tenants."""

from __future__ import annotations

import pytest

from spec_cache.apps.server.auth import Auth, salted_tenant
from spec_cache.apps.server.detokenizer import StopMatcher, StreamingDetokenizer
from spec_cache.apps.server.protocol import APIError, PromptBatch, parse_chat, parse_completion


class ByteTokenizer:
    """Token i is the byte i: a multi-byte character spans several tokens (as byte-level BPE can)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streaming_detokenizer_never_splits_a_character():
    text = "añb€c😀 d"
    ids = list(text.encode("utf-8"))
    detok = StreamingDetokenizer(ByteTokenizer())
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "😀" in pieces  # the 4 bytes of the emoji came out as one piece, once complete
    # in several tokens at a time too
    detok = StreamingDetokenizer(ByteTokenizer())
    assert "".join([detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]) == text


def test_streaming_detokenizer_flushes_an_incomplete_tail():
    detok = StreamingDetokenizer(ByteTokenizer())
    assert detok.add(list("ok".encode()) + [0xE2, 0x82]) == "ok"
    assert detok.flush() == "\ufffd"  # generation ended inside a character: what the bytes hold


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_stop():
    matcher = StopMatcher(["END", "\n\n"])
    assert matcher.feed("hello E") == ("hello ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("Xtra") == ("ENXtra", False)
    assert matcher.feed(" and EN") == (" and ", False)
    assert matcher.feed("D more") == ("", True)
    assert matcher.feed("anything") == ("", True) and matcher.flush() == ""
    other = StopMatcher(["\n\n"])
    assert other.feed("a\n") == ("a", False) and other.flush() == "\n"
    assert StopMatcher([]).feed("x") == ("x", False)


MODELS = ("tiny",)


@pytest.mark.parametrize("body,status", [
    ([], 400), ({"messages": [{"role": "user", "content": "x"}]}, 400),  # no model
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
    ({"model": "tiny"}, 400), ({"model": "tiny", "messages": []}, 400),
    ({"model": "tiny", "messages": ["x"]}, 400),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, 422),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": 3}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": True}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "ignore_eos": 1}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 422),
])
def test_chat_requests_get_the_right_status(body, status):
    with pytest.raises(APIError) as info:
        parse_chat(body, MODELS)
    assert info.value.status == status
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_a_good_chat_request_parses():
    params, messages = parse_chat({
        "model": "tiny", "messages": [{"role": "developer", "content": "a"},
                                      {"role": "user", "content": [{"type": "text", "text": "b"},
                                                                   {"type": "text", "text": "c"}]}],
        "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x", "stream": True,
        "stream_options": {"include_usage": True}, "cache_salt": "s", "ignore_eos": True}, MODELS)
    assert messages == [{"role": "system", "content": "a"}, {"role": "user", "content": "bc"}]
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop) == (7, 0.0, 0.5, 3, ["x"])
    assert params.stream and params.include_usage and params.cache_salt == "s" and params.ignore_eos
    defaults, _ = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, MODELS)
    assert defaults.temperature is None and defaults.max_tokens is None and not defaults.stream


def test_completion_prompts():
    assert parse_completion({"model": "tiny", "prompt": "w5 w6"}, MODELS, 256)[1] == "w5 w6"
    assert parse_completion({"model": "tiny", "prompt": [5, 6]}, MODELS, 256)[1] == [5, 6]
    assert parse_completion({"model": "tiny", "prompt": ["w5"]}, MODELS, 256)[1] == "w5"
    params, batch = parse_completion({"model": "tiny", "prompt": ["w5", [5, 6]], "n": 2}, MODELS, 256)
    assert isinstance(batch, PromptBatch) and list(batch) == ["w5", [5, 6]] and params.n == 2
    params, batch = parse_completion({"model": "tiny", "prompt": ["a", "b"], "stream": True}, MODELS, 256)
    assert isinstance(batch, PromptBatch) and params.stream  # streamed with each chunk's index (issue 36)
    for body, status in [({"prompt": [5, 256]}, 422), ({"prompt": ["a", ""]}, 422), ({"prompt": ""}, 422),
                         ({"prompt": None}, 400), ({"prompt": [True]}, 400), ({"prompt": ["a", [5, 999]]}, 422),
                         ({"prompt": ["a"] * 9, "n": 2}, 422)]:
        with pytest.raises(APIError) as info:
            parse_completion({"model": "tiny", **body}, MODELS, 256)
        assert info.value.status == status, body


def test_api_keys_and_tenants():
    auth = Auth(["key-a", "key-b"])
    a, b = auth.check("Bearer key-a"), auth.check("bearer key-b")
    assert a != b and a.startswith("key:") and "key-a" not in a
    for header in (None, "", "Bearer", "Bearer key-c", "Basic key-a", "Bearer key-a2", "key-a"):
        with pytest.raises(APIError) as info:
            auth.check(header)
        assert info.value.status == 401
    assert Auth().check(None) is None and not Auth().enabled
    assert salted_tenant(a, None) == a
    assert len({salted_tenant(a, "s"), salted_tenant(a, "t"), salted_tenant(b, "s"), salted_tenant(None, "s"), a}) == 5


def test_serve_registers_under_the_main_cli_without_loading_mlx():
    import argparse
    import subprocess
    import sys

    from spec_cache.apps.server.cli import register

    parser = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=argparse.SUPPRESS)
    common.add_argument("--shared", default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command")
    register(sub, common)
    args = parser.parse_args(["serve", "--model", "m", "--cache", "c", "--max-rows", "2", "--api-key", "k",
                              "--api-key", "j"])
    assert (args.model, args.cache, args.max_rows, args.api_key, args.host) == ("m", "c", 2, ["k", "j"], "127.0.0.1")
    assert args.fn.__module__ == "spec_cache.apps.server.cli"
    code = "import sys, spec_cache.apps.server; assert 'mlx.core' not in sys.modules and 'starlette' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    out = subprocess.run([sys.executable, "-m", "spec_cache.apps.server", "--model", "/does/not/exist"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr


# -- hardening: logs, descriptor limits, viewers, tokenizing off the event loop ----------------------------------
def test_rate_limited_logs_pass_one_record_per_cause_per_interval(monkeypatch):
    import logging

    from spec_cache.apps.server import logs

    clock = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    limiter = logs.RateLimitFilter(interval_s=10)

    def record(msg, level=logging.ERROR, exc=None, name="asyncio"):
        info = (exc, exc("x"), None) if exc else None
        return logging.LogRecord(name, level, __file__, 1, msg, (), info)

    passed = [limiter.filter(record("socket.accept() out of system resource\nsocket: fd=6", exc=OSError))
              for _ in range(2000)]
    assert passed.count(True) == 1 and limiter.suppressed == 1999
    assert limiter.filter(record("another cause"))  # a different cause has its own budget
    assert limiter.filter(record("info passes", level=logging.INFO))
    clock[0] += 10
    again = record("socket.accept() out of system resource\nsocket: fd=6", exc=OSError)
    assert limiter.filter(again) and "1999 more like this suppressed" in again.getMessage()


def test_a_storm_that_stops_is_still_counted(monkeypatch, caplog):
    import logging

    from spec_cache.apps.server import logs

    clock = [0.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    limiter = logs.RateLimitFilter(interval_s=5)
    for _ in range(50):
        limiter.filter(logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, "Invalid HTTP request", (),
                                         None))
    clock[0] += 6
    with caplog.at_level(logging.WARNING):
        limiter.flush()
    assert "49 more like this suppressed in the last 5s: Invalid HTTP request" in caplog.text


def test_the_connection_budget_fits_the_descriptor_limit():
    from spec_cache.apps.server.limits import connection_budget

    for soft in (256, 1024, 2048, 4096, 65536, 1 << 20):
        cap, backlog = connection_budget(soft)
        assert 8 <= cap <= 8192 and cap + 3 * backlog + 64 + soft // 16 <= soft
    assert connection_budget(1024, 100) == (100, connection_budget(1024)[1])
    assert connection_budget(1024, 5000)[0] == connection_budget(1024)[0]  # lowered to what fits
    with pytest.raises(ValueError):
        connection_budget(64)


def test_mlx_lm_setrlimit_neither_fails_nor_lowers_the_limit(monkeypatch):
    import resource

    from spec_cache.apps.server import limits

    state = {"limit": (1024, 1024)}

    def real(which, value):  # a container: the hard limit may not be raised
        if value[1] > state["limit"][1]:
            raise ValueError("not allowed to raise maximum limit")
        state["limit"] = tuple(value)

    monkeypatch.setattr(limits.resource, "getrlimit", lambda which: state["limit"])
    tolerant = limits._tolerant_setrlimit(real)
    tolerant(resource.RLIMIT_NOFILE, (2048, 4096))  # what mlx_lm.utils does at import
    assert state["limit"] == (1024, 1024)
    state["limit"] = (1024, 8192)
    tolerant(resource.RLIMIT_NOFILE, (2048, 4096))
    assert state["limit"] == (2048, 8192)  # raised to what mlx-lm wants, hard limit kept
    state["limit"] = (20000, 20000)
    tolerant(resource.RLIMIT_NOFILE, (2048, 4096))
    assert state["limit"] == (20000, 20000)  # never lowered


def test_viewers_of_health_and_metrics():
    from spec_cache.apps.server.auth import tenant_label

    open_server = Auth()
    assert open_server.viewer(None).operator  # no key configured: open (documented)
    auth = Auth(["key-a", "key-b"], operator_keys=["op"])
    assert auth.viewer("Bearer op").operator and not auth.viewer(None).known
    assert not auth.viewer("Bearer nope").known
    a = auth.viewer("Bearer key-a")
    assert not a.operator and a.tenant == tenant_label(auth.check("Bearer key-a")) != auth.viewer("Bearer key-b").tenant
    only_operator = Auth([], operator_keys=["op"])
    assert only_operator.check(None) is None and not only_operator.viewer(None).known
    assert tenant_label(None) == "open" and tenant_label(salted_tenant(auth.check("Bearer key-a"), "s")) == a.tenant


def test_metrics_render_only_the_viewers_tenant():
    from spec_cache.apps.server.auth import Viewer
    from spec_cache.apps.server.metrics import Metrics

    metrics = Metrics()
    metrics.account("aaaa1111", 10, 0, 5)
    metrics.account("bbbb2222", 20, 256, 7)
    mine = metrics.render(Viewer(tenant="aaaa1111")).decode()
    assert 'tenant="aaaa1111"' in mine and "bbbb2222" not in mine and "spec_cache_queue" not in mine
    assert "spec_cache_requests_total" not in mine
    everything = metrics.render(Viewer(operator=True)).decode()
    assert "aaaa1111" in everything and "bbbb2222" in everything and "spec_cache_prompt_cache_hit_ratio" in everything
    assert metrics.render(Viewer()) == b""


def test_tokenizing_runs_off_the_event_loop_and_big_bodies_get_413():
    import threading
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from spec_cache.apps.server.app import ServerConfig, ServerState, create_app, default_max_body_bytes

    threads = {}

    class Tokenizer:
        def encode(self, text):
            threads["encode"] = threading.get_ident()
            return [5] * len(text.split())

        def apply_chat_template(self, messages, **kw):
            threads["chat"] = threading.get_ident()
            return [5, 6]

        def decode(self, ids, skip_special_tokens=True):
            return ""

    class Scheduler:
        error, queue_depth, active_rows, arriving, arrival_waits, first_token_waits = None, 0, 0, 0, 0, 0

        def start(self):
            pass

        def arrival(self):  # the routes open one per generation request (``scheduler.Arrival``)
            return SimpleNamespace(done=lambda: None)

        def stop(self, timeout):
            pass

        def cancel(self, job):
            pass

        def submit(self, job):
            threads["loop"] = threading.get_ident()  # handlers submit from the event loop
            job.deliver(("start", 300))
            job.deliver(("done", "length", 0))

    generator = SimpleNamespace(engine=SimpleNamespace(target=SimpleNamespace(vocab_size=256)), cache=None)
    config = ServerConfig("tiny", context_tokens=1024, cached_tokens_granularity=256)
    assert config.max_body_bytes == default_max_body_bytes(1024) == 1024 * 16 + (64 << 10)
    state = ServerState(generator=generator, tokenizer=Tokenizer(), scheduler=Scheduler(), config=config)
    with TestClient(create_app(state)) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        assert client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 3}).status_code == 200
        assert threads["encode"] != threads["loop"] and threads["chat"] != threads["loop"]
        big = client.post("/v1/completions", json={"model": "tiny", "prompt": "w5 " * 40000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert client.get("/health").json() == {"status": "ok", "model": "tiny", "active_rows": 0,
                                                "queue_depth": 0}  # no key configured: open


def test_serve_passes_the_store_and_shared_tier_options_to_the_cache(monkeypatch, tmp_path):
    """--tenant-share/--tenant-quota/--durability/--on-damaged-store and the shared-tier flags reach SpecCache.open;
    out-of-range values are usage errors, not tracebacks."""
    import subprocess
    import sys

    from spec_cache.apps.cli import build_parser
    from spec_cache.apps.server.cli import build_state
    from spec_cache.tiers.cache import SpecCache

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    secret = tmp_path / "fleet.key"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    seen = {}

    class Opened(Exception):
        pass

    def fake_open(path, **kwargs):
        seen.update(kwargs, path=path)
        raise Opened

    monkeypatch.setattr(SpecCache, "open", staticmethod(fake_open))
    args = build_parser().parse_args([
        "--cache", str(tmp_path / "store"), "--shared", "redis://127.0.0.1:1/0", "--shared-secret-file", str(secret),
        "serve", "--model", str(model), "--max-bytes", "1GiB", "--tenant-share", "0.25", "--tenant-quota", "64MiB",
        "--durability", "sync", "--on-damaged-store", "refuse", "--shared-budget", "0.2"])
    with pytest.raises(Opened):
        build_state(args)
    assert seen["max_bytes"] == 1 << 30 and seen["tenant_share"] == 0.25 and seen["tenant_quota_bytes"] == 64 << 20
    assert seen["durability"] == "sync" and seen["on_damage"] == "refuse" and seen["shared"] == "redis://127.0.0.1:1/0"
    assert seen["shared_options"] == {"secret_file": str(secret), "lookup_budget_s": 0.2}
    trusted = build_parser().parse_args(["--shared-trusted-network", "serve", "--model", str(model)])
    assert trusted.shared_trusted_network is True
    for bad in (["--tenant-share", "1.5"], ["--tenant-share", "x"], ["--shared-budget", "0"],
                ["--durability", "maybe"]):
        out = subprocess.run([sys.executable, "-m", "spec_cache", "serve", "--model", str(model), *bad],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (bad, out.stderr)


@pytest.mark.parametrize("given,host,keys,shared,want", [
    (None, "127.0.0.1", 0, False, 1), (None, "127.0.0.1", 1, False, 1), (None, "::1", 1, False, 1),
    (None, "localhost", 0, False, 1), (None, "127.0.0.2", 0, False, 1),  # loopback, one user at most: exact
    (None, "127.0.0.1", 2, False, 256), (None, "0.0.0.0", 0, False, 256), (None, "::", 1, False, 256),
    (None, "10.1.2.3", 1, False, 256), (None, "myhost.local", 0, False, 256),  # several keys, reachable: chunk
    (None, "127.0.0.1", 1, True, 256),  # a shared tier holds other hosts' prompts
    (1, "0.0.0.0", 5, True, 1), ("chunk", "127.0.0.1", 0, False, 256), (64, "127.0.0.1", 0, False, 64),  # given
])
def test_granularity_default_follows_where_the_server_listens(given, host, keys, shared, want):
    """Issue 36 (first hour, item 1): ``cached_tokens`` read 0, 0, 0 over a chat because the default rounded them to
    256; exact counts only open prompt probing where someone else's prompts share the namespace. An explicit
    ``--cached-tokens-granularity`` always wins; the reason is one line for the startup log."""
    from spec_cache.apps.server.cli import cached_tokens_granularity

    granularity, why = cached_tokens_granularity(given, host, keys, 256, shared=shared)
    assert granularity == want and why and "\n" not in why
    assert ("--cached-tokens-granularity" in why) and (why.startswith("default") == (given is None))


def test_the_granularity_option_defaults_to_the_decision():
    import argparse

    from spec_cache.apps.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).cached_tokens_granularity is None  # decided at start (above)
    assert parser.parse_args(["--model", "m", "--cached-tokens-granularity", "chunk"]).cached_tokens_granularity == \
        "chunk"
    assert parser.parse_args(["--model", "m", "--cached-tokens-granularity", "8"]).cached_tokens_granularity == 8


def test_top_k_and_min_p_reach_the_row_sampling():
    for params in (parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 7,
                               "min_p": 0.2}, MODELS)[0],
                   parse_completion({"model": "tiny", "prompt": "x", "top_k": 7, "min_p": 0.2}, MODELS, 256)[0]):
        assert (params.top_k, params.min_p) == (7, 0.2)
    assert parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": -1},
                      MODELS)[0].top_k == 0  # <= 0: off, as OpenAI-compatible servers read it


def test_top_k_and_min_p_values_are_checked():
    for bad, status in (({"top_k": 1.5}, 400), ({"top_k": True}, 400), ({"min_p": -0.1}, 422), ({"min_p": 1.5}, 422),
                        ({"min_p": "x"}, 400)):
        with pytest.raises(APIError) as info:
            parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], **bad}, MODELS)
        assert info.value.status == status and info.value.param == next(iter(bad)), bad
