"""Issue 37, the fifth (confirming) attacker's pass: the surfaces the first four did not try. Real ``spec-cache
serve`` processes on 127.0.0.1 with two API keys (A attacks, B is a normal user), and the tables in process.

What broke, and is fixed:

* A tenant's tokenizing took its turn per route family (chat, completions, messages, cache routes: a
  ``TenantTurns`` each), so A flooding all four at once had four requests in the tokenizer's single worker ahead
  of B's (B's ``count_tokens`` behind 3 of A's answers, twice). Now one turn per tenant across every route
  (``jobs.Requests.tokenize_as``): 0-1.
* Inside one shared key, ``GET /v1/cache/pins`` listed every salt's pins and ``/v1/cache/unpin`` by id ended them:
  a caller with ``cache_salt`` "y" saw salt "x"'s pin (id, tokens, bytes, expiry) and ended it. Now a caller lists
  and ends by id only the pins of its own (salted) namespace; the operator key every pin.

* Continuation records were one LRU for every tenant (4096 records / 64 MiB, in process and in LMDB): A's
  distinct requests evicted B's, so B's retry recomputed instead of resuming. Now both bounds evict from the
  tenant holding the largest part first (``store/continuations.py``'s tenant rows; the in-process LRU per tenant).

What held: a storm of 40 disconnected long streams beside B's greedy row (B's answer equal to alone, no row left).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.apps.test_issue37_attack3 import smollm2  # noqa: F401 (a fixture)
from tests.apps.test_server import KEY_A, KEY_B, Server, model  # noqa: F401  (model: a fixture)


# -- (b) tokenizing: one turn per tenant across every route ------------------------------------------------------
def flood_routes(srv, floods: list[tuple[str, dict]], count: int, b_route: str, b_body: dict) -> dict:
    """``count`` concurrent requests of A to each of ``floods`` (route, body), all at once; once ``3 * len(floods)``
    of them are answered, one of B. Counted as ``flood_beside`` counts: ``ahead``, A's answers arriving between B's
    send and B's answer; ``queued``, A's answers after B's send."""
    seen: dict = {"a": []}

    async def flood() -> None:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as client:
            async def a_request(route: str, body: dict) -> int:
                r = await client.post(srv.url + route, json=body, headers=srv.headers(KEY_A))
                seen["a"].append(time.perf_counter())
                return r.status_code

            async def b_request() -> None:
                while len(seen["a"]) < 3 * len(floods):
                    await asyncio.sleep(0.01)
                seen["b_sent"] = time.perf_counter()
                r = await client.post(srv.url + b_route, headers=srv.headers(KEY_B), json=b_body)
                seen["b_done"] = time.perf_counter()
                seen["b_status"] = r.status_code

            jobs = [a_request(route, body) for _ in range(count) for route, body in floods]
            statuses = await asyncio.gather(*jobs, b_request())
            seen["a_statuses"] = set(statuses[:-1])

    asyncio.run(flood())
    return {"a_statuses": seen["a_statuses"], "b_status": seen["b_status"],
            "ahead": sum(1 for t in seen["a"] if seen["b_sent"] < t < seen["b_done"]),
            "queued": sum(1 for t in seen["a"] if t > seen["b_sent"])}


def test_a_flood_through_every_tokenizing_route_at_once_queues_at_most_one_request_ahead_of_another_tenant(
        smollm2):  # noqa: F811
    """A floods chat, completions, messages and ``/v1/cache/prefetch`` at once with 168 KB prompts (each refused
    as too long after tokenizing); B's ``count_tokens`` then waits behind at most the A request being tokenized
    (and one answer in flight). Before: a turn per route family, so four of A's were queued in the tokenizer's
    one worker ahead of B's (ahead 3-5 of ~50)."""
    srv = smollm2
    words = " ".join(f"token{i} alpha beta" for i in range(8000))
    messages = [{"role": "user", "content": words}]
    floods = [("/v1/chat/completions", {"model": srv.model_id, "messages": messages, "max_tokens": 1}),
              ("/v1/completions", {"model": srv.model_id, "prompt": words, "max_tokens": 1}),
              ("/v1/messages", {"model": srv.model_id, "messages": messages, "max_tokens": 1}),
              ("/v1/cache/prefetch", {"prompt": words})]
    got = flood_routes(srv, floods, 14, "/v1/messages/count_tokens", {
        "model": srv.model_id, "messages": [{"role": "user", "content": "Hi"}]})
    print(f"ahead {got['ahead']} of {got['queued']} queued; A {got['a_statuses']}")
    assert got["b_status"] == 200
    assert got["a_statuses"] <= {400, 413}, got["a_statuses"]
    assert got["queued"] >= 20  # B came while most of A's flood was still queued
    assert got["ahead"] <= 2, got


# -- (e) cache controls inside one shared key: a cache_salt's pins are its own ------------------------------------
def test_inside_a_shared_key_a_salts_pins_are_neither_listed_nor_ended_by_another_salt(model, tmp_path):  # noqa: F811
    """The README: with a shared key, ``cache_salt`` per conversation is the privacy. Y (same key, salt "y") lists
    ``/v1/cache/pins`` and unpins by id: X's pin (salt "x") is neither shown nor ended, nor is the unsalted
    caller's shown to Y; the operator key still sees and ends every pin. Before: Y saw X's pin (its id, token
    count, bytes, expiry) and ended it with ``/v1/cache/unpin``."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--max-rows", "2", keys=(KEY_A,))
    try:
        def post(path: str, key: str = KEY_A, **body) -> httpx.Response:
            return httpx.post(srv.url + path, json=body, headers=srv.headers(key), timeout=60)

        secret = [5 + (i * 13) % 200 for i in range(64)]
        for salt in ("x", None):
            extra = {} if salt is None else {"cache_salt": salt}
            assert post("/v1/completions", model="tiny", prompt=secret + [7], max_tokens=1, **extra).status_code == 200
        x_pin = post("/v1/cache/pin", tokens=secret, ttl_s=60, cache_salt="x")
        assert x_pin.status_code == 200, x_pin.text
        plain_pin = post("/v1/cache/pin", tokens=secret, ttl_s=60)
        assert plain_pin.status_code == 200, plain_pin.text
        listed = httpx.get(srv.url + "/v1/cache/pins?cache_salt=y", headers=srv.headers(), timeout=30)
        assert listed.status_code == 200 and listed.json()["data"] == [], listed.text
        ended = post("/v1/cache/unpin", id=x_pin.json()["id"], cache_salt="y")
        assert ended.status_code == 404, ended.text
        mine = httpx.get(srv.url + "/v1/cache/pins?cache_salt=x", headers=srv.headers(), timeout=30).json()["data"]
        assert [p["id"] for p in mine] == [x_pin.json()["id"]]
        every = httpx.get(srv.url + "/v1/cache/pins", headers=srv.headers(srv.operator), timeout=30).json()["data"]
        assert {p["id"] for p in every} == {x_pin.json()["id"], plain_pin.json()["id"]}
        assert post("/v1/cache/unpin", id=x_pin.json()["id"], cache_salt="x").status_code == 200
    finally:
        srv.stop()


# -- (f) continuation records: one table for every tenant ---------------------------------------------------------
def test_one_tenants_requests_never_evict_another_tenants_continuation_records(tmp_path):
    """B's interrupted generation leaves a continuation record (a retry resumes it token-identically); A's
    requests (distinct prompts: 4096 of them at the default bounds, here 8) each leave one too. B's record stays
    while B holds less than A (as the prefix entries and the memory tier share their bounds): in this process and
    in LMDB (a fresh ``Continuations`` reads only LMDB). Before: gone from both at A's 8th, and B's retry recomputed
    from its KV checkpoint. The namespaces are registered with their tenants as the server registers them."""
    import hashlib

    from spec_cache.store import maintenance
    from spec_cache.tiers.cache import SpecCache
    from spec_cache.tiers.continuations import Continuation, Continuations

    def key(*parts) -> bytes:
        return hashlib.sha256(repr(parts).encode()).digest()

    with SpecCache.open(tmp_path / "store") as cache:
        table = Continuations(cache, memory_records=8, max_records=8)
        ns_a = cache.namespace("ab" * 32, "spec-cache/ngram:v1", "key-a")
        ns_b = cache.namespace("ab" * 32, "spec-cache/ngram:v1", "key-b")
        b_record = Continuation(key=key("b", 0), ns_key=ns_b, prompt_tokens=300, tokens=tuple(range(5, 45)))
        table.remember(b_record)
        table.persist(b_record)
        for i in range(20):
            record = Continuation(key=key("a", i), ns_key=ns_a, prompt_tokens=100, tokens=(5, 6, 7))
            table.remember(record)
            table.persist(record)
        assert table.get(key("a", 19), ns_a, 100) is not None
        assert table.get(b_record.key, ns_b, 300) is not None  # in process
        durable = Continuations(cache, memory_records=8, max_records=8)
        assert durable.get(b_record.key, ns_b, 300).tokens == b_record.tokens  # in LMDB
        assert durable.get(key("a", 19), ns_a, 100) is not None
        assert durable.get(key("a", 0), ns_a, 100) is None  # A's own oldest went
        assert len(durable.table.records()) == 8
        report = maintenance.verify(cache.store)
        assert not report.damaged, report.as_dict()  # the tenant rows agree with the records


# -- (d) a storm of disconnects beside another tenant's row ------------------------------------------------------
def test_a_storm_of_disconnected_requests_never_changes_another_tenants_answer_or_keeps_rows(model, tmp_path):  # noqa: F811
    """A sends 40 long streaming requests (a 600-token prompt, 3400 tokens to decode: 5 s alone) through raw sockets and
    closes each at once or after its first bytes, while B's 80-token greedy row decodes: B's answer equals its
    answer alone, B is never refused, and once the storm is over no row or queued job of A's is left (the
    server's ``active_rows`` and ``queue_depth`` go back to 0: every disconnect ended its row)."""
    import json
    import socket
    import threading

    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--max-rows", "4", "--max-queue", "8")
    try:
        b_body = {"model": "tiny", "prompt": [6, 7, 8, 9, 10], "max_tokens": 80, "temperature": 0,
                  "ignore_eos": True}
        alone = httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_B), timeout=60,
                           json=dict(b_body, cache_salt="alone")).json()["choices"][0]["text"]
        storm_done = threading.Event()

        def storm() -> None:
            for i in range(40):
                body = json.dumps({"model": "tiny", "prompt": [5 + (i * 7 + j) % 240 for j in range(600)],
                                   "max_tokens": 3400, "stream": True, "ignore_eos": True}).encode()
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"authorization: Bearer " + KEY_A.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
                          + body)
                if i % 2:
                    s.settimeout(5)
                    try:
                        s.recv(64)  # its first bytes: the row was admitted (or refused 429)
                    except OSError:
                        pass
                s.close()
            storm_done.set()

        attacker = threading.Thread(target=storm)
        attacker.start()
        answers = []
        while not storm_done.is_set() and len(answers) < 3:
            r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_B), timeout=120,
                           json=dict(b_body, cache_salt=f"during-{len(answers)}"))
            answers.append(r)
        attacker.join(120)
        print(f"B asked {len(answers)} times; just after the storm: {srv.health()}")
        assert answers and all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert all(r.json()["choices"][0]["text"] == alone for r in answers)
        deadline = time.monotonic() + 3  # an A row left decoding: 5 s or more
        health = srv.health()
        while (health["active_rows"] or health["queue_depth"]) and time.monotonic() < deadline:
            time.sleep(0.1)
            health = srv.health()
        assert health["active_rows"] == 0 and health["queue_depth"] == 0, health
        log = srv.log.read_text()
        assert "an engine step failed" not in log and "Traceback" not in log
    finally:
        srv.stop()
