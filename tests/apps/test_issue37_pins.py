"""Issue 37, the attacker's second pass on pins and the cache routes: pins are counted by what they keep, one tenant
can never take every pin the server allows, and the cache routes answer a lone surrogate with a 400.

* A pin of a short prefix of a long memory entry pinned that whole entry while counting only the short prefix's
  K/V (six 300-token pins of 3000-token prompts held 23.8 MB of an 8 MB memory tier). Now the memory entry pinned
  is one of exactly the covered tokens (a copy: no view that keeps the long entry's buffers alive), and a pin's
  bytes are that entry's bytes (library tests: ``SpecCache.pin`` on a memory tier holding only the long entry).
* The per-tenant pin share was the minimum of several limits, the server's total among them, so with two keys and
  a memory tier smaller than LMDB one tenant could pin the whole total and the other's first pin got 409 (whose
  message told it the server's total). Now a tenant pins at most the total / its API keys (at least 2), and a 409
  names the caller's own share only.
* ``/v1/cache/pin``, ``unpin``, ``prefetch``, ``export`` and ``import`` answered ``"prompt": "\\ud800"`` with a
  JSON 500 (the tokenizer's TypeError); now a 400, as the generating routes answer it (``protocol.check_text``).
"""

from __future__ import annotations

import gc
import signal

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from spec_cache.tiers import cache_controls as controls
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server import KEY_A, KEY_B, Server, model  # noqa: F401  (model: a fixture)

HEADS, DIM = 2, 16  # float32: 256 bytes of K/V a token a layer
LAYERS = 2


def kv_caches(n: int, seed: int = 0) -> list[KVCache]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        c = KVCache()
        c.keys = mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32))
        c.values = mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32))
        c.offset = n
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def per_token() -> int:
    return LAYERS * 2 * HEADS * DIM * 4


def pinned_entries(cache: SpecCache) -> list:
    return [e for e in cache.memory._entries.values() if e.pinned]


@pytest.fixture
def cache(tmp_path):
    with SpecCache.open(tmp_path / "store", memory_bytes=4 << 20, durability="sync") as c:
        yield c


# -- 1. a pin counts what it keeps --------------------------------------------------------------------------------
def test_a_pin_of_a_short_prefix_pins_an_entry_of_exactly_its_tokens(cache):
    ns = cache.namespace("ab" * 32, "prefix", "tenant-a")
    tokens = [int(t) for t in np.random.default_rng(1).integers(4, 250, 1000)]
    cache.save(ns, tokens, kv_caches(len(tokens)))
    pin = cache.pin(ns, tokens[:300], 60, owner="a", granularity=64)
    assert pin.length == 256
    held = pinned_entries(cache)
    assert [e.length for e in held] == [256]  # never the 1000-token entry that served it by trimming
    assert pin.nbytes == held[0].nbytes == 256 * per_token()
    assert pin.memory_tokens == np.asarray(tokens[:256], dtype=np.uint32).tobytes()
    # the pinned entry owns its arrays (no views of the long entry's buffers): the long entry gone, its memory is
    # given back
    del held
    gc.collect()
    before = mx.get_active_memory()
    assert cache.memory.discard(ns, tokens)
    gc.collect()
    assert before - mx.get_active_memory() >= 1000 * per_token()
    # the copy restores the same state as the long entry's prefix
    restored = cache.restore(ns, tokens[:256])
    assert restored.length == 256 and restored.tier == "memory"
    assert restored.caches[0].keys.shape[2] == 256
    # unpinned: evictable like any other entry
    cache.unpin(pin.pin_id, owner="a")
    assert pinned_entries(cache) == []


def test_pins_of_short_prefixes_never_hold_more_of_the_memory_tier_than_they_count(cache):
    """The attacker's loop: short prefixes of several long entries, pinned under a cap. What the memory tier holds
    pinned equals what the pins count, and stays within the cap."""
    ns = cache.namespace("ab" * 32, "prefix", "tenant-a")
    cap = 1 << 20
    for seed in range(6):
        tokens = [int(t) for t in np.random.default_rng(100 + seed).integers(4, 250, 1500)]
        cache.save(ns, tokens, kv_caches(len(tokens), seed))
        try:
            cache.pin(ns, tokens[:300], 60, owner="a", quota_bytes=cap, granularity=64)
        except controls.PinQuotaExceeded:
            pass
    counted = sum(p.nbytes for p in controls.pins(cache, owner="a"))
    held = sum(e.nbytes for e in pinned_entries(cache))
    assert held == counted <= cap
    assert all(e.length == 256 for e in pinned_entries(cache))


def test_a_refused_pin_leaves_no_pinned_entry(cache):
    ns = cache.namespace("ab" * 32, "prefix", "tenant-a")
    tokens = [int(t) for t in np.random.default_rng(7).integers(4, 250, 1000)]
    cache.save(ns, tokens, kv_caches(len(tokens)))
    with pytest.raises(controls.PinQuotaExceeded):
        cache.pin(ns, tokens[:300], 60, owner="a", quota_bytes=100 * per_token(), granularity=64)
    assert pinned_entries(cache) == [] and controls.pins(cache, owner="a") == []


def test_a_refusal_over_the_total_tells_nothing_of_other_tenants(cache):
    ns_a = cache.namespace("ab" * 32, "prefix", "tenant-a")
    ns_b = cache.namespace("ab" * 32, "prefix", "tenant-b")
    a = [int(t) for t in np.random.default_rng(8).integers(4, 250, 256)]
    b = [int(t) for t in np.random.default_rng(9).integers(4, 250, 128)]
    cache.save(ns_a, a, kv_caches(256, 1))
    cache.save(ns_b, b, kv_caches(128, 2))
    total = 300 * per_token()
    first = cache.pin(ns_a, a, 60, owner="a", total_quota_bytes=total)
    with pytest.raises(controls.PinQuotaExceeded) as refused:
        cache.pin(ns_b, b, 60, owner="b", total_quota_bytes=total)
    message = str(refused.value)
    assert not any(str(n) in message for n in (total, first.nbytes, first.nbytes + 128 * per_token())), message


# -- 2 and 3: on a real server -------------------------------------------------------------------------------------
def post(srv: Server, path: str, key: str = KEY_A, **body) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def prompt(seed: int, n: int = 60) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(4 + seed % 200)] + [int(t) for t in rng.integers(4, 250, n - 1)]


def complete(srv: Server, tokens: list[int], key: str = KEY_A) -> None:
    r = post(srv, "/v1/completions", key, model="tiny", prompt=tokens, max_tokens=2, temperature=0)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """A memory tier (512 KB) smaller than LMDB (4 MB): all pins at most 256 KB, a tenant (2 keys) 128 KB. The tiny
    model's K/V is 1 KB a token, so a 60-token prompt pins ~60 KB."""
    _, target, _ = model
    tmp = tmp_path_factory.mktemp("issue37pins")
    srv = Server(target, tmp / "store", tmp, "--memory-bytes", "512K", "--max-bytes", "4M", "--max-pin-ttl", "60",
                 "--max-body-bytes", "2000000")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log.read_text(), srv.log.read_text()[-3000:]


def test_one_tenant_cannot_take_every_pin_and_a_409_names_only_its_own_share(server):
    refusal = None
    pinned = 0
    for seed in range(200, 210):
        tokens = prompt(seed)
        complete(server, tokens, KEY_A)
        server.wait_durable()
        r = post(server, "/v1/cache/pin", KEY_A, tokens=tokens, ttl_s=60)
        if r.status_code == 409:
            refusal = r.json()["error"]
            break
        assert r.status_code == 200, r.text
        pinned += r.json()["bytes"]
    assert refusal is not None and refusal["code"] == "pin_quota_exceeded"
    share = 512 * 1024 // 2 // 2
    assert pinned <= share
    assert f"may pin at most {share}" in refusal["message"]
    assert "in all" not in refusal["message"] and str(512 * 1024 // 2) not in refusal["message"]
    # B pins within its own share: A's pins left it room
    tokens = prompt(300)
    complete(server, tokens, KEY_B)
    server.wait_durable()
    r = post(server, "/v1/cache/pin", KEY_B, tokens=tokens, ttl_s=60)
    assert r.status_code == 200, r.text
    for key in (KEY_A, KEY_B):
        for p in httpx.get(server.url + "/v1/cache/pins", headers={"Authorization": f"Bearer {key}"},
                           timeout=10).json()["data"]:
            assert post(server, "/v1/cache/unpin", key, id=p["id"]).status_code == 200


@pytest.mark.parametrize("route", ["pin", "unpin", "prefetch", "export", "import"])
@pytest.mark.parametrize("field", ["prompt", "messages", "cache_salt"])
def test_a_lone_surrogate_is_a_400_on_every_cache_route(server, route, field):
    text = "a\ud800b"
    body = {"prompt": text} if field == "prompt" else {"prompt": "hello", field: text} if field == "cache_salt" \
        else {"messages": [{"role": "user", "content": text}]}
    if route == "import":
        body.setdefault("cache_salt", "s")
        body["file"] = "AAAA"
    raw = json_bytes(body)
    r = httpx.post(f"{server.url}/v1/cache/{route}", content=raw, timeout=30,
                   headers={"Authorization": f"Bearer {KEY_A}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "surrogate" in error["message"] and error["param"] == field


def json_bytes(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800, as a client would send it
