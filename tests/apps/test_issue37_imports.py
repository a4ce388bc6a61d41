"""Issue 37 items 1-4 and 6 on a real ``spec-cache serve``: one tenant can never hurt another through the cache.

One server (two API keys, an operator key, ``--cached-tokens-granularity 16``, a 256 KB memory tier, 512 KB of
LMDB): an import that does not fit the model is a JSON 400 and leaves nothing a later request restores (item 1; an
offset of None or inf, a deeply nested token list: item 6); an API key imports only into a salted namespace of its
own, the operator key into shared ones (item 4); pins, prefetch and export tell a probing caller no more than
``cached_tokens`` does (item 3). Item 2 (one tenant's pins cannot make LMDB's budget evict another tenant) runs a
server of its own, with a memory tier larger than LMDB.
"""

from __future__ import annotations

import base64
import json
import signal

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache, save_prompt_cache

from spec_cache.rows.target import TargetModel
from tests.apps.test_server import KEY_A, KEY_B, OPERATOR, Server, model  # noqa: F401  (model: a fixture)

GRANULARITY = 16


def prompt(seed: int, n: int = 64) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(4 + seed % 200)] + [int(t) for t in rng.integers(4, 250, n - 1)]


def post(srv: Server, path: str, key: str | None = KEY_A, **body) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def complete(srv: Server, tokens: list[int], key: str = KEY_A, **extra) -> dict:
    r = post(srv, "/v1/completions", key, model="tiny", prompt=tokens, max_tokens=2, temperature=0, **extra)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    _, target, _ = model
    tmp = tmp_path_factory.mktemp("issue37")
    srv = Server(target, tmp / "store", tmp, "--memory-bytes", "256K", "--max-bytes", "512K", "--max-pin-ttl", "60",
                 "--max-body-bytes", "2000000", granularity=str(GRANULARITY))
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log.read_text(), srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def target_model(model):
    return TargetModel.load(model[1])


def file_b64(caches, tmp_path, metadata=None) -> str:
    path = tmp_path / "f.safetensors"
    save_prompt_cache(str(path), caches, metadata or {})
    return base64.b64encode(path.read_bytes()).decode()


def made(target_model, tokens) -> list:
    caches = make_prompt_cache(target_model.model)
    target_model.model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


# -- item 1 and item 6: a bad import is a JSON 4xx and leaves no trace ---------------------------------------------
def test_imports_that_do_not_fit_are_json_400s_and_nothing_is_restored(server, target_model, tmp_path):
    tokens = prompt(1, 32)

    def values_dim(c):
        c[1] = KVCache()
        c[1].state = (mx.zeros((1, 1, 32, 64)), mx.zeros((1, 1, 32, 32)), 32)

    def values_len(c):
        c[1] = KVCache()
        c[1].state = (mx.zeros((1, 1, 32, 64)), mx.zeros((1, 1, 8, 64)), 32)

    def offset_none(c):
        c[0].offset = None

    def offset_inf(c):
        c[1].offset = float("inf")

    for damage in (values_dim, values_len, offset_none, offset_inf):
        caches = made(target_model, tokens)
        damage(caches)
        r = post(server, "/v1/cache/import", tokens=tokens, file=file_b64(caches, tmp_path), cache_salt="up")
        error_of(r, 400, "invalid_prefix_file")
        got = post(server, "/v1/cache/prefetch", tokens=tokens, cache_salt="up").json()
        assert got["tokens"] == 0 and got["tier"] is None, (damage.__name__, got)
    nested = file_b64(made(target_model, tokens), tmp_path, {"spec_cache_tokens": "[" * 5000 + "]" * 5000})
    error_of(post(server, "/v1/cache/import", file=nested, cache_salt="up"), 400, "invalid_prefix_file")
    # the other tenant's requests never see any of it, and the server still answers
    assert complete(server, tokens + [5], KEY_B)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- item 4: imports that could serve other callers need the operator key -------------------------------------------
def test_an_api_key_imports_only_into_a_salted_namespace_of_its_own(server, target_model, tmp_path):
    tokens = prompt(2, 32)
    data = file_b64(made(target_model, tokens), tmp_path)
    error_of(post(server, "/v1/cache/import", tokens=tokens, file=data), 403, "operator_key_required")
    assert post(server, "/v1/cache/prefetch", tokens=tokens).json()["tokens"] == 0  # nothing went in
    assert post(server, "/v1/cache/import", tokens=tokens, file=data, cache_salt="own").status_code == 200
    details = complete(server, tokens + [5], cache_salt="own")["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == 32
    assert complete(server, tokens + [5])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # unsalted: none
    r = post(server, "/v1/cache/import", OPERATOR, tokens=tokens, file=data)  # the keyless namespace
    assert r.status_code == 200, r.text


# -- item 3: no route tells more than cached_tokens -------------------------------------------------------------------
def test_a_probe_loop_cannot_learn_a_stored_prompt_token_by_token(server):
    """B's 'secret' prompt is stored; a caller with the same key knows its first 16 tokens and guesses the 17th.
    Every cache route must answer the right guess exactly as the wrong ones (``cached_tokens`` says 16 for all)."""
    secret = prompt(3, 40)
    complete(server, secret, KEY_B)
    server.wait_durable()
    known, right = secret[:GRANULARITY], secret[GRANULARITY]
    answers = []
    for guess in (right, (right + 1) % 250 + 4, (right + 2) % 250 + 4):
        probe = known + [guess] + [3, 3, 3]
        pin = post(server, "/v1/cache/pin", KEY_B, tokens=probe, ttl_s=5).json()
        listed = sorted(json.dumps(p, sort_keys=True) for p in httpx.get(
            server.url + "/v1/cache/pins", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=10).json()["data"]
            )
        prefetch = post(server, "/v1/cache/prefetch", KEY_B, tokens=probe).json()
        export = post(server, "/v1/cache/export", KEY_B, tokens=probe)
        cached = complete(server, probe, KEY_B)["usage"]["prompt_tokens_details"]["cached_tokens"]
        answers.append((pin.get("id"), pin.get("tokens"), pin.get("bytes"), len(listed), prefetch["tokens"],
                        prefetch["tier"] is None, export.headers.get("x-spec-cache-tokens"), len(export.content),
                        cached))
    assert answers[0][1] == GRANULARITY and answers[0][-1] == GRANULARITY
    assert len(set(answers)) == 1, [list(zip(a, answers[0])) for a in answers]


# -- item 2: pins count against the caller's share -------------------------------------------------------------------
def test_one_tenants_pins_cannot_make_the_budget_evict_another_tenant(model, tmp_path):
    """A pins everything it may, then keeps writing; B's one prompt (far within its share) stays in LMDB: after a
    restart (pins end with their process, the memory tier starts empty) B's prefetch restores it from LMDB. The
    memory tier (2 MB) is larger than LMDB (512 KB): half of it was the only pin limit, so A could pin all of LMDB."""
    _, target, _ = model
    options = ("--memory-bytes", "2M", "--max-bytes", "512K", "--max-pin-ttl", "60")
    srv = Server(target, tmp_path / "store", tmp_path, *options)
    kept = prompt(40)
    try:
        complete(srv, kept, KEY_B)
        srv.wait_durable()
        refused = 0
        for seed in range(50, 60):
            tokens = prompt(seed)
            complete(srv, tokens, KEY_A)
            srv.wait_durable()
            r = post(srv, "/v1/cache/pin", KEY_A, tokens=tokens, ttl_s=60)
            if r.status_code == 409:
                error_of(r, 409, "pin_quota_exceeded")
                refused += 1
            else:
                assert r.status_code == 200, r.text
        pinned = sum(p["bytes"] for p in httpx.get(srv.url + "/v1/cache/pins", timeout=10,
                                                   headers={"Authorization": f"Bearer {KEY_A}"}).json()["data"])
    finally:
        srv.stop()
    srv = Server(target, tmp_path / "store", tmp_path, *options)
    try:
        got = post(srv, "/v1/cache/prefetch", KEY_B, tokens=kept).json()
    finally:
        srv.stop()
    assert got["tier"] == "local" and got["tokens"] >= len(kept) - 1, got
    assert refused > 0 and pinned <= 512 * 1024 // 2  # A's pins stopped at its share (512 KB / 2 keys)
