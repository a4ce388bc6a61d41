"""``SpecCachePromptCache`` (the drop-in for mlx-lm's ``LRUPromptCache``) and ``spec-cache mlx-lm-server``.

Unit tests drive the drop-in as ``mlx_lm.server`` does (``fetch_nearest_cache`` -> prefill the rest ->
``insert_cache``) with a tiny float32 model, and compare greedy tokens with a run without any cache. The server
tests start real processes on 127.0.0.1 (``python -m spec_cache.apps.mlx_lm_server`` and ``mlx_lm.server`` itself),
drive ``/v1/completions`` over raw HTTP, SIGKILL the server and restart it on the same store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import mlx.core as mx
import pytest

from spec_cache.convert.mlx_lm_cache import SpecCachePromptCache, kv_options_from_args
from spec_cache.naming.namespace import KVOptions
from spec_cache.testing.tiny import write_tiny_target
from spec_cache.tiers.cache import SpecCache

REPO = Path(__file__).resolve().parents[2]
PROMPT_WORDS = 300
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("mlx-lm-server") / "tiny")


@pytest.fixture(scope="module")
def loaded(model_dir):
    from mlx_lm import load

    return load(str(model_dir))


def _prompt_text(n: int = PROMPT_WORDS, salt: int = 0) -> str:
    return " ".join(f"w{(i * 7 + salt) % 200 + 3}" for i in range(n))


def _greedy(loaded, tokens, max_tokens=MAX_TOKENS, cache=None):
    """Greedy tokens from ``tokens`` (``cache`` covers a prefix of them; the rest is prefilled)."""
    from mlx_lm import stream_generate

    model, tok = loaded
    return [g.token for g in stream_generate(model, tok, mx.array(tokens), max_tokens=max_tokens,
                                             prompt_cache=cache)]


def _serve(prompt_cache, loaded, key, tokens, max_tokens=MAX_TOKENS, **kv):
    """One request the way ``mlx_lm.server._serve_single`` makes it: fetch, prefill the rest, generate, insert
    (``kv``: its kv_bits / kv_group_size / quantized_kv_start). Returns (generated tokens, cached prompt tokens)."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = loaded
    cache, rest = prompt_cache.fetch_nearest_cache(key, list(tokens))
    cached = len(tokens) - len(rest)
    if cache is None:
        cache = make_prompt_cache(model)
    out = []
    for g in stream_generate(model, tok, mx.array(rest), max_tokens=max_tokens, prompt_cache=cache, **kv):
        out.append(g.token)
    prompt_cache.insert_cache(key, list(tokens) + out, cache)
    return out, cached


def _state(caches):
    return [mx.array(a) for c in caches for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
            if isinstance(a, mx.array)]


@pytest.fixture
def open_cache(tmp_path):
    opened = []

    def _open(**kwargs):
        kwargs.setdefault("memory_bytes", 64 << 20)
        c = SpecCache.open(tmp_path / "store", **kwargs)
        opened.append(c)
        return c

    yield _open
    for c in opened:
        c.close()


# --- the drop-in, in process ------------------------------------------------------------------------------------

def test_round_trip_matches_cold_and_own_cache(loaded, model_dir, open_cache):
    """Turn 1 cold, turn 2 (same prompt + continuation) from our cache and from mlx-lm's LRUPromptCache: the
    greedy tokens equal a run without a cache, and the cached counts equal mlx-lm's."""
    from mlx_lm.models.cache import LRUPromptCache

    _, tok = loaded
    key = (str(model_dir), None, None)
    ours = SpecCachePromptCache(cache=open_cache())
    theirs = LRUPromptCache()
    prompt = tok.encode(_prompt_text())
    first, cached = _serve(ours, loaded, key, prompt)
    assert cached == 0 and first == _greedy(loaded, prompt)
    assert _serve(theirs, loaded, key, prompt)[0] == first
    turn2 = prompt + first + tok.encode(" w5 w6 w7 w8")
    cold = _greedy(loaded, turn2)
    got, cached = _serve(ours, loaded, key, turn2)
    got_theirs, cached_theirs = _serve(theirs, loaded, key, turn2)
    assert got == cold == got_theirs
    assert cached == cached_theirs == len(prompt) + len(first)
    # an exact repeat: at least one token is left to prefill (generate_step refuses an empty prompt)
    again, cached = _serve(ours, loaded, key, turn2)
    assert again == cold and cached == len(turn2) - 1


def test_returned_cache_mutation_never_changes_stored_state(loaded, model_dir, open_cache):
    _, tok = loaded
    key = (str(model_dir), None, None)
    pc = SpecCachePromptCache(cache=open_cache())
    prompt = tok.encode(_prompt_text(200))
    _serve(pc, loaded, key, prompt)
    query = prompt + tok.encode(" w9 w10")
    cache, rest = pc.fetch_nearest_cache(key, query)
    before = [mx.array(a) for a in _state(cache)]
    _greedy(loaded, rest, 20, cache=cache)  # the server prefills into it and decodes 20 tokens
    for c in cache:
        c.trim(5)
    again, rest2 = pc.fetch_nearest_cache(key, query)
    assert rest2 == rest and all(mx.array_equal(a, b).item() for a, b in zip(before, _state(again)))


def test_store_serves_after_reopen_with_chunk_and_exact_prefixes(loaded, model_dir, open_cache):
    """A new process (new SpecCache, empty memory tier) restores from LMDB: the whole stored sequence, or the
    chunk boundary (256 tokens) below a divergence; greedy continuations equal a cold run."""
    _, tok = loaded
    key = (str(model_dir), None, None)
    first = open_cache()
    pc = SpecCachePromptCache(cache=first)
    prompt = tok.encode(_prompt_text())
    out, _ = _serve(pc, loaded, key, prompt)
    assert pc.drain(10)
    first.close()
    pc2 = SpecCachePromptCache(cache=open_cache(memory_bytes=0))
    same = prompt + out + tok.encode(" w11")
    got, cached = _serve(pc2, loaded, key, same)
    assert cached == len(prompt) + len(out) and pc2.last_hit_tier == "local"
    assert got == _greedy(loaded, same)
    diverged = prompt[:270] + tok.encode(" w12 w13 w14")
    got, cached = _serve(pc2, loaded, key, diverged)
    assert cached == 256 and got == _greedy(loaded, diverged)


def test_namespace_follows_model_identity_and_kv_options(loaded, model_dir, tmp_path, open_cache):
    import argparse
    import shutil

    cache = open_cache()
    plain = SpecCachePromptCache(cache=cache)
    quant = SpecCachePromptCache(cache=cache, kv_options=kv_options_from_args(
        argparse.Namespace(kv_bits=8, kv_group_size=64, quantized_kv_start=0)))
    assert kv_options_from_args(argparse.Namespace(kv_bits=None)) == KVOptions()
    key = (str(model_dir), None, None)
    assert plain.namespace_for(key) != quant.namespace_for(key)
    copy = tmp_path / "renamed"
    shutil.copytree(model_dir, copy)  # the same files elsewhere: the same artifact, the same namespace
    assert plain.namespace_for((str(copy), None, None)) == plain.namespace_for(key)
    _, tok = loaded
    _serve(plain, loaded, key, tok.encode(_prompt_text(40)))
    cache_q, rest = quant.fetch_nearest_cache(key, tok.encode(_prompt_text(40)) + [5])
    assert cache_q is None  # stored under the plain namespace only


def test_quantized_kv_matches_mlx_lm_own_cache(loaded, model_dir, open_cache):
    """``--kv-bits 8``: the server's QuantizedKVCache is stored and restored; turn 2 equals the same turn served
    from mlx-lm's own LRUPromptCache (quantized state is not bit-equal to a cold run in either)."""
    import argparse

    from mlx_lm.models.cache import LRUPromptCache, QuantizedKVCache

    _, tok = loaded
    kv = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    key = (str(model_dir), None, None)
    ours = SpecCachePromptCache(cache=open_cache(), kv_options=kv_options_from_args(argparse.Namespace(**kv)))
    theirs = LRUPromptCache()
    prompt = tok.encode(_prompt_text(120))
    first, _ = _serve(ours, loaded, key, prompt, **kv)
    assert _serve(theirs, loaded, key, prompt, **kv)[0] == first
    turn2 = prompt + first + tok.encode(" w30 w31")
    got, cached = _serve(ours, loaded, key, turn2, **kv)
    assert (got, cached) == _serve(theirs, loaded, key, turn2, **kv) and cached == len(prompt) + len(first)
    assert all(isinstance(c, QuantizedKVCache) for c in ours.fetch_nearest_cache(key, turn2 + got)[0])


def test_shared_tier_serves_another_host(loaded, model_dir, redis_server, tmp_path):
    """Two servers with their own LMDB stores and one Redis/Valkey: host B restores what host A served."""
    _, tok = loaded
    key = (str(model_dir), None, None)
    prompt = tok.encode(_prompt_text(100))
    fleet = {"secret": "test fleet secret 0123456789abcdef"}  # both hosts of the fleet hold it
    a = SpecCachePromptCache(cache=SpecCache.open(tmp_path / "a", shared=redis_server.url, shared_options=fleet),
                             owns_cache=True)
    b = SpecCachePromptCache(cache=SpecCache.open(tmp_path / "b", shared=redis_server.url, memory_bytes=0,
                                                  shared_options=fleet), owns_cache=True)
    try:
        first, _ = _serve(a, loaded, key, prompt)
        assert a.drain(20)
        turn2 = prompt + first + tok.encode(" w40")
        got, cached = _serve(b, loaded, key, turn2)
        assert b.last_hit_tier == "shared" and cached == len(prompt) + len(first)
        assert got == _greedy(loaded, turn2)
    finally:
        a.close()
        b.close()


def test_other_cache_kinds_fall_back_to_ram_with_one_warning(loaded, model_dir, open_cache):
    from mlx_lm.models.cache import ChunkedKVCache

    model, tok = loaded
    pc = SpecCachePromptCache(cache=open_cache())
    key = (str(model_dir), None, None)
    tokens = tok.encode(_prompt_text(30))
    caches = [ChunkedKVCache(chunk_size=64) for _ in model.layers]
    model(mx.array(tokens)[None], cache=caches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pc.insert_cache(key, tokens, caches)
        pc.insert_cache(key, tokens + [7], caches)
    assert sum("cannot be stored" in str(w.message) for w in caught) == 1
    assert pc.cache.memory.stats()["entries"] == 0 and len(pc._lru) == 1  # mlx-lm drops trimmable prefixes
    got, rest = pc.fetch_nearest_cache(key, tokens + [7, 8])
    assert isinstance(got[0], ChunkedKVCache) and rest == [8]
    assert got[0] is not caches[0]  # mlx-lm's deep copy


def test_unidentifiable_model_and_vision_keys_fall_back(loaded, model_dir, open_cache, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = loaded
    pc = SpecCachePromptCache(cache=open_cache())
    missing = (str(tmp_path / "no-such-model"), None, None)
    tokens = tok.encode(_prompt_text(20))
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pc.insert_cache(missing, tokens, caches)
    assert pc.fetch_nearest_cache(missing, tokens + [4])[1] == [4]
    pc.insert_cache((str(model_dir), None, None), [*tokens[:-1], "image-hash"], caches)  # not token ids
    assert pc.counters["fallback_inserts"] == 2 and pc.cache.memory.stats()["entries"] == 0


def test_rotating_kv_cache_model_round_trip(tmp_path, open_cache):
    """gemma3 with a sliding window: RotatingKVCache layers are stored exact-length and continue exactly."""
    from mlx_lm import load
    from mlx_lm.models.cache import RotatingKVCache

    gemma_dir = write_tiny_target(tmp_path / "gemma", arch="gemma3_text", sliding_window=16)
    g = load(str(gemma_dir))
    _, tok = g
    key = (str(gemma_dir), None, None)
    pc = SpecCachePromptCache(cache=open_cache())
    prompt = tok.encode(_prompt_text(60))
    out, _ = _serve(pc, g, key, prompt)
    turn2 = prompt + out + tok.encode(" w3 w4")
    got, cached = _serve(pc, g, key, turn2)
    assert cached == len(prompt) + len(out) and got == _greedy(g, turn2)
    assert any(isinstance(c, RotatingKVCache) for c in pc.fetch_nearest_cache(key, turn2 + got)[0])


def test_cli_registration_is_mlx_free_and_passes_the_command_line_through():
    """``add_arguments`` (what ``spec-cache mlx-lm-server`` registers) imports nothing of MLX and hands the
    command line to ``main`` verbatim; ``add_full_arguments`` parses mlx-lm's own options."""
    import argparse

    from spec_cache.apps.mlx_lm_server import _cli_main, _split, add_full_arguments, register

    code = ("import argparse, sys\nfrom spec_cache.apps import mlx_lm_server as m\n"
            "p = argparse.ArgumentParser(); m.register(p.add_subparsers())\n"
            "print('mlx' in sys.modules, 'mlx_lm' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", default=argparse.SUPPRESS)
    cli = argparse.ArgumentParser(parents=[common])
    register(cli.add_subparsers(dest="command"), common)
    argv = ["--model", "m", "--port", "9", "--memory-bytes", "1MiB", "--shared", "redis://x", "-h"]
    args = cli.parse_args(["--cache", "/s", "mlx-lm-server", *argv])
    assert (args.cache, args.mlx_lm_args, args.fn) == ("/s", argv, _cli_main)
    ours, rest = _split(argv)
    assert (ours.memory_bytes, ours.shared, rest) == (1 << 20, "redis://x", ["--model", "m", "--port", "9", "-h"])
    full = add_full_arguments(argparse.ArgumentParser())
    args = full.parse_args(["--model", "m", "--cache", "/s", "--kv-bits", "4", "--memory-bytes", "1MiB"])
    assert (args.model, args.cache, args.kv_bits, args.memory_bytes, args.port) == ("m", "/s", 4, 1 << 20, 8080)


@pytest.mark.parametrize("entry", [["spec_cache.apps.mlx_lm_server"], ["spec_cache", "mlx-lm-server"]])
def test_a_model_mlx_lm_cannot_load_is_one_line_and_exit_2_before_anything_starts(entry, tmp_path):
    """Issue 36 (first hour, item 5): ``--model FILE.gguf`` (``serve`` takes one) made mlx-lm's generation thread
    die while the server went on listening and answered 404: now one line naming the fix, exit 2, no store opened
    and no port bound. A missing local directory likewise (mlx-lm would try it as a Hub repo)."""
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    port = _free_port()
    for model, says in ((gguf, f"spec-cache convert-gguf {gguf} DIR"), (tmp_path / "missing", "does not exist")):
        out = subprocess.run([sys.executable, "-m", *entry, "--cache", str(tmp_path / "store"), "--model", str(model),
                              "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in out.stderr, out.stderr
        assert lines[0].startswith("spec-cache mlx-lm-server: error: --model ")
        assert not (tmp_path / "store").exists()


# --- real servers ------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv, log: Path):
        self.port = _free_port()
        self.log = log
        self._out = open(log, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", *argv, "--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout=90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise AssertionError(f"server not ready:\n{self.log.read_text()[-3000:]}")

    def complete(self, prompt: str, max_tokens=MAX_TOKENS) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            d = json.loads(r.read())
        return {"text": d["choices"][0]["text"], "ids": [c["id"] for c in d["choices"][0]["logprobs"]["content"]],
                "cached": d["usage"].get("prompt_tokens_details", {}).get("cached_tokens")}

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode


def _store_stats(path) -> dict:
    out = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(path), "stats", "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait_stored(path, entries: int, timeout=20.0) -> dict:
    from spec_cache.store import Store
    from spec_cache.store.maintenance import stats

    deadline = time.monotonic() + timeout
    while True:
        store = Store.open(path)
        try:
            s = stats(store)
        finally:
            store.close()
        if s["entries"] >= entries or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def test_server_restart_serves_the_prefix_from_the_store(loaded, model_dir, tmp_path):
    """``spec_cache.apps.mlx_lm_server`` vs ``mlx_lm.server``: the same greedy tokens, equal to a plain generate;
    after a SIGKILL and a restart on the same store the prefix comes from the store (cached tokens reported by
    the server, a hit in the store's counters) and the output still equals a cold run."""
    _, tok = loaded
    store = tmp_path / "store"
    ours = Server(["spec_cache.apps.mlx_lm_server", "--model", str(model_dir), "--cache", str(store),
                   "--memory-bytes", "64MiB"], tmp_path / "ours.log")
    plain = Server(["mlx_lm.server", "--model", str(model_dir)], tmp_path / "plain.log")
    servers = [ours, plain]
    try:
        ours.wait_ready()
        plain.wait_ready()
        prompt = _prompt_text()
        cold = _greedy(loaded, tok.encode(prompt))
        a, b = ours.complete(prompt), plain.complete(prompt)
        assert a["ids"] == b["ids"] == cold and a["text"] == b["text"] and a["cached"] == 0
        plain.stop()
        stored = _wait_stored(store, 1)
        assert stored["entries"] >= 1, stored  # written behind the request; durable before the kill
        ours.stop(signal.SIGKILL)
        assert ours.proc.returncode == -signal.SIGKILL

        again = Server(["spec_cache.apps.mlx_lm_server", "--model", str(model_dir), "--cache", str(store)],
                       tmp_path / "again.log")
        servers.append(again)
        again.wait_ready()
        turn2 = prompt + " " + a["text"].strip() + " w21 w22 w23"
        cold2 = _greedy(loaded, tok.encode(turn2))
        r = again.complete(turn2)
        assert r["ids"] == cold2
        assert r["cached"] >= len(tok.encode(prompt)), (r, again.log.read_text()[-2000:])  # only the store had it
        r = again.complete(prompt)
        assert r["ids"] == cold and r["cached"] == len(tok.encode(prompt)) - 1
        code = again.stop(signal.SIGTERM, timeout=60)
        assert code == 0, again.log.read_text()[-3000:]  # graceful: drains the cache, flushes the counters
        stats = _store_stats(store)
        assert stats["hits"] >= 1, stats  # the restart's lookup (the repeat is a memory-tier hit)
    finally:
        for s in servers:
            s.stop(signal.SIGKILL)


def test_models_route_and_the_served_models_own_name_need_no_hub(loaded, model_dir, tmp_path, monkeypatch):
    """With no Hugging Face cache at all, ``GET /v1/models`` is a JSON list holding the served model (mlx_lm.server
    answered an empty body), and a request naming the model by its directory's name or its listed id is served
    by that model (mlx_lm.server tried to download it from the Hub)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, tok = loaded
    ours = Server(["spec_cache.apps.mlx_lm_server", "--model", str(model_dir), "--cache", str(tmp_path / "store")],
                  tmp_path / "ours.log")
    try:
        ours.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.1:{ours.port}/v1/models", timeout=30) as r:
            listed = [m["id"] for m in json.loads(r.read())["data"]]
        assert str(model_dir.resolve()) in listed, listed
        prompt = _prompt_text(20)
        cold = _greedy(loaded, tok.encode(prompt))
        for name in (model_dir.name, str(model_dir.resolve())):
            body = json.dumps({"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                               "logprobs": True})
            req = urllib.request.Request(f"http://127.0.0.1:{ours.port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                d = json.loads(r.read())
            assert [c["id"] for c in d["choices"][0]["logprobs"]["content"]] == cold, (name, d)
    finally:
        ours.stop(signal.SIGKILL)
