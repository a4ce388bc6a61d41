"""Issue 37, the fourth (confirming) attacker's pass: the third pass's attacks in variations it did not try, and the
newer surfaces (echo + logprobs and its table of prompt scores, stalled streams' event queues). Real
``spec-cache serve`` processes on 127.0.0.1 with two API keys (A attacks, B is a normal user), and the table in
process.

What broke, and is fixed:

* ``logprobs`` / ``top_logprobs`` beside a ``response_format`` grammar answered a 500 ("Out of range float values
  are not JSON compliant"): the grammar's mask leaves the other tokens at -inf. Now -9999.0, as OpenAI answers.
  (A's own request only.) And when one of ``n`` choices failed (its grammar's 422), the other choices' rows decoded
  on to ``max_tokens`` with nobody waiting (within A's row share); now they are cancelled with the answer.
* The table of prompt scores (``logprobs.PromptScores``) was one LRU for every tenant: ~20 echo requests of
  ~4000 tokens from A (64 MiB) pushed B's scores out, and B's next echo request restored nothing from a KV cache
  that still held its prompt. Now the least recently used entry of the API key holding the most goes first.

What held (each asserted below): an echo request never restores from another key's scores or KV (A's
``cached_tokens`` for B's prompt is 0 and its answer is the cold one); a flood of long prompts through
``/v1/messages/count_tokens`` and through ``/v1/completions`` with lists of prompts waits behind itself; grammars
with logprobs and ``n`` > 1 through ``/v1/completions`` fail or pass alone; hostile schemas through
``/v1/completions`` are a JSON 4xx or served; streams nobody reads through ``/v1/messages`` never take B's
connections; an unread stream's queued events stay bounded by its ``max_tokens``; a flood of long prompts into a
small memory tier never refuses B's checkpoint; export + import loops of a large prefix never change B's answer.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import httpx
import pytest

from spec_cache.apps.server.logprobs import PromptScores
from spec_cache.rows.logprobs import TokenLogprob
from tests.apps.test_issue37_attack3 import (
    HOSTILE,
    flood_beside,
    rss_bytes,
    schema_format,
    smollm2,  # noqa: F401 (a fixture)
)
from tests.apps.test_server import KEY_A, KEY_B, Server, model, stopped  # noqa: F401  (model: a fixture)


# -- the table of prompt scores: fair across API keys ---------------------------------------------------------
def scores(n: int, top: int = 5) -> list:
    alternatives = tuple((t, -1.0) for t in range(top))
    return [None] + [TokenLogprob(token=p % 200, logprob=-0.5, top=alternatives) for p in range(1, n)]


def test_one_keys_echo_flood_never_evicts_another_keys_prompt_scores():
    """B keeps one scored prompt; A (under many salts: one key) puts 60 long ones into a table that holds ~10.
    B's entry stays while B holds less than A. Before: one LRU, B's entry went at A's ~10th put."""
    table = PromptScores(max_bytes=8 << 20, max_entries=4096)
    b_prompt = [7] * 30 + list(range(40, 240))
    table.put(KEY_B, 5, b_prompt, scores(len(b_prompt)))
    assert table.longest(KEY_B, 5, b_prompt)[0] == len(b_prompt)
    for i in range(60):
        prompt = [i + 1] + list(range(1, 2000))
        table.put(f"{KEY_A}|salt:{i % 7}", 5, prompt, scores(len(prompt)))
    assert table.bytes <= table.max_bytes
    assert table.longest(KEY_B, 5, b_prompt)[0] == len(b_prompt)  # B's: kept
    kept_a = sum(1 for key in table._entries if key[0] != KEY_B)
    assert 0 < kept_a < 60  # A's own flood evicted A's own entries
    # the entry-count bound too: A's 100 short prompts leave B's 3
    table = PromptScores(max_bytes=64 << 20, max_entries=20)
    for i in range(3):
        table.put(KEY_B, 0, [i + 1, 2, 3, 4], scores(4, 0))
    for i in range(100):
        table.put(KEY_A, 0, [i + 100, 2, 3, 4], scores(4, 0))
    assert len(table) == 20 and all(table.longest(KEY_B, 0, [i + 1, 2, 3, 4])[0] == 4 for i in range(3))
    # one key alone: plain LRU, as before
    table = PromptScores(max_bytes=64 << 20, max_entries=2)
    for i in range(3):
        table.put(KEY_A, 0, [i + 1, 2, 3], scores(3, 0))
    assert table.longest(KEY_A, 0, [1, 2, 3])[0] == 0 and table.longest(KEY_A, 0, [3, 2, 3])[0] == 3


# -- echo + logprobs across keys, through serve ------------------------------------------------------------------
def echo(srv, key: str, prompt: list[int], logprobs: int = 3, salt: str | None = None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": logprobs,
            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(key), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_echo_never_restores_or_waits_across_keys(model, tmp_path):  # noqa: F811
    """B scores its prompt (twice: the second restores); A sends B's exact prompt, alone and while B's identical
    echo requests prefill: every A answer restores nothing (cached_tokens 0: nothing learnt about B's prompts)
    and equals the cold answer; B's echo requests keep restoring while A floods the table with its own."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--max-rows", "4", "--max-queue", "16")
    try:
        secret = [5 + (i * 13) % 200 for i in range(300)]
        cold = echo(srv, KEY_B, secret, salt=f"cold-{uuid.uuid4().hex}")
        assert cached(echo(srv, KEY_B, secret)) == 0
        assert cached(echo(srv, KEY_B, secret)) > 0  # B's own table and KV: restored
        a_alone = echo(srv, KEY_A, secret)
        assert cached(a_alone) == 0 and a_alone["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
        # while B's rows prefill the same prompt: A never waits on (nor restores from) B's rows
        answers: list = []

        def b_asks(i: int) -> None:
            answers.append(("b", echo(srv, KEY_B, secret + [7 + i] * 40)))

        def a_asks(i: int) -> None:
            answers.append(("a", echo(srv, KEY_A, secret + [7 + i] * 40, salt=f"a-{i}")))

        threads = [threading.Thread(target=b_asks, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=a_asks, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(answers) == 6
        assert all(cached(reply) == 0 for who, reply in answers if who == "a")
        assert all(cached(reply) > 0 for who, reply in answers if who == "b")  # B's table and KV: its own
        # A floods the table with long echo prompts of its own; B's prompt still restores
        for i in range(6):
            echo(srv, KEY_A, [9 + i] + [5 + (j * 17) % 200 for j in range(1000)], logprobs=5)
        again = echo(srv, KEY_B, secret)
        assert cached(again) > 0 and again["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
        log = srv.log.read_text()
        assert "an engine step failed" not in log and "Traceback" not in log
    finally:
        srv.stop()


# -- streams nobody reads -----------------------------------------------------------------------------------------
def raw_post(port: int, path: str, key: str, body: dict, rcvbuf: int = 4096) -> socket.socket:
    payload = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-api-key: {key}\r\n"
              f"authorization: Bearer {key}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
    s.settimeout(0.05)
    return s


def test_unread_streams_stay_bounded_and_never_take_another_tenants_connections(model, tmp_path):  # noqa: F811
    """A opens every connection the server allows: two ``/v1/messages`` streams read a few bytes a second, one
    ``top_logprobs`` chat stream never read at all (its events pile up in its ``_event_queue`` while the write
    stalls). B is served (one of A's stalled connections is evicted); the server's memory grows by far less than
    the unread stream's ``max_tokens`` could hold were it unbounded (it is bounded by them: ~3000 events)."""
    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--max-connections", "3", "--max-rows", "4",
                 "--max-queue", "4", probe_while_loading=False)
    socks: list = []
    try:
        rss = rss_bytes(srv.proc.pid)
        messages = {"model": "tiny", "max_tokens": 3000, "stream": True, "temperature": 0,
                    "messages": [{"role": "user", "content": "w5 w6"}]}
        for i in range(2):
            socks.append(raw_post(srv.port, "/v1/messages", KEY_A, dict(messages, ignore_eos=True)))
        socks.append(raw_post(srv.port, "/v1/chat/completions", KEY_A, {
            "model": "tiny", "messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 3000, "stream": True,
            "temperature": 0, "logprobs": True, "top_logprobs": 20, "ignore_eos": True}))
        served, refused = None, 0
        deadline = time.monotonic() + 60
        while served is None and time.monotonic() < deadline:
            for s in socks[:2]:  # slow-steady readers; the third reads nothing
                try:
                    s.recv(16)
                except OSError:
                    pass
            try:
                r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": KEY_B}, timeout=10,
                               json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "w9"}]})
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                served = r
            else:
                refused += 1
                time.sleep(0.5)
        assert served is not None, f"B was refused {refused} times while A's unread streams held every connection"
        assert served.json()["type"] == "message"
        assert "evicted at the connection cap" in srv.log.read_text()
        grown = rss_bytes(srv.proc.pid) - rss
        print(f"B refused {refused} times; server RSS grew {grown / 2**20:.1f} MiB")
        assert grown < 512 << 20, grown
    finally:
        for s in socks:
            s.close()
        srv.stop()


# -- SmolLM2: floods through every tokenizing route, grammars with logprobs and n > 1 ------------------------------
@pytest.mark.parametrize("route", ["/v1/messages/count_tokens", "/v1/completions"])
def test_a_flood_through_count_tokens_or_prompt_lists_never_queues_another_tenants_tokenizing(smollm2, route):
    """As the third pass's flood (``test_one_tenants_flood_of_long_prompts_never_queues_another_tenants_tokenizing``)
    through the routes it did not try: ``/v1/messages/count_tokens`` (answered 200 after tokenizing) and
    ``/v1/completions`` with a list of four long prompts a body (each tokenized in a turn of its own). Counted:
    how many of A's answers arrive between B's send and B's answer."""
    srv = smollm2
    text = " ".join(f"token{i} alpha beta" for i in range(2000))  # ~42 KB: four fit one body
    if route == "/v1/completions":
        body = {"model": srv.model_id, "prompt": [text + f" {k}" for k in range(4)], "max_tokens": 9000}
    else:
        body = {"model": srv.model_id, "max_tokens": 1, "messages": [{"role": "user", "content": text * 4}]}
    got = flood_beside(srv, route, body, 40, "/v1/messages/count_tokens", {
        "model": srv.model_id, "messages": [{"role": "user", "content": "Hi"}]})
    assert got["b_status"] == 200
    assert got["a_statuses"] <= {200, 400}, got["a_statuses"]
    ahead, queued = got["ahead"], got["queued"]
    print(f"{route}: {ahead} of A's {queued} queued requests answered before B's")
    assert queued >= 15
    assert ahead < queued // 2, (ahead, queued)


def completion(srv, key: str, prompt: str, timeout: float = 120, **extra) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=timeout,
                      json={"model": srv.model_id, "prompt": prompt, "temperature": 0, **extra})


PROMPT = "The capital of France is"


def test_grammars_with_logprobs_and_n_through_completions_fail_or_pass_alone(smollm2):
    """A's failing grammar (a counted regex llguidance gives up on at its first mask) and a costly one (a 100 KB
    enum string) with ``logprobs: 5`` and ``n: 3`` through ``/v1/completions``, beside B's greedy row: B gets its
    answer alone, A a 200 or its own one-line 422, and no step fails."""
    srv = smollm2
    expected = completion(srv, KEY_B, PROMPT, max_tokens=8, cache_salt="ref").json()["choices"][0]["text"]
    counted = schema_format({"type": "object", "properties": {"a": {"type": "string",
                                                                     "pattern": "^((((a{100}){100}){100}){100})$"}}})
    heavy = schema_format({"enum": ["x" * 100_000]})
    answers: dict = {}

    def attack(name, fmt, max_tokens) -> None:
        answers[name] = completion(srv, KEY_A, PROMPT, max_tokens=max_tokens, response_format=fmt, logprobs=5, n=3)

    threads = [threading.Thread(target=attack, args=("counted", counted, 12)),
               threading.Thread(target=attack, args=("heavy", heavy, 60))]
    for t in threads:
        t.start()
    r = completion(srv, KEY_B, PROMPT, max_tokens=8, cache_salt="beside")
    for t in threads:
        t.join(300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
    for name, answer in answers.items():
        print(name, answer.status_code, answer.text[:200])
        assert answer.status_code in (200, 422), (name, answer.text[:300])
        if answer.status_code == 422:
            error = answer.json()["error"]
            assert "\n" not in error["message"] and error["param"] == "response_format", error
        else:  # JSON (no -inf: a masked alternative is -9999.0, as OpenAI answers it)
            choices = answer.json()["choices"]
            assert len(choices) == 3 and all(lp > -1e5 for c in choices for lp in c["logprobs"]["token_logprobs"])
    log = srv.log.read_text()
    assert "an engine step failed" not in log and "Traceback" not in log


COMPLETIONS_HOSTILE = ("deep nesting", "$ref loop", "enum of 12k", "catastrophic regex", "backreference",
                       "nested counted regex", "anyOf of 2500", "not a schema")


def test_hostile_schemas_through_completions_are_a_json_4xx_or_served_beside_another_tenant(smollm2):
    srv = smollm2
    expected = completion(srv, KEY_B, PROMPT, max_tokens=8, cache_salt="ref8").json()["choices"][0]["text"]
    results: dict = {}

    def attack() -> None:
        for name in COMPLETIONS_HOSTILE:
            schema, allowed = HOSTILE[name]
            r = completion(srv, KEY_A, PROMPT, max_tokens=4, response_format=schema_format(schema), n=2)
            results[name] = (r, allowed)

    attacker = threading.Thread(target=attack)
    attacker.start()
    rounds = 0
    while attacker.is_alive() and rounds < 3:
        r = completion(srv, KEY_B, PROMPT, max_tokens=8, cache_salt=f"beside-{rounds}", timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
        rounds += 1
    attacker.join(300)
    assert set(results) == set(COMPLETIONS_HOSTILE)
    for name, (r, allowed) in results.items():
        assert r.status_code in allowed, (name, r.status_code, r.text[:300])
        if r.status_code != 200:
            error = r.json()["error"]
            assert "\n" not in error["message"] and error["param"] == "response_format", (name, error)
    log = srv.log.read_text()
    assert "an engine step failed" not in log and "Traceback" not in log
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


# -- the memory tier and the write-behind queue ------------------------------------------------------------------
def test_a_flood_of_long_prompts_never_refuses_another_tenants_checkpoints(model, tmp_path):  # noqa: F811
    """A sends 12 distinct 700-token prompts (6 at a time) into a 1 MiB memory tier (the tiny model's KV is 1 KiB a
    token: each of A's checkpoints pushes the one before out once LMDB holds it, the write-behind queue busy the
    whole time); B asks its 300-token prompt twice meanwhile. B's checkpoint is stored (its second request
    restores all but the last token). Counted, loosely: at most 8 of A's answers come while B asks twice (A has 6
    in flight at once: its 3 rows, 3 waiting, then the ones admitted round-robin beside B's second request; seen
    4-6)."""
    import concurrent.futures

    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--memory-bytes", "1M", "--max-rows", "4",
                 "--max-queue", "16")
    try:
        done: list = []

        def a_request(i: int) -> int:
            prompt = [5 + (i * 31 + j * 7) % 240 for j in range(700)]
            r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_A), timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            done.append(("a", time.perf_counter()))
            return r.status_code

        b_prompt = [9 + (j * 11) % 230 for j in range(300)]

        def b_request() -> dict:
            r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_B), timeout=120,
                           json={"model": "tiny", "prompt": b_prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            flood = [pool.submit(a_request, i) for i in range(12)]
            while len(done) < 2:
                time.sleep(0.01)
            sent = time.perf_counter()
            first = b_request()
            second = b_request()
            b_done = time.perf_counter()
            statuses = [f.result() for f in flood]
        assert set(statuses) <= {200, 429}, statuses
        ahead = sum(1 for _, t in done if sent < t < b_done)
        print(f"A's answers while B asked twice: {ahead} of {sum(1 for _, t in done if t > sent)}; "
              f"B cached {cached(first)}, then {cached(second)}")
        assert cached(second) == len(b_prompt) - 1  # B's checkpoint was stored, never refused
        assert ahead <= 8, ahead
        log = srv.log.read_text()
        assert "an engine step failed" not in log and "Traceback" not in log
    finally:
        srv.stop()


# -- cache-route calls: exports and imports of a large prefix beside another tenant's row ---------------------------
def test_export_and_import_loops_of_a_large_prefix_never_change_or_stop_another_tenants_row(model, tmp_path):  # noqa: F811
    """A exports its stored 1500-token prefix (1.5 MB) and imports it back under fresh salts in a loop while B's
    greedy row decodes: B's answer equals its answer alone, no call answers 5xx, and A's calls went on while B's
    row ran (they share the scheduler's thread with its rounds)."""
    import base64

    _, target, _ = model
    srv = Server(target, tmp_path / "store", tmp_path, "--max-body-bytes", "8M", "--max-rows", "4")
    try:
        prefix = [5 + (j * 7) % 240 for j in range(1500)]
        assert httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_A), timeout=60, json={
            "model": "tiny", "prompt": prefix + [9], "max_tokens": 1}).status_code == 200
        b_body = {"model": "tiny", "prompt": [6, 7, 8, 9, 10], "max_tokens": 120, "temperature": 0,
                  "ignore_eos": True}
        alone = httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_B), timeout=60,
                           json=dict(b_body, cache_salt="alone")).json()["choices"][0]["text"]
        calls: list = []
        stop = threading.Event()

        def loop() -> None:
            for n in range(40):
                if stop.is_set():
                    return
                r = httpx.post(srv.url + "/v1/cache/export", headers=srv.headers(KEY_A), json={"tokens": prefix},
                               timeout=60)
                calls.append(("export", r.status_code, time.perf_counter()))
                if r.status_code != 200:
                    continue
                r = httpx.post(srv.url + "/v1/cache/import", headers=srv.headers(KEY_A), timeout=60, json={
                    "tokens": prefix[: int(r.headers["X-Spec-Cache-Tokens"])], "cache_salt": f"imp-{n}",
                    "file": base64.b64encode(r.content).decode()})
                calls.append(("import", r.status_code, time.perf_counter()))

        attacker = threading.Thread(target=loop)
        attacker.start()
        while len(calls) < 2:
            time.sleep(0.01)
        began = time.perf_counter()
        during = httpx.post(srv.url + "/v1/completions", headers=srv.headers(KEY_B), timeout=120,
                            json=dict(b_body, cache_salt="during"))
        ended = time.perf_counter()
        stop.set()
        attacker.join(120)
        assert during.status_code == 200 and during.json()["choices"][0]["text"] == alone
        assert all(status < 500 for _, status, _ in calls), calls
        assert {status for kind, status, _ in calls if kind == "import"} == {200}, calls
        beside = sum(1 for _, _, t in calls if began < t < ended)
        print(f"A's cache calls answered during B's row: {beside} ({len(calls)} in all)")
        log = srv.log.read_text()
        assert "an engine step failed" not in log and "Traceback" not in log
    finally:
        srv.stop()
