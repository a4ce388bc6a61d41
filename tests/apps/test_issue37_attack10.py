"""Issue 37, the tenth (confirming) attacker's pass: A (one API key) against B (another), on angles the nine earlier
passes did not try. Real ``spec-cache serve`` processes on 127.0.0.1 (the tiny model of ``spec_cache.testing``), two
API keys and an operator key; every loop bounded.

No cross-tenant effect found. What held (asserted below, each able to fail):

* ``n`` fan-out: A's streamed ``n: 6`` of 300 tokens each (its whole slot share at ``--max-rows 4 --max-queue 8``),
  ``ignore_eos``, then a second one at once: B's greedy request sent while A's choices decode is admitted (200,
  never 429), answered as alone and finished before A's; A's second fan-out is A's own 429.
* ``response_format`` beside B (SmolLM2; the tiny model's tokenizer has no grammar support): two streamed
  ``json_schema`` requests of A with ``n: 3`` (an 80-member ``enum`` of long strings, a mask on every token) while B
  decodes: A's rows served (200), B's answer as alone and done before A's.
* Cache import/export without the operator key: A's export of B's stored prompt (with and without B's salt string):
  404; A's import of its own exported state without a salt: 403 ``operator_key_required``; naming B's tenant label:
  400; under a salt equal to B's salt string: 200, stored in A's salted namespace only (A exports it back; B's
  salted request of the imported prompt: ``cached_tokens`` 0; B's own salted prompt still restores B's own
  checkpoint and gives B's cold answer).
* ``--tenant-quota 0``: serve refuses to start (exit 2, one line, no traceback). A quota smaller than one chunk
  (16 KiB; a chunk of the tiny model is 256 tokens of ~1 KiB): A's 8 prompts of 300 tokens, each over the quota,
  and 8 of 10 tokens (within it: A's own churn) never evict B's 10-token prefix (restored before and after a
  restart).
* ``/metrics``, ``/health`` and ``/v1/cache/pins`` with A's key, while B has requests, pins and cached tokens:
  nothing labelled with B's tenant, no server-wide series, ``/health`` only ``status`` and ``model``; A's pin listing
  with ``tenant`` set to B's label: 400; with B's salt string: none of B's pins.
"""

from __future__ import annotations

import threading
import time

import httpx

from spec_cache.apps.server import auth
from spec_cache.apps.server.auth import tenant_label
from tests.apps.test_issue37_attack3 import QUESTION, chat, schema_format, smollm2  # noqa: F401  (a fixture)
from tests.apps.test_issue37_attack8 import cached, complete, headers, prompt
from tests.apps.test_server import KEY_A, KEY_B, OPERATOR, Server, model, stopped  # noqa: F401  (model: a fixture)


def label(key: str) -> str:
    """The tenant label ``/metrics`` and ``/v1/cache/pins`` show for ``key``."""
    return tenant_label("key:" + auth._digest(key))


def stream_all(srv: Server, key: str, body: dict, started: threading.Event, out: dict,
               path: str = "/v1/completions") -> None:
    """Read a streamed answer to its end; ``out``: status, chunks, the time it ended."""
    with httpx.stream("POST", srv.url + path, headers=headers(key), json={**body, "stream": True},
                      timeout=300) as r:
        out["status"] = r.status_code
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                started.set()
        out["chunks"] = chunks
    out["ended"] = time.monotonic()
    started.set()


def test_n_fan_out_never_starves_another_tenants_stream(model, tmp_path):
    """A takes its whole slot share with one streamed ``n`` request of long generations, and asks for more at once;
    B's request sent meanwhile is admitted, answered as alone, and done before A's."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--max-rows", "4", "--max-queue", "8", probe_while_loading=False)
    b_tokens = prompt(11, 40)
    try:
        alone = complete(srv, KEY_B, b_tokens, max_tokens=40)["choices"][0]["text"]
        fan = {"model": "tiny", "prompt": prompt(12, 30), "max_tokens": 300, "temperature": 1.0, "n": 6,
               "ignore_eos": True}
        started, a_out = threading.Event(), {}
        a = threading.Thread(target=stream_all, args=(srv, KEY_A, fan, started, a_out))
        a.start()
        assert started.wait(120)
        more = httpx.post(srv.url + "/v1/completions", headers=headers(KEY_A), json=fan, timeout=120)
        b = complete(srv, KEY_B, b_tokens, max_tokens=40)
        b_ended = time.monotonic()
        a.join(300)
        assert a_out["status"] == 200 and a_out["chunks"] >= 6 * 300 / 4, a_out
        assert more.status_code == 429, more.text  # A's own share, never B's
        assert b["choices"][0]["text"] == alone
        assert b_ended < a_out["ended"], "B waited for A's fan-out to finish"
    finally:
        stopped(srv)


def test_response_format_fan_out_beside_another_tenants_stream(smollm2):
    """A's ``json_schema`` requests with ``n: 3`` (an ``enum`` of 80 long strings: a mask on every token), two
    streamed at once, beside B's greedy row (SmolLM2: the tiny model's tokenizer has no grammar support): B's answer
    as alone and done before A's; A's own requests served (its grammar really ran)."""
    srv = smollm2
    alone = chat(srv, KEY_B, max_tokens=24)
    assert alone.status_code == 200, alone.text
    enum = [f"{'word ' * 8}{i}" for i in range(80)]
    schema = {"type": "object", "properties": {"a": {"enum": enum}, "b": {"type": "array", "items": {"enum": enum}}},
              "required": ["a", "b"]}
    body = {"model": srv.model_id, "messages": QUESTION, "max_tokens": 80, "temperature": 1.0, "n": 3,
            "response_format": schema_format(schema)}
    outs = [{} for _ in range(2)]
    started = threading.Event()
    threads = [threading.Thread(target=stream_all, args=(srv, KEY_A, body, started, out, "/v1/chat/completions"))
               for out in outs]
    for t in threads:
        t.start()
    assert started.wait(240)
    b = chat(srv, KEY_B, max_tokens=24)
    b_ended = time.monotonic()
    for t in threads:
        t.join(300)
    assert b.status_code == 200 and b.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    for out in outs:
        assert out["status"] == 200 and out["chunks"] > 3 * 10, out  # A's grammar rows decoded
    assert b_ended < max(out["ended"] for out in outs), "B's row waited for A's grammar fan-out to end"


def test_cache_import_and_export_without_the_operator_key_never_cross_tenants(model, tmp_path):
    """A's exports of B's stored prompt answer 404; A's import without a salt 403, naming B's tenant 400, and under
    a salt equal to B's salt string reaches only A's requests with it, never B's."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, probe_while_loading=False)
    b_tokens, salt = prompt(31, 120), "shared-looking-salt"
    try:
        b_cold = complete(srv, KEY_B, b_tokens, salt=salt, max_tokens=12)
        complete(srv, KEY_B, b_tokens, max_tokens=12)  # unsalted too
        srv.wait_durable()
        for extra in ({}, {"cache_salt": salt}):
            r = httpx.post(srv.url + "/v1/cache/export", headers=headers(KEY_A), json={"tokens": b_tokens, **extra},
                           timeout=60)
            assert r.status_code == 404, (extra, r.status_code)
        # A makes its own state of a prompt B never sent, exports it, and plants it where B's salt would read it
        a_tokens = prompt(32, 120)
        complete(srv, KEY_A, a_tokens, salt="a-own", max_tokens=2)
        srv.wait_durable()
        r = httpx.post(srv.url + "/v1/cache/export", headers=headers(KEY_A),
                       json={"tokens": a_tokens, "cache_salt": "a-own"}, timeout=60)
        assert r.status_code == 200, r.text
        blob = r.content
        attempts = {"no salt": ({}, 403), "B's label": ({"tenant": label(KEY_B), "cache_salt": salt}, 400),
                    "B's salt string": ({"cache_salt": salt}, 200)}
        for name, (fields, status) in attempts.items():
            r = httpx.post(srv.url + "/v1/cache/import", headers={**headers(KEY_A),
                                                                  "Content-Type": "application/octet-stream"},
                           params=fields, content=blob, timeout=60)
            assert r.status_code == status, (name, r.status_code, r.text)
        r = httpx.post(srv.url + "/v1/cache/export", headers=headers(KEY_A),
                       json={"tokens": a_tokens, "cache_salt": salt}, timeout=60)
        assert r.status_code == 200  # A's own namespace under that salt string holds A's import
        b_planted = complete(srv, KEY_B, a_tokens, salt=salt, max_tokens=2)
        assert cached(b_planted) == 0, b_planted["usage"]  # never B's
        b_again = complete(srv, KEY_B, b_tokens, salt=salt, max_tokens=12)
        assert b_again["choices"][0]["text"] == b_cold["choices"][0]["text"]
        assert cached(b_again) >= 100  # B's own earlier checkpoint, as before A's import
    finally:
        stopped(srv)


def test_tenant_quota_zero_is_refused_and_one_under_a_chunk_keeps_tenants_apart(model, tmp_path):
    """``--tenant-quota 0`` is one error line at start; a quota under one chunk never lets A's over-quota
    checkpoints evict B's small prefix (restored before and after a restart)."""
    _, target, _ = model
    try:
        Server(target, tmp_path / "zero", tmp_path, "--tenant-quota", "0")
        raise AssertionError("serve started with --tenant-quota 0")
    except RuntimeError as exc:
        text = str(exc)
        assert "exited 2" in text and "tenant_quota_bytes must be a positive int" in text, text
        assert "Traceback" not in text, text
    quota = ("--tenant-quota", "16K", "--memory-bytes", "1M")
    b_tokens = prompt(41, 10)
    srv = Server(target, tmp_path / "store", tmp_path, *quota, probe_while_loading=False)
    try:
        complete(srv, KEY_B, b_tokens, max_tokens=2)
        srv.wait_durable()
        for i in range(8):
            complete(srv, KEY_A, prompt(400 + i, 300), max_tokens=2)
            complete(srv, KEY_A, prompt(500 + i, 10), max_tokens=2)  # within the quota: A's own churn
        srv.wait_durable()
        again = complete(srv, KEY_B, b_tokens, max_tokens=2)
        assert cached(again) >= 9, again["usage"]
    finally:
        stopped(srv)
    srv = Server(target, tmp_path / "store", tmp_path, *quota, probe_while_loading=False)
    try:
        again = complete(srv, KEY_B, b_tokens, max_tokens=2)
        assert cached(again) >= 9, again["usage"]  # from LMDB: A's floods never evicted it
    finally:
        stopped(srv)


def test_metrics_health_and_pins_show_a_tenant_nothing_of_another(model, tmp_path):
    """With B's requests, cached tokens and a pin in the server, A's ``/metrics``, ``/health`` and pin listings
    (plain, with B's label, with B's salt string) carry nothing of B's."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, probe_while_loading=False)
    b_tokens, salt = prompt(51, 120), "b-salt"
    try:
        for s in (None, salt, None):
            complete(srv, KEY_B, b_tokens, salt=s, max_tokens=4)
        srv.wait_durable()
        for extra in ({}, {"cache_salt": salt}):
            r = httpx.post(srv.url + "/v1/cache/pin", headers=headers(KEY_B),
                           json={"tokens": b_tokens, "ttl_s": 300, **extra}, timeout=60)
            assert r.status_code == 200, r.text
        complete(srv, KEY_A, prompt(52, 30), max_tokens=4)
        b_label, a_label = label(KEY_B), label(KEY_A)
        operator = httpx.get(srv.url + "/metrics", headers=headers(OPERATOR), timeout=10).text
        assert f'tenant="{b_label}"' in operator and f'tenant="{a_label}"' in operator  # the labels are right
        seen = httpx.get(srv.url + "/metrics", headers=headers(KEY_A), timeout=10).text
        assert b_label not in seen and f'tenant="{a_label}"' in seen, seen
        server_wide = [line for line in seen.splitlines() if line and not line.startswith("#")
                       and "spec_cache_tenant_" not in line]
        assert not server_wide, server_wide
        health = httpx.get(srv.url + "/health", headers=headers(KEY_A), timeout=10).json()
        assert set(health) <= {"status", "model"}, health
        for params in ({}, {"cache_salt": salt}, {"cache_salt": ""}):
            r = httpx.get(srv.url + "/v1/cache/pins", headers=headers(KEY_A), params=params, timeout=10)
            assert r.status_code == 200 and r.json()["data"] == [], (params, r.text)
        r = httpx.get(srv.url + "/v1/cache/pins", headers=headers(KEY_A), params={"tenant": b_label}, timeout=10)
        assert r.status_code == 400, r.text
        mine = httpx.get(srv.url + "/v1/cache/pins", headers=headers(KEY_B), timeout=10).json()["data"]
        assert len(mine) == 1 and mine[0]["tenant"] == b_label  # B's own (unsalted) pin is listed for B
    finally:
        stopped(srv)
