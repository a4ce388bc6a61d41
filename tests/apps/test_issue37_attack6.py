"""Issue 37, the sixth (confirming) attacker's pass: the write-behind queue when it is full, and the surfaces the
first five passes did not try. Real ``spec-cache serve`` processes on 127.0.0.1 with two API keys (A attacks, B is
a normal user), and the tables in process.

What broke, and is fixed:

* A full write-behind queue was one queue for every tenant: once A's checkpoints filled it (``cap_bytes``) and the
  memory tier was over its budget (A's checkpoints waiting for LMDB cannot be evicted), B's next checkpoint was
  written inline on the caller's thread (the server's scheduler thread: every row waits on it), although B had
  nothing queued. Now a tenant within its share of the queue (cap / tenants with checkpoints queued) waits past
  the cap; the tenant over its share is the one written inline (as before for a tenant alone).

Found, then fixed (the last test): every distinct ``cache_salt`` registered a namespace that was never forgotten,
in process or in LMDB (outside the byte budget): A's salts grew both without bound, slowly (~830 bytes and one LMDB
commit a salt, one request of A each). Now at most ``max_namespaces`` (1024) tenant namespaces stay registered; the
least recently used idle ones are forgotten and their empty LMDB rows dropped (``spec_cache.tiers.namespaces``).

What held (measured while looking, on the 2-core box): through ``serve`` the queue never filled (default 1 GiB;
a 16-head tiny model's 9-32 MiB checkpoints of A peaked at 1 MiB queued: LMDB writes faster than this CPU
prefills); A's checkpoints larger than a 1 MiB memory tier are written on the scheduler's thread, as documented,
and B's 60 greedy tokens beside 24 of A's 600-token prompts took the same with that (4.8-5.3 s) as with a 512 MiB
tier where they queue (0.9-5.6 s), i.e. A's share of the compute, not its writes; stop strings at their bound
(4 x 256 characters) cost 73 us a token on the event loop; a flood of distinct prompts into a small store never
evicts B's stored prefix (asserted below).
"""

from __future__ import annotations

from spec_cache.tiers import write_behind
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_server import KEY_A, KEY_B, Server, model, stopped  # noqa: F401  (model: a fixture)
from tests.library.test_memory_tier import kv


# -- (a) the write-behind queue when it is full ---------------------------------------------------------------------
def test_a_tenant_that_filled_the_write_queue_pays_its_back_pressure_not_another_tenant(tmp_path, monkeypatch):
    """A's checkpoints fill the queue (cap 20 KB) and, waiting for LMDB, push the memory tier (60 KB) over its budget;
    B's one 6.4 KB checkpoint then waits in the queue (B holds none of it), while A's next one is still written on
    the caller's thread. Before: B's was written inline too (on a server, on the scheduler's thread). Nothing is
    dropped: every checkpoint is in LMDB after a drain."""
    monkeypatch.setattr(write_behind, "LINGER_S", 30.0)  # the writer holds on: nothing leaves the queue meanwhile
    with SpecCache.open(tmp_path / "store", memory_bytes=60_000, write_queue_bytes=20_000) as cache:
        ns_a = cache.namespace("ab" * 32, "prefix", "key-a")
        ns_b = cache.namespace("ab" * 32, "prefix", "key-b")
        assert cache.tenant_of(ns_a) != cache.tenant_of(ns_b)

        def save(ns, seed: int, n: int, layers: int) -> dict:
            tokens = [seed] + list(range(10, 10 + n - 1))
            assert cache.save(ns, tokens, [kv(n, seed=seed + i) for i in range(layers)], background=True) is None
            return dict(cache.memory_stats()["writes"])

        for seed in (1, 2):  # 28 KB each: past the cap, held by the memory tier meanwhile
            writes = save(ns_a, seed, 220, 2)
        assert writes["inline"] == 0 and writes["waited"] == 2
        writes = save(ns_a, 3, 220, 2)  # the tier is over its budget now: A alone writes inline, as before
        assert writes["inline"] == 1
        writes = save(ns_b, 4, 100, 1)  # B's first: within its share (10 KB of 20 KB)
        assert writes["inline"] == 1, "B's checkpoint was written on the caller's thread behind A's full queue"
        assert writes["waited"] == 3
        writes = save(ns_a, 5, 220, 2)  # A, over its share, still pays
        assert writes["inline"] == 2
        assert cache.drain(60)
        assert cache.memory_stats()["writes"]["written"] == 5
    with SpecCache.open(tmp_path / "store") as cache:
        ns_b = cache.namespace("ab" * 32, "prefix", "key-b")
        assert cache.store.lookup(ns_b, [4] + list(range(10, 109))) is not None


# -- what held: a flood of distinct prompts into a small store never evicts another tenant's prefix -------------
def test_a_flood_of_distinct_prompts_into_a_small_store_never_evicts_another_tenants_prefix(model, tmp_path):  # noqa: F811
    """A sends 40 distinct 700-token prompts (28 MB of KV, 6 at a time, under 5 salts) into an 8 MiB store with a
    1 MiB memory tier; B's 300-token prefix, stored before, is restored after the flood and after a restart (so
    from LMDB, not the memory tier): 299 of 300 cached each time."""
    import concurrent.futures

    import httpx

    _, target, _ = model
    args = ("--memory-bytes", "1M", "--max-bytes", "8M", "--max-rows", "4", "--max-queue", "16")

    def ask(srv, key: str, prompt: list[int], salt: str | None = None) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(key), timeout=120, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    b_prompt = [9 + (j * 11) % 230 for j in range(300)]
    srv = Server(target, tmp_path / "store", tmp_path, *args)
    try:
        assert ask(srv, KEY_B, b_prompt) == 0
        srv.wait_durable()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: ask(srv, KEY_A, [5 + (i * 31 + j * 7) % 240 for j in range(700)], f"s{i % 5}"),
                          range(40)))
        srv.wait_durable()
        assert ask(srv, KEY_B, b_prompt) == len(b_prompt) - 1
        assert "Traceback" not in srv.log.read_text()
    finally:
        stopped(srv)
    srv = Server(target, tmp_path / "store", tmp_path, *args)
    try:
        assert ask(srv, KEY_B, b_prompt) == len(b_prompt) - 1
    finally:
        stopped(srv)


# -- found, then fixed: every distinct cache_salt left a namespace for good ---------------------------------------
def test_distinct_cache_salts_never_grow_the_namespace_tables_without_bound(tmp_path):
    """Each request with a new ``cache_salt`` registers a namespace (``SpecCache.namespace``, as the server does for
    a salted tenant): one LMDB commit (0.46 ms here), ~460 bytes of Python heap in
    ``SpecCache``'s tables and ~370 bytes of LMDB rows outside the byte budget, kept for good. A's 3000 salts
    holding nothing should leave a bounded table (here: at most 1024 namespaces, the oldest empty ones forgotten).
    Measured through serve: 1500 requests of A with distinct salts grew the server's RSS by 51 MiB against 11 MiB
    with one salt (most of it the bounded memory tier), 12.8 vs 11.2 ms a request."""
    with SpecCache.open(tmp_path / "store", memory_bytes=1 << 20) as cache:
        first = cache.namespace("ab" * 32, "spec-cache/ngram:v1", "tenant-a|salt:%064x" % 0)
        for i in range(1, 3000):
            cache.namespace("ab" * 32, "spec-cache/ngram:v1", "tenant-a|salt:%064x" % i)
        assert cache.namespaces_held() <= 1024
        assert cache.store.namespace_info(first) is None
        with cache.store.reading() as txn:
            assert sum(1 for _ in txn.cursor(db=cache.store.env.dbs["nsinfo"])) <= 1024
