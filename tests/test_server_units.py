"""spec-cache serve, the parts without a model: streaming detokenization, stop strings, request parsing and its
statuses, API keys and tenants."""

from __future__ import annotations

import pytest

from spec_cache.server.auth import Auth, salted_tenant
from spec_cache.server.detokenizer import StopMatcher, StreamingDetokenizer
from spec_cache.server.protocol import APIError, parse_chat, parse_completion


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
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, 422),
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
    for prompt, status in [([5, 256], 422), (["a", "b"], 422), ("", 422), (None, 400), ([True], 400)]:
        with pytest.raises(APIError) as info:
            parse_completion({"model": "tiny", "prompt": prompt}, MODELS, 256)
        assert info.value.status == status, prompt


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

    from spec_cache.server.cli import register

    parser = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=argparse.SUPPRESS)
    common.add_argument("--shared", default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command")
    register(sub, common)
    args = parser.parse_args(["serve", "--model", "m", "--cache", "c", "--max-rows", "2", "--api-key", "k",
                              "--api-key", "j"])
    assert (args.model, args.cache, args.max_rows, args.api_key, args.host) == ("m", "c", 2, ["k", "j"], "127.0.0.1")
    assert args.fn.__module__ == "spec_cache.server.cli"
    code = "import sys, spec_cache.server; assert 'mlx.core' not in sys.modules and 'starlette' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    out = subprocess.run([sys.executable, "-m", "spec_cache.server", "--model", "/does/not/exist"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
