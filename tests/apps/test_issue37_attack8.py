"""Issue 37, the eighth (confirming) attacker's pass: cross-tenant effects through namespaces and salts. Real
``spec-cache serve`` processes on 127.0.0.1 with two API keys (A attacks, B is a normal user), and the store in
process.

Found and fixed (``tests/library/test_namespace_bound.py``): the namespace bound held per process only. The empty
LMDB rows of the namespaces still registered when a process ended (up to ``max_namespaces``: A's fresh salts) were
never dropped by a later process, so every restart added up to 1024 more (outside the byte budget); 5 processes
naming 8 fresh salts each left 41 rows where 2 hold anything. Now opening a cache drops the empty tenant rows
(``Store.forget_empty_tenant_namespaces``), except those a continuation record names (a greedy request's: bounded
as the records are, 4096 shared fairly across tenants).

What held (asserted below): A's storm of 40 streams, each with a fresh ``cache_salt`` and dropped after its first
chunk, with 40 salted ``GET /v1/cache/pins`` calls, during B's salted greedy request: B's answer equal to its answer
alone, B's prefix restored afterwards (99 of 100), no row left, no traceback. A's fresh salts into a store with
``--tenant-quota`` across two restarts (each process a new namespace table): A's bytes stayed within its quota
(its salted namespaces count against its key), B's prefix was restored after each restart (99-100 of 100), and
after the last one A's only empty rows are those its continuation records name (bounded as the
records are). A's ``/v1/cache/prefetch``, ``export`` and ``pin`` of B's exact stored prompt under B's salt string,
and ``GET /v1/cache/pins`` with it (A's own namespace: nothing of B's), and A's requests with ``top_k`` 10**9 and
``repetition_penalty`` 1e-300 under that salt beside B's: B's answer as alone, its prefix restored, A's first
request restored nothing.

Not tried: a row that fails a step only after it was proven, while another tenant's row joins with a restored
prefix: the culprit rule would blame the fresh restored row (``Scheduler._culprit``: failed, its prefix dropped).
Reading the sampler and the engine's checks found no request of A that fails a step late (grammars, sampling
parameters and imports are checked first or fail alone), so only an injected fault was seen to reach that rule.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid

import httpx
import numpy as np

from spec_cache.store import continuations, maintenance
from spec_cache.store.keys import tenant_id
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server import KEY_A, KEY_B, Server, model, stopped  # noqa: F401  (model: a fixture)


def headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(4, 250, n)]


def complete(srv: Server, key: str, tokens: list[int], salt: str | None = None, max_tokens: int = 2) -> dict:
    body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.url + "/v1/completions", headers=headers(key), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def salt_storm(srv: Server, count: int) -> None:
    """A: ``count`` streams with fresh salts, each dropped after its first chunk, and ``count`` salted pin listings."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=128)) as client:
        async def stream(i: int) -> None:
            body = {"model": "tiny", "prompt": list(range(20, 80 + i % 7)), "max_tokens": 400, "temperature": 0.8,
                    "stream": True, "cache_salt": f"a-{uuid.uuid4()}"}
            try:
                async with client.stream("POST", srv.url + "/v1/completions", headers=headers(KEY_A),
                                         json=body) as r:
                    async for _ in r.aiter_bytes():
                        break
            except httpx.HTTPError:
                pass

        async def pins() -> None:
            r = await client.get(srv.url + "/v1/cache/pins", params={"cache_salt": f"p-{uuid.uuid4()}"},
                                 headers=headers(KEY_A))
            assert r.status_code in (200, 429), r.text
        await asyncio.gather(*[stream(i) for i in range(count)], *[pins() for _ in range(count)])


def test_a_storm_of_fresh_salts_and_dropped_streams_never_touches_b(model, tmp_path):
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path)
    b_prompt = list(range(10, 110))
    try:
        alone = complete(srv, KEY_B, b_prompt, "b", max_tokens=40)
        during = {}
        b = threading.Thread(target=lambda: during.update(complete(srv, KEY_B, b_prompt, "b-2", max_tokens=40)))
        b.start()
        asyncio.run(salt_storm(srv, 40))
        b.join(120)
        assert during["choices"][0]["text"] == alone["choices"][0]["text"]
        assert cached(complete(srv, KEY_B, b_prompt, "b")) >= len(b_prompt) - 1
        srv.wait_durable()
        health = srv.health()
        assert health["active_rows"] == 0 and health["queue_depth"] == 0, health
    finally:
        stopped(srv)


def test_fresh_salts_across_restarts_stay_within_the_quota_and_leave_no_rows(model, tmp_path):
    _, target, _ = model
    options = ("--memory-bytes", "256K", "--max-bytes", "1M", "--tenant-quota", "256K")
    b_prompt = prompt(1)
    for run in range(3):
        srv = Server(target, tmp_path / "store", tmp_path, *options)
        try:
            if run == 0:
                complete(srv, KEY_B, b_prompt, "b")
                srv.wait_durable()
            else:
                assert cached(complete(srv, KEY_B, b_prompt + [5], "b")) >= len(b_prompt) - 1
            for i in range(20):  # fresh salts, and some named again in a later process
                complete(srv, KEY_A, prompt(100 + 40 * run + i), f"a-{i % 5}" if i % 2 else f"a-{run}-{i}")
            srv.wait_durable()
        finally:
            stopped(srv)
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        usage = {row["tenant"]: row for row in maintenance.tenants(cache.store)}
        with cache.store.reading() as txn:
            replayable = continuations.namespaces_with_records(txn, cache.store.env.dbs)
        left = [row for row in maintenance.namespaces(cache.store) if row["tenant"] and not row["entries"]]
    a, b = (usage[tenant_id("key:" + hashlib.sha256(k.encode()).hexdigest()[:32]).hex()] for k in (KEY_A, KEY_B))
    assert 0 < a["bytes"] <= 256 * 1024, a
    assert b["entries"] >= 1, b
    # the empty rows of A's salts are gone, but those a continuation record names (bounded as the records are)
    assert all(bytes.fromhex(row["key"]) in replayable for row in left), left


def test_cache_routes_under_b_salt_and_sampling_at_its_bounds_reach_nothing_of_b(model, tmp_path):
    """A names B's salt string and B's exact stored prompt on every cache route (A's own namespace: nothing there),
    and sends greedy-breaking sampling at its bounds beside B; B's answer and stored prefix are as alone."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path)
    b_prompt = prompt(3)
    try:
        alone = complete(srv, KEY_B, b_prompt, "shared-word", max_tokens=30)
        srv.wait_durable()
        for route in ("prefetch", "export", "pin"):
            body = {"tokens": b_prompt, "cache_salt": "shared-word"} | ({"ttl_s": 30} if route == "pin" else {})
            r = httpx.post(srv.url + f"/v1/cache/{route}", headers=headers(KEY_A), json=body, timeout=60)
            assert r.status_code in (200, 404, 409), r.text
            if r.status_code == 200 and route != "export":
                assert r.json().get("tokens", 0) == 0, r.text
            assert route != "export" or r.status_code == 404, r.status_code
        pins = httpx.get(srv.url + "/v1/cache/pins", params={"cache_salt": "shared-word"}, headers=headers(KEY_A),
                         timeout=60).json()
        assert pins["data"] == [], pins
        hostile = {"model": "tiny", "prompt": b_prompt, "max_tokens": 30, "temperature": 1.0, "top_k": 10**9,
                   "repetition_penalty": 1e-300, "cache_salt": "shared-word"}
        answers = []
        b = threading.Thread(target=lambda: answers.append(complete(srv, KEY_B, b_prompt, "shared-word",
                                                                   max_tokens=30)))
        b.start()
        for i in range(4):
            r = httpx.post(srv.url + "/v1/completions", headers=headers(KEY_A), json=hostile, timeout=60)
            assert r.status_code in (200, 400, 422), r.text
            if i == 0 and r.status_code == 200:  # its first: nothing of B's (the later ones restore A's own)
                assert cached(r.json()) == 0, r.json()["usage"]
        b.join(120)
        assert answers[0]["choices"][0]["text"] == alone["choices"][0]["text"]
        assert cached(answers[0]) >= len(b_prompt) - 1
    finally:
        stopped(srv)
