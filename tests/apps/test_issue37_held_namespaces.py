"""A running job's namespace is held (issue 37, the seventh pass's residual): the scheduler holds the namespace of
every job it has taken until that job ends (``SpecCache.hold`` / ``release``), so other tenants' fresh namespaces
never make ``SpecCache`` forget it while the job runs. Before, a request whose namespace was forgotten twice over
(``2 * max_namespaces`` fresh names of others between its naming and its first checkpoint) lost that checkpoint
(``NamespaceNotRegistered``, a ``CacheWarning``). And every way a job ends lets go of its hold, so an ended job's
namespace is forgettable again (the table stays bounded)."""

from __future__ import annotations

import threading
import warnings

import pytest

from spec_cache.apps.server.scheduler import Job, Scheduler
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import namespace_key
from spec_cache.rows.sampling import RowSampling
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_issue37_attack7 import churn, churning_scheduler
from tests.apps.test_server_scheduler import Events
from tests.apps.test_template_seam import _idle
from tests.runtime_fixtures import build_tiny

LIMIT = 8  # max_namespaces: small, so that another tenant's churn is a few dozen names


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("held"), drafters={}).root / "target"


def submit(sched: Scheduler, prompt: list[int], tenant: str, max_tokens: int = 3, **options) -> tuple[Job, Events]:
    events = Events()
    job = Job(prompt=list(prompt), max_tokens=max_tokens, sampling=RowSampling(), deliver=events, tenant=tenant,
              **options)
    sched.submit(job)
    return job, events


def key_of(generator: Generator, tenant: str) -> bytes:
    return namespace_key(generator.target_identity, generator.prefix_namespace, tenant)


@pytest.mark.parametrize("memory", [None, 0], ids=["memory-tier", "lmdb-only"])
def test_a_running_jobs_namespace_is_never_forgotten(target, tmp_path, memory):
    """B's first request is prefilling (nothing of B stored yet) when A names 3 x ``max_namespaces`` fresh salts,
    enough to push B's namespace out of the table and out of the forgotten table behind it. B's first checkpoint
    must still be stored, under B's own tenant label."""
    prompt = list(range(3, 63))
    cache, sched, churned = churning_scheduler(target, tmp_path / "store", memory, LIMIT)
    b_key = key_of(sched.generator, "key-b")
    sched.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, events = submit(sched, prompt, "key-b")
            assert events.done.wait(60) and events.items[-1][0] == "done"
            _idle(sched)
            assert cache.drain(30)
        assert churned
        assert not [w for w in caught if "not stored" in str(w.message)], [str(w.message) for w in caught]
        info = cache.store.namespace_info(b_key)
        assert info is not None and info.entries >= 1, "B's first checkpoint never reached LMDB"
        assert info.tenant_id is not None and cache.tenant_of(b_key) == info.tenant_id
    finally:
        sched.stop(5)
        cache.close()


def wait_tokens(events: Events, n: int = 1, timeout: float = 60) -> None:
    done = threading.Event()
    while len(events.tokens) < n:
        assert not events.done.is_set(), events.items
        assert timeout > 0, "no tokens came"
        done.wait(0.005)
        timeout -= 0.005


def test_every_way_a_job_ends_lets_go_of_its_namespace(target, tmp_path):
    """Finished, cancelled while waiting and while decoding (client gone), finished by a stop string, refused by the
    engine, answered from the retry table, and still in at shutdown: no hold is left, and each namespace is
    forgotten by the next churn (LMDB only, so the memory tier holds nothing of them)."""
    cache = SpecCache.open(tmp_path / "store", memory_bytes=0, max_namespaces=LIMIT)
    generator = Generator.load(target, None, cache=cache)
    sched = Scheduler(generator, max_rows=1, max_queue=8)
    sched.start()
    tenants = []

    def tenant(name: str) -> str:
        tenants.append(name)
        return name
    try:
        _, done = submit(sched, range(3, 23), tenant("finished"))
        assert done.done.wait(60) and done.items[-1][:2] == ("done", "length")
        long_job, long_events = submit(sched, range(30, 50), tenant("cancelled"), max_tokens=4000)
        waiting, waiting_events = submit(sched, range(60, 80), tenant("cancelled-waiting"))
        wait_tokens(long_events)
        assert cache._namespaces.held(key_of(generator, "cancelled-waiting"))  # queued behind the long row
        sched.cancel(waiting)
        sched.cancel(long_job)
        assert long_events.done.wait(60) and long_events.items[-1][1] == "cancelled"
        assert waiting_events.done.wait(60) and waiting_events.items[-1][1] == "cancelled"
        stopped, stopped_events = submit(sched, range(90, 110), tenant("stopped"), max_tokens=4000)
        wait_tokens(stopped_events)
        sched.finish(stopped)  # a stop string matched
        assert stopped_events.done.wait(60) and stopped_events.items[-1][0] == "done"
        _, refused = submit(sched, [], tenant("refused"))  # the engine refuses an empty prompt
        assert refused.done.wait(60) and refused.items[-1][0] == "error", refused.items
        _, first = submit(sched, range(120, 140), tenant("replayed"), replayable=True)
        assert first.done.wait(60)
        _idle(sched)
        _, again = submit(sched, range(120, 140), tenant("replayed"), replayable=True)  # from the retry table
        assert again.done.wait(60) and again.tokens == first.tokens
        _idle(sched)
        assert cache.drain(30)
        assert not cache._namespaces.holds(), "a job that ended still holds its namespace"
        running, running_events = submit(sched, range(150, 170), tenant("at-shutdown"), max_tokens=4000)
        _, queued_events = submit(sched, range(180, 200), tenant("queued-at-shutdown"))
        wait_tokens(running_events)
    finally:
        sched.stop(0)
        assert not cache._namespaces.holds(), "a job in at shutdown still holds its namespace"
        churn(generator, 0, 3 * LIMIT)
        for name in tenants:
            assert key_of(generator, name) not in cache._namespaces, f"{name}'s namespace was never let go"
        cache.close()
