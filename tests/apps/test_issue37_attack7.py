"""Issue 37, the seventh (confirming) attacker's pass: A (one API key) against B (another) on ``spec-cache serve``,
aimed at what the sixth pass added (the bounded namespace table, ``spec_cache.tiers.namespaces`` and
``SpecCache._forget_idle_namespaces``) and at surfaces the earlier passes did not try.

What broke, and is fixed:

* The scheduler kept every tenant's namespace key for good once it had served the tenant (``Scheduler._ns_keys``,
  one entry per API key and per ``cache_salt`` ever seen: a table the sixth pass did not bound) and never named the
  namespace again. So after A's fresh salts (each one ``GET /v1/cache/pins?cache_salt=...``, ~45 ms through
  ``serve`` here, or a salted request) pushed B's idle namespace out of ``SpecCache``'s table (1024) and out of the
  forgotten table behind it (another 1024), B's later requests never registered it again: B's bytes counted on the
  default tenant (``tenant_of`` b"", the memory tier's label gone) and, where B's LMDB row had been dropped as empty
  (A's salts landing while B's first request was still prefilling), every later checkpoint of B failed with
  ``NamespaceNotRegistered``: nothing of B reached LMDB again until a restart (a ``CacheWarning`` each time; after a
  restart B had nothing). Now the scheduler names the tenant's namespace on every job (``Generator.namespace_key``:
  a dict lookup when registered, one LMDB commit when it was forgotten), and its memo for ``held_prefix`` is bounded
  like the namespace table.

What held (measured on the 2-core box, tiny model, real ``serve``): 2300 of A's salted ``/v1/cache/pins`` calls
(103 s, 45 ms each: one fsync'd LMDB commit a new namespace) after B's first request left B's 300-token prefix
restorable (299 of 300, also after a restart: B's LMDB row holds an entry, so it is never dropped). 25 edge calls
of A, each a JSON answer in 25-40 ms, none 5xx, no traceback: ``/v1/cache/pin`` with ``ttl_s`` -1, 1e308 or "nan",
token ids 10**9 or -1, no tokens, ``tenant`` "open" or another label (400: only the operator may name a tenant);
``unpin`` by "../../x", by an int id, by B's tokens (404: A's namespace holds none); ``prefetch`` and ``export``
of B's exact stored 200-token prompt, also with ``cache_salt`` "" or null (``tokens: 0`` / 404: nothing crosses
keys); ``logprobs: 5, echo, n: 4`` (200); 5000 stop strings on ``/v1/completions`` and ``/v1/messages`` (422 /
400 at once), ``n: 200`` (422); a ``cache_salt`` on Anthropic routes (400, extra inputs refused). ``/metrics``
showed A only its own tenant label; B's greedy answer afterwards equal to its answer alone, its prefix restored
(199 of 200).

Left: a request whose namespace is forgotten twice over (``2 * max_namespaces`` fresh namespaces named by others)
between its naming and its first checkpoint still loses that checkpoint (a ``CacheWarning``); its next request
registers again. Through ``serve`` here that is 2048 of A's calls within one of B's prefills (~90 s at 45 ms).
Since fixed: the scheduler holds a job's namespace until the job ends (``tests/apps/test_issue37_held_namespaces.py``).
"""

from __future__ import annotations

import warnings

import pytest

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import namespace_key
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_template_seam import Events, _idle
from tests.runtime_fixtures import build_tiny

LIMIT = 8  # max_namespaces: small, so that A's churn is a few dozen names (1024 on a server)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("attack7"), drafters={}).root / "target"


def run(sched: Scheduler, cache: SpecCache, prompt: list[int], tenant: str, max_tokens: int = 3) -> Events:
    events = Events()
    sched.submit(Job(prompt=list(prompt), max_tokens=max_tokens, sampling=RowSampling(), deliver=events,
                     tenant=tenant))
    assert events.done.wait(60)
    _idle(sched)
    assert cache.drain(30)
    return events


def churn(generator: Generator, start: int, count: int) -> None:
    """A's fresh salts, named as ``/v1/cache/pins?cache_salt=...`` names them (``CacheRoutes.ns_key``)."""
    for i in range(start, start + count):
        generator.namespace_key("key-a|salt:%064x" % i)


def churning_scheduler(target, store, memory, limit: int = LIMIT) -> tuple[SpecCache, Scheduler, list]:
    """A cache of ``limit`` namespaces and a scheduler over it whose first ``prepare`` (B's first request, before
    its first checkpoint) is followed by A naming ``3 * limit`` fresh salts; the list returned is non-empty once A
    has. Not started."""
    cache = SpecCache.open(store, memory_bytes=memory, max_namespaces=limit)
    generator = Generator.load(target, None, cache=cache)
    sched = Scheduler(generator, max_rows=4)
    prepare = generator.prepare
    churned = []

    def prepare_then_churn(*args, **kwargs):  # A's calls between B's rounds, before B's first checkpoint
        prepared = prepare(*args, **kwargs)
        if not churned:
            churned.append(True)
            churn(generator, 0, 3 * limit)
        return prepared
    generator.prepare = prepare_then_churn
    return cache, sched, churned


@pytest.mark.parametrize("memory", [None, 0], ids=["memory-tier", "lmdb-only"])
def test_another_tenants_fresh_salts_never_leave_a_tenants_namespace_unregistered(target, tmp_path, memory):
    """B's first request is still prefilling (nothing of B stored yet) when A names 3 x ``max_namespaces`` fresh
    salts: B's namespace is forgotten, its empty LMDB row dropped, and the registration falls out of the forgotten
    table too, so that first checkpoint is lost (the residual in the module doc). B's *next* requests must be
    stored as ever, under B's own tenant label; before, the scheduler never named B's namespace again: every
    checkpoint of B failed (``NamespaceNotRegistered``), B's third request restored nothing, and nothing of B was in
    LMDB after a restart. Also between B's requests (B's LMDB row kept): B's label must come back."""
    prompt = list(range(3, 63))
    cache, sched, churned = churning_scheduler(target, tmp_path / "store", memory)
    generator = sched.generator
    sched.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the first checkpoint's CacheWarning (the residual)
            run(sched, cache, prompt, "key-b")
        b_key = namespace_key(generator.target_identity, generator.prefix_namespace, "key-b")  # not named here
        churn(generator, 1000, 3 * LIMIT)  # B idle: its namespace forgotten again (its row holds nothing yet)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(sched, cache, prompt + [70, 71], "key-b")
        assert not [w for w in caught if "not stored" in str(w.message)], [str(w.message) for w in caught]
        info = cache.store.namespace_info(b_key)
        assert info is not None and info.entries >= 1, "B's checkpoint never reached LMDB"
        assert run(sched, cache, prompt + [70, 71, 72], "key-b").cached >= len(prompt)
        churn(generator, 2000, 3 * LIMIT)  # B idle again; its row holds entries now, so it stays
        run(sched, cache, prompt + [80], "key-b")
        assert cache.tenant_of(b_key) != b"", "B's bytes count on the default tenant"
    finally:
        sched.stop(5)
        cache.close()
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        assert cache.store.lookup(b_key, prompt + [70, 71]) is not None
