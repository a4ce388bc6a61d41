"""Issue 37, the ninth (confirming) attacker's pass: A (one API key) against B (another), aimed at what the earlier
eight passes did not try: the shared tier (Redis) with tenants, the Anthropic route's ``cache_control``, and a fleet
of two servers.

Found and fixed: the publish queue to the shared tier (``store/shared/publish.py``, byte-capped, default 256 MiB of
checkpoints, counted whole) was one FIFO for every tenant and drops what does not fit (the local store keeps it).
While the fleet's Redis lags this host's checkpoints (a remote link; a GPU prefills faster than it uploads), A's
checkpoints kept it full and B's, offered when it was full, were dropped: B's prefixes never reached the fleet's
other hosts, which prefilled B cold. Now a tenant within its share of the cap (cap / tenants with checkpoints
queued) has the oldest queued checkpoint of the tenant holding the most dropped instead (``PublishMixin.enqueue``,
``WriteBehind.drop_oldest``); one tenant alone, exactly as before. The two other shared-tier buffers this pass
read (the promote queue, fetched prefixes copied into the local store; the prefetch ``Handoff``) had the same
pattern and share their cap by the same rule since (``store.background.TenantShares``); their tests are below.

What held (asserted below): B's ``cache_control`` breakpoint on an 80-word system prompt, read by B's next
``/v1/messages`` request, is never read by A's request with B's exact body (``x-api-key``; ``cache_read_input_tokens``
0, A creates its own) nor exported by A (404); A's four-breakpoint requests (tools, two system blocks, its message,
1h TTL) beside B's leave B's answer and its read as alone. Two servers on one Redis with the same two keys: B's
prefix stored on the first is restored for B on the second (256 of 300 tokens, from the shared tier) and never for
A there (a request: ``cached_tokens`` 0; prefetch and pin: nothing).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from spec_cache.store import pack_tokens
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_issue37_attack8 import cached, complete, headers
from tests.apps.test_server import KEY_A, KEY_B, Server, model, stopped, words  # noqa: F401  (model: a fixture)
from tests.redis_servers import ThrowawayServer, server_binaries
from tests.store.test_shared_tier import PREFIX_NS, SECRET, TARGET, caches_for, prompt

BINARIES = server_binaries()
needs_redis = pytest.mark.skipif(not BINARIES, reason="no redis-server or valkey-server binary installed")


def host(path, url, **options) -> SpecCache:
    options = {"secret": SECRET, "timeout_s": 2.0, "connect_timeout_s": 2.0, "lookup_budget_s": 10.0,
               "backoff_s": 0.05, **options}
    return SpecCache.open(path, shared=url, shared_options=options, chunk_tokens=16, durable=False)


@needs_redis
def test_one_tenants_checkpoints_filling_the_publish_queue_never_drop_anothers(tmp_path):
    """The publish queue to the shared tier is byte-capped and drops what does not fit (the local store keeps it).
    While the fleet's Redis is slower than this host's checkpoints, A's checkpoints fill it; B's one checkpoint,
    B holding nothing queued, must still be published (A's oldest queued one goes instead), so that B's prefix is
    on the fleet's other hosts."""
    with ThrowawayServer(next(iter(BINARIES.values()))) as server:
        a_host = host(tmp_path / "a", server.url, queue_bytes=64 << 10)  # ~3 checkpoints of 80 tokens
        other = host(tmp_path / "other", server.url)
        try:
            ns_a = a_host.namespace(TARGET, PREFIX_NS, tenant="key:a")
            ns_b = a_host.namespace(TARGET, PREFIX_NS, tenant="key:b")
            gate, real = threading.Event(), a_host.shared.publish
            a_host.shared.publish = lambda out: gate.wait(30) and real(out)  # a slow link to Redis
            for i in range(8):
                assert a_host.save(ns_a, prompt(100 + i, 80), caches_for(prompt(100 + i, 80)))
            assert a_host.shared_status()["dropped_full"] >= 4  # A's own back-pressure: its later ones dropped
            b_tokens = prompt(7, 80)
            assert a_host.save(ns_b, b_tokens, caches_for(b_tokens))
            gate.set()
            assert a_host.shared.drain(30)
            hit = other.restore(other.namespace(TARGET, PREFIX_NS, tenant="key:b"), b_tokens)
            assert hit is not None and hit.length == 80, "B's checkpoint was dropped from the publish queue"
            assert a_host.shared_status()["published"] >= 2  # A's in flight and at least one more of A's
        finally:
            a_host.close()
            other.close()


def fleet_with(tmp_path, server, prompts: dict[str, list]) -> SpecCache:
    """A host that published each tenant's prompts to the fleet (``prompts``: tenant -> token lists); open."""
    source = host(tmp_path / "source", server.url)
    for tenant, lists in prompts.items():
        ns = source.namespace(TARGET, PREFIX_NS, tenant=tenant)
        for tokens in lists:
            assert source.save(ns, tokens, caches_for(tokens))
    assert source.drain(30)
    return source


@needs_redis
def test_one_tenants_promotions_filling_the_promote_queue_never_drop_anothers(tmp_path):
    """Prefixes restored from the shared tier are copied into the local store by a byte-capped queue (the
    promoter) that drops what does not fit. While the local store is slow to take them, A's restores fill it;
    B's one restored prefix, B holding nothing queued, must still be promoted (A's oldest queued one goes
    instead), so B's next request finds it locally. Failed before (the tenth pass's first part): B's was dropped
    (``promote_dropped``) and never stored here."""
    a_prompts, b_tokens = [prompt(100 + i, 80) for i in range(8)], prompt(7, 80)
    with ThrowawayServer(next(iter(BINARIES.values()))) as server:
        source = fleet_with(tmp_path, server, {"key:a": a_prompts, "key:b": [b_tokens]})
        here = host(tmp_path / "here", server.url, queue_bytes=64 << 10)  # ~3 prefixes of 80 tokens
        try:
            ns_a = here.namespace(TARGET, PREFIX_NS, tenant="key:a")
            ns_b = here.namespace(TARGET, PREFIX_NS, tenant="key:b")
            gate, real = threading.Event(), here.store.put
            here.store.put = lambda *a, **k: gate.wait(30) and real(*a, **k)  # a slow local disk
            for tokens in a_prompts:
                hit = here.restore(ns_a, tokens)
                assert hit is not None and hit.length == 80
            assert here.shared_status()["promote_dropped"] >= 4  # A's own back-pressure: its later ones dropped
            hit = here.restore(ns_b, b_tokens)
            assert hit is not None and hit.length == 80
            gate.set()
            assert here.drain(30)
            local = here.store.lookup(ns_b, pack_tokens(b_tokens))
            assert local is not None and local.length == 80, "B's prefix was dropped from the promote queue"
            assert here.shared_status()["promoted"] >= 2  # A's in flight and at least one more of A's
        finally:
            here.close()
            source.close()


@needs_redis
def test_one_tenants_prefetches_never_push_out_anothers_held_prefix(tmp_path):
    """Prefixes fetched ahead of a request (``prefetch_shared``, the server's prefetch pool) wait in a byte-capped
    ``Handoff`` for the restore that asked for them. A's prefetches past the cap must let A's own oldest go, never
    B's one held prefix (B within its share), so B's restore on the scheduler's thread (which never asks Redis
    itself) still gets it. Failed before: the oldest went whoever held it, B's restore found nothing."""
    a_prompts, b_tokens = [prompt(100 + i, 80) for i in range(8)], prompt(7, 80)
    with ThrowawayServer(next(iter(BINARIES.values()))) as server:
        source = fleet_with(tmp_path, server, {"key:a": a_prompts, "key:b": [b_tokens]})
        here = host(tmp_path / "here", server.url, queue_bytes=64 << 10)  # holds ~3 prefixes of 80 tokens
        try:
            ns_a = here.namespace(TARGET, PREFIX_NS, tenant="key:a")
            ns_b = here.namespace(TARGET, PREFIX_NS, tenant="key:b")
            assert here.prefetch_shared(ns_b, b_tokens)
            for tokens in a_prompts:
                assert here.prefetch_shared(ns_a, tokens)  # A's newest held: its own oldest went
            with here.shared_via_prefetch():
                hit = here.restore(ns_b, b_tokens)
                assert hit is not None and hit.length == 80, "B's held prefix was pushed out by A's prefetches"
                newest = here.restore(ns_a, a_prompts[-1])
                assert newest is not None and newest.length == 80
                assert here.restore(ns_a, a_prompts[0]) is None  # A's oldest: the one that paid
        finally:
            here.close()
            source.close()


# --- through ``spec-cache serve``: A attacks, B is a normal user (two API keys) -----------------------------
def messages(srv: Server, key: str, system_text: str, question: str, **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": question}],
            "system": [{"type": "text", "text": system_text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            **extra}
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": key}, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_anthropic_cache_control_breakpoints_never_cross_keys(model, tmp_path):
    """B's ``cache_control`` breakpoint on a long system prompt is stored and read by B's next request; A's
    request with B's exact body (``x-api-key``), and A's export of B's prompt, read nothing of it (A creates its
    own), and A's four-breakpoint request beside B's leaves B's answer as it was alone."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, probe_while_loading=False)
    system_text, question = words(300, 80), words(20, 5)
    try:
        first = messages(srv, KEY_B, system_text, question)["usage"]
        again = messages(srv, KEY_B, system_text, question)
        assert first["cache_creation_input_tokens"] > 60 and first["cache_read_input_tokens"] == 0, first
        assert again["usage"]["cache_read_input_tokens"] >= first["cache_creation_input_tokens"], again["usage"]
        system_only = {"messages": [{"role": "system", "content": system_text}], "add_generation_prompt": False}
        r = httpx.post(srv.url + "/v1/cache/export", headers=headers(KEY_B), json=system_only, timeout=60)
        assert r.status_code == 200 and int(r.headers["X-Spec-Cache-Tokens"]) > 60, r.status_code  # B: its own
        r = httpx.post(srv.url + "/v1/cache/export", headers=headers(KEY_A), json=system_only, timeout=60)
        assert r.status_code == 404, r.status_code  # A: nothing (before A's own request stores the same prefix)
        stolen = messages(srv, KEY_A, system_text, question)
        assert stolen["usage"]["cache_read_input_tokens"] == 0, stolen["usage"]
        assert stolen["usage"]["cache_creation_input_tokens"] == first["cache_creation_input_tokens"]
        assert stolen["content"] == again["content"]  # the same model, cold: the same greedy answer
        # A: four breakpoints (tools, two system blocks, its message) and a 1h TTL, beside B's third request
        tools = [{"name": f"t{i}", "description": words(500 + 9 * i, 8), "input_schema": {"type": "object"},
                  **({"cache_control": {"type": "ephemeral"}} if i == 3 else {})} for i in range(4)]
        hostile = {"model": "tiny", "max_tokens": 40, "temperature": 1.0, "tools": tools,
                   "system": [{"type": "text", "text": words(700, 30), "cache_control": {"type": "ephemeral"}},
                              {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": question,
                                                               "cache_control": {"type": "ephemeral"}}]}]}
        during = []
        b = threading.Thread(target=lambda: during.append(messages(srv, KEY_B, system_text, question)))
        b.start()
        for _ in range(3):
            r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": KEY_A}, json=hostile, timeout=120)
            assert r.status_code == 200, r.text
        b.join(120)
        assert during[0]["content"] == again["content"]
        assert during[0]["usage"]["cache_read_input_tokens"] >= first["cache_creation_input_tokens"]
    finally:
        stopped(srv)


@needs_redis
def test_two_servers_on_one_shared_tier_keep_tenants_apart(model, tmp_path):
    """Two hosts of one fleet (one Redis between them), the same two keys on both: B's prefix stored on the first
    host reaches B on the second (restored from the shared tier), never A there (a request, a prefetch, a pin)."""
    _, target, _ = model
    with ThrowawayServer(next(iter(BINARIES.values()))) as redis_server:
        shared = ("--shared", redis_server.url, "--shared-trusted-network")
        first = Server(target, tmp_path / "one", tmp_path, *shared, probe_while_loading=False)
        second = Server(target, tmp_path / "two", tmp_path, *shared, probe_while_loading=False)
        b_prompt = [4 + i % 240 for i in range(300)]
        try:
            alone = complete(first, KEY_B, b_prompt, max_tokens=20)
            first.wait_durable()
            client = redis.Redis.from_url(redis_server.url)
            deadline = time.monotonic() + 30
            while not list(client.scan_iter(match="*man:*")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert list(client.scan_iter(match="*man:*")), "B's checkpoint was never published"
            for route in ("prefetch", "pin"):
                r = httpx.post(second.url + f"/v1/cache/{route}", headers=headers(KEY_A), timeout=60,
                               json={"tokens": b_prompt})
                assert r.status_code in (200, 404), r.text
                assert r.status_code == 404 or r.json()["tokens"] == 0, r.text
            stolen = complete(second, KEY_A, b_prompt, max_tokens=20)
            assert cached(stolen) == 0, stolen["usage"]
            assert stolen["choices"][0]["text"] == alone["choices"][0]["text"]
            mine = complete(second, KEY_B, b_prompt, max_tokens=20)
            assert cached(mine) >= 256, mine["usage"]  # from the shared tier: B's own, on another host
            assert mine["choices"][0]["text"] == alone["choices"][0]["text"]
        finally:
            stopped(first)
            stopped(second)
