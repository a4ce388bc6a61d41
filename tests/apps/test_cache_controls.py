"""``/v1/cache/...`` on real ``spec-cache serve`` processes: pin, unpin, TTL, prefetch, export, import, auth.

A tiny float32 target (no drafter) with a small memory tier (``--memory-bytes 256K``: a 60-token prompt's
checkpoints take ~64 KB), so a few other prompts push unpinned prefixes out of the memory tier. Where a prefix is
held is read back through ``/v1/cache/prefetch`` (``tier``: ``memory`` when the memory tier still held it, ``local``
when it came from LMDB) and the memory tier's hit/miss counters in ``/metrics``.
"""

from __future__ import annotations

import base64
import signal

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from spec_cache.rows.target import TargetModel
from tests.apps.test_server import KEY_A, KEY_B, OPERATOR, Server, model  # noqa: F401  (model: a fixture)

MEMORY = ["--memory-bytes", "256K", "--max-pin-ttl", "60", "--max-body-bytes", "2000000"]


def prompt(seed: int, n: int = 60) -> list[int]:
    """``n`` token ids of the tiny vocabulary (256), distinct per seed from the first token on."""
    rng = np.random.default_rng(seed)
    return [int(4 + seed % 200)] + [int(t) for t in rng.integers(4, 250, n - 1)]


def post(srv: Server, path: str, key: str | None = KEY_A, **body) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def complete(srv: Server, tokens: list[int], key: str = KEY_A, max_tokens: int = 4, **extra) -> dict:
    r = post(srv, "/v1/completions", key, model="tiny", prompt=tokens, max_tokens=max_tokens, temperature=0, **extra)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def where(srv: Server, tokens: list[int], key: str = KEY_A) -> str | None:
    """The tier a prefetch of ``tokens`` restored from (and leaves it in the memory tier)."""
    r = post(srv, "/v1/cache/prefetch", key, tokens=tokens)
    assert r.status_code == 200, r.text
    return r.json()["tier"]


def flood(srv: Server, seeds, key: str = KEY_A) -> None:
    for seed in seeds:
        complete(srv, prompt(seed))
        srv.wait_durable()


def pins(srv: Server, key: str) -> list[dict]:
    r = httpx.get(srv.url + "/v1/cache/pins", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def error_of(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code, error
    return error


def greedy(model_dir, tokens: list[int], n: int, cache=None) -> list[int]:
    target = TargetModel.load(model_dir)
    out = []
    for token, _ in generate_step(mx.array(tokens), target.model, max_tokens=n, prompt_cache=cache):
        out.append(int(token))
    return out


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    _, target, _ = model
    tmp = tmp_path_factory.mktemp("cachectl")
    srv = Server(target, tmp / "store", tmp, *MEMORY)
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log.read_text(), srv.log.read_text()


# -- pins ---------------------------------------------------------------------------------------------------------
def test_pin_keeps_a_prefix_through_memory_pressure_and_unpin_lets_it_go(server):
    pinned, other = prompt(1), prompt(2)
    complete(server, pinned)
    complete(server, other)
    server.wait_durable()
    r = post(server, "/v1/cache/pin", tokens=pinned, ttl_s=60)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["tokens"] == len(pinned) and pin["bytes"] > 0 and pin["tier"] == "memory"
    assert [p["id"] for p in pins(server, KEY_A)] == [pin["id"]]
    flood(server, range(10, 16))  # ~6 x 64 KB through a 256 KB tier
    assert where(server, other) == "local"  # used after the pinned one, unpinned: evicted
    assert where(server, pinned) == "memory"
    assert post(server, "/v1/cache/unpin", id=pin["id"]).json()["unpinned"] is True
    assert pins(server, KEY_A) == []
    flood(server, range(20, 26))
    assert where(server, pinned) == "local"


def test_pin_ends_when_its_ttl_passes(server):
    tokens = prompt(3)
    complete(server, tokens)
    server.wait_durable()
    pin = post(server, "/v1/cache/pin", tokens=tokens, ttl_s=1).json()
    assert pin["tokens"] == len(tokens) and 0 < pin["ttl_s"] <= 1
    import time

    time.sleep(1.2)
    assert pins(server, KEY_A) == []
    flood(server, range(30, 36))
    assert where(server, tokens) == "local"


def test_unpin_by_prefix_and_tenants_never_reach_each_others_prefixes(server, tmp_path):
    tokens = prompt(4)
    complete(server, tokens)
    server.wait_durable()
    pin = post(server, "/v1/cache/pin", tokens=tokens + [9, 9], ttl_s=30).json()  # the longest stored prefix
    assert pin["tokens"] == len(tokens)
    # B sees none of A's pins, cannot end them by id or by prefix, and has nothing stored under these tokens
    assert pins(server, KEY_B) == []
    error_of(post(server, "/v1/cache/unpin", KEY_B, id=pin["id"]), 404, "not_found")
    error_of(post(server, "/v1/cache/unpin", KEY_B, tokens=tokens), 404, "not_found")
    error_of(post(server, "/v1/cache/pin", KEY_B, tokens=tokens), 404, "not_found")
    error_of(post(server, "/v1/cache/export", KEY_B, tokens=tokens), 404, "not_found")
    assert where(server, tokens, KEY_B) is None
    error_of(post(server, "/v1/cache/pin", KEY_B, tokens=tokens, tenant=pin["tenant"]), 400)
    assert [p["id"] for p in pins(server, KEY_A)] == [pin["id"]]
    # the operator sees every pin, names tenants by label, and may end any pin
    listed = pins(server, OPERATOR)
    assert [(p["id"], p["tenant"]) for p in listed] == [(pin["id"], pin["tenant"])]
    again = post(server, "/v1/cache/pin", OPERATOR, tokens=tokens, ttl_s=20, tenant=pin["tenant"]).json()
    assert again["id"] == pin["id"] and again["ttl_s"] <= 20  # the same pin, its TTL set again
    assert post(server, "/v1/cache/unpin", tokens=tokens + [1]).json()["id"] == pin["id"]  # A, by prefix
    assert pins(server, OPERATOR) == []


def test_pins_count_against_the_quota(server):
    tokens = prompt(5, 140)  # ~140 KB: over half of the 256 KB memory tier
    complete(server, tokens)
    server.wait_durable()
    error_of(post(server, "/v1/cache/pin", tokens=tokens, ttl_s=10), 409, "pin_quota_exceeded")
    assert pins(server, KEY_A) == []


def test_auth_and_bad_inputs(server):
    tokens = prompt(6)
    for path in ("/v1/cache/pin", "/v1/cache/unpin", "/v1/cache/prefetch", "/v1/cache/export", "/v1/cache/import"):
        error_of(post(server, path, None, tokens=tokens), 401, "invalid_api_key")
        error_of(post(server, path, "wrong-key", tokens=tokens), 401, "invalid_api_key")
    error_of(httpx.get(server.url + "/v1/cache/pins", timeout=10), 401)
    error_of(post(server, "/v1/cache/pin", tokens=tokens, prompt="w1"), 400)
    error_of(post(server, "/v1/cache/pin"), 400)
    error_of(post(server, "/v1/cache/pin", tokens=[1, 2, 999]), 400)
    error_of(post(server, "/v1/cache/pin", tokens="1 2 3"), 400)
    error_of(post(server, "/v1/cache/pin", tokens=tokens, ttl_s=61), 400, "ttl_too_long")
    error_of(post(server, "/v1/cache/pin", tokens=tokens, ttl_s=-1), 400)
    error_of(post(server, "/v1/cache/pin", tokens=tokens, ttl_s=10), 404, "not_found")  # nothing stored yet
    error_of(post(server, "/v1/cache/pin", messages=[{"role": "nobody", "content": "w1"}]), 422)  # as chat
    bad = httpx.post(server.url + "/v1/cache/pin", content=b"{not json", timeout=10,
                     headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
    error_of(bad, 400, "invalid_json")
    error_of(post(server, "/v1/cache/import", file=base64.b64encode(b"x" * 1_600_000).decode()), 413,
             "request_too_large")
    error_of(post(server, "/v1/cache/import", tokens=tokens, file="%%%"), 400)
    error_of(post(server, "/v1/cache/import", tokens=tokens, file=base64.b64encode(b"not a file").decode(),
                  cache_salt="s"), 400, "invalid_prefix_file")
    error_of(post(server, "/v1/cache/nothing", tokens=tokens), 404)


def test_prefix_by_messages_and_prompt(server):
    messages = [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8"}]
    chat = post(server, "/v1/chat/completions", model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert chat.status_code == 200, chat.text
    server.wait_durable()
    got = post(server, "/v1/cache/prefetch", messages=messages).json()
    assert got["tokens"] >= got["prompt_tokens"] - 1 > 0 and got["resident"] is True
    without = post(server, "/v1/cache/prefetch", messages=messages, add_generation_prompt=False).json()
    assert without["prompt_tokens"] < got["prompt_tokens"]
    text = post(server, "/v1/cache/prefetch", prompt="w1 w2 w3").json()
    assert text["prompt_tokens"] > 0 and text["tier"] is None and text["tokens"] == 0


# -- pins in LMDB, prefetch from LMDB and from the shared tier after a restart -----------------------------------
def test_after_a_restart_pinned_prefixes_are_in_lmdb_and_prefetch_makes_a_memory_hit(model, redis_server, tmp_path):
    """Server 1 (a 400 KB store, a shared tier) pins P, answers Q, then ~6 other prompts: LMDB's budget evicts Q
    (and would P); after a restart P comes from LMDB and Q from the shared tier, and a request after the prefetch
    of P restores from the memory tier."""
    _, target, _ = model
    pinned, other = prompt(7), prompt(17)
    shared = [*MEMORY, "--shared", redis_server.url, "--shared-trusted-network"]
    first = Server(target, tmp_path / "store", tmp_path, *shared, "--max-bytes", "400K")
    try:
        complete(first, pinned)
        first.wait_durable()
        assert post(first, "/v1/cache/pin", tokens=pinned, ttl_s=60).status_code == 200
        complete(first, other)
        flood(first, range(40, 47))
    finally:
        first.stop()
    # a larger budget now: pins end with their process, and this one's first writes must not evict P
    srv = Server(target, tmp_path / "store", tmp_path, *shared, "--max-bytes", "8M")
    try:
        got = post(srv, "/v1/cache/prefetch", tokens=pinned).json()
        assert (got["tier"], got["tokens"], got["resident"]) == ("local", len(pinned), True)
        assert post(srv, "/v1/cache/prefetch", tokens=other).json()["tier"] == "shared"  # not in LMDB now
        hits, misses = srv.metric("spec_cache_memory_tier_hits"), srv.metric("spec_cache_memory_tier_misses")
        answer = complete(srv, pinned + [5])
        assert cached(answer) == len(pinned)
        assert srv.metric("spec_cache_memory_tier_hits") == hits + 1
        assert srv.metric("spec_cache_memory_tier_misses") == misses
        assert f"cached={len(pinned)}" in srv.log.read_text()
    finally:
        srv.stop()


# -- export / import ----------------------------------------------------------------------------------------------
def test_export_loads_in_mlx_lm_and_continues_as_a_cold_run(server, model, tmp_path):
    _, target, _ = model
    tokens = prompt(8, 40)
    complete(server, tokens)
    server.wait_durable()
    r = post(server, "/v1/cache/export", tokens=tokens)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text
    covered = int(r.headers["x-spec-cache-tokens"])
    assert covered >= len(tokens) - 1
    path = tmp_path / "prefix.safetensors"
    path.write_bytes(r.content)
    caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata["model"] == "tiny" and all(c.offset == covered for c in caches)
    whole = tokens + [17, 18, 19]
    assert greedy(target, whole[covered:], 12, cache=caches) == greedy(target, whole, 12)


def test_import_is_restored_by_the_next_request(server, model, tmp_path):
    _, target, _ = model
    tokens = prompt(9, 30)
    model_ = TargetModel.load(target).model
    caches = make_prompt_cache(model_)
    model_(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    path = tmp_path / "made.safetensors"
    save_prompt_cache(str(path), caches, {"model": "elsewhere"})
    data = base64.b64encode(path.read_bytes()).decode()
    error_of(post(server, "/v1/cache/import", tokens=tokens[:-1], file=data, cache_salt="mine"), 400,
             "invalid_prefix_file")
    r = post(server, "/v1/cache/import", tokens=tokens, file=data, cache_salt="mine")
    assert r.status_code == 200 and r.json() == {"object": "cache.import", "tokens": len(tokens), "stored": True}
    answer = complete(server, tokens + [7], max_tokens=6, cache_salt="mine")
    assert cached(answer) == len(tokens)
    assert answer["choices"][0]["text"] == text_of(target, greedy(target, tokens + [7], 6))
    # B's namespace holds none of it; an exported file goes back in as the raw body (its tokens in its metadata)
    assert cached(complete(server, tokens + [7], KEY_B, max_tokens=1, cache_salt="mine")) < len(tokens)
    exported = post(server, "/v1/cache/export", tokens=tokens, cache_salt="mine").content
    raw = httpx.post(server.url + "/v1/cache/import?cache_salt=mine", content=exported, timeout=60,
                     headers={"Authorization": f"Bearer {KEY_B}", "Content-Type": "application/octet-stream"})
    assert raw.status_code == 200 and raw.json()["tokens"] == len(tokens), raw.text
    assert cached(complete(server, tokens + [7], KEY_B, max_tokens=1, cache_salt="mine")) == len(tokens)


def test_import_refuses_files_that_do_not_fit_the_model(server, tmp_path):
    tokens = prompt(11, 8)

    def upload(caches) -> httpx.Response:
        path = tmp_path / "bad.safetensors"
        save_prompt_cache(str(path), caches)
        return post(server, "/v1/cache/import", tokens=tokens, file=base64.b64encode(path.read_bytes()).decode(),
                    cache_salt="fits")

    def kv(heads: int, dim: int, dtype=mx.float32) -> KVCache:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, heads, len(tokens), dim), dtype), mx.zeros((1, heads, len(tokens), dim), dtype))
        return c
    error_of(upload([kv(1, 64)]), 400, "invalid_prefix_file")  # one layer, the model has two
    error_of(upload([kv(1, 32), kv(1, 32)]), 400, "invalid_prefix_file")  # head size
    error_of(upload([kv(2, 64), kv(2, 64)]), 400, "invalid_prefix_file")  # KV heads
    error_of(upload([kv(1, 64, mx.float16), kv(1, 64, mx.float16)]), 400, "invalid_prefix_file")  # dtype
    assert upload([kv(1, 64), kv(1, 64)]).status_code == 200  # the right shape goes in


def text_of(model_dir, ids: list[int]) -> str:
    """What the server answers for greedy ``ids``: cut after the first EOS (2), written as mlx_lm.server does."""
    from mlx_lm.utils import load_tokenizer

    from tests.apps.test_server import expected_text

    if 2 in ids:
        ids = ids[: ids.index(2) + 1]
    return expected_text(load_tokenizer(model_dir), ids)


# -- LMDB leases (what a pin holds in the store) ------------------------------------------------------------------
@pytest.mark.parametrize("label", [None, b"\x01" * 16], ids=["plain-lru", "tenants"])
def test_a_leased_entry_is_not_evicted_by_the_budget_until_its_lease_ends(tmp_path, label):
    import time

    from spec_cache.store import LayerState, Store, Tensor

    def put(store, seed: int) -> bytes:
        layer = LayerState("arrays", {}, [Tensor.from_numpy(np.full(1024, seed, np.float32))], token_axis=None)
        return store.put(b"n" * 32, [seed, seed + 1, 7], [layer]).entry

    def held(store, seeds) -> list[int]:
        return [s for s in seeds if store.lookup(b"n" * 32, [s, s + 1, 7]) is not None]

    with Store.open(tmp_path / "s", durable=False, max_bytes=6 * 4096 + 2048) as store:
        store.register_namespace(b"n" * 32, target="ab" * 32, prefix_namespace="{}", tenant=label is not None,
                                 tenant_id=label)
        first = put(store, 10)
        assert store.entry_key(b"n" * 32, [10, 11, 7]) == first and store.entry_key(b"n" * 32, [10, 11]) is None
        store.leases.hold(first, time.monotonic() + 60)
        for seed in range(20, 40, 2):
            put(store, seed)
        assert 10 in held(store, [10]) and held(store, [20]) == []  # the oldest: kept while leased; the next: gone
        store.leases.hold(first, time.monotonic() - 1)  # the lease has ended
        for seed in range(40, 60, 2):
            put(store, seed)
        assert held(store, [10]) == []


# -- memory tier: a pin with an end ------------------------------------------------------------------------------
def test_a_memory_tier_pin_holds_until_its_end_and_survives_a_replacing_put():
    import time

    from spec_cache.tiers.memory_tier import MemoryTier

    def kv(n: int, seed: int) -> KVCache:
        c = KVCache()
        c.keys = mx.array(np.full((1, 1, n, 8), seed, np.float32))
        c.values = mx.array(np.full((1, 1, n, 8), seed, np.float32))
        c.offset = n
        return c

    tier = MemoryTier(4 * 2 * 4 * 8 * 4, idle_seconds=None, memory_probe=lambda: (0, 0))  # four 4-token entries
    ns = b"n" * 32
    tier.put(ns, [1, 2, 3, 4], [kv(4, 1)], durable=True)
    assert tier.serving(ns, [1, 2, 3]) == (np.asarray([1, 2, 3, 4], np.uint32).tobytes(), 256)  # by trimming
    assert tier.serving(ns, [1, 2, 9]) is None
    assert tier.pin(ns, [1, 2, 3, 4], until=time.monotonic() + 60)
    tier.put(ns, [1, 2, 3, 4], [kv(4, 1)], durable=True)  # the same tokens again: the pin and its end stay
    for seed in range(10, 20):
        tier.put(ns, [seed, 0, 0, 0], [kv(4, seed)], durable=True)
    assert tier.lookup(ns, [1, 2, 3, 4]) is not None and tier.stats()["pinned"] == 1
    assert tier.pin(ns, [1, 2, 3, 4], until=time.monotonic() - 1)  # its end has passed
    assert tier.stats()["pinned"] == 0
    for seed in range(20, 25):
        tier.put(ns, [seed, 0, 0, 0], [kv(4, seed)], durable=True)
    assert tier.lookup(ns, [1, 2, 3, 4]) is None
