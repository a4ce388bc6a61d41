"""The shared tier's diagnostics and signature sets (issue 37 item 9), against a real Redis server.

Found: ``spec-cache shared-stats`` ignored ``--shared-secret-file`` (it read the unkeyed ``sc:1:`` prefix and
reported 0 published for a keyed fleet), so a host whose secret is wrong (which silently misses) could not be
diagnosed; and 100 garbage members in a namespace's signature set hid that namespace from every host for good
(lookups took the first 16 members in byte order). Now shared-stats reads the prefix of the secret it is given and
names a mismatch (exit 1); signature set members are authenticated under a fleet secret, forged ones ignored and
pruned, and the set is trimmed on write.
"""

from __future__ import annotations

import json
import os

import pytest
import redis

from spec_cache.store.shared.lookup import MAX_SIGNATURES
from spec_cache.store.shared.publish import SIG_SET_CAP
from tests.redis_servers import ThrowawayServer, server_binaries
from tests.store.test_shared_auth import hosts  # noqa: F401  (fixture)
from tests.store.test_shared_tier import PREFIX_NS, SECRET, TARGET, assert_holds, prompt, run_cli, save

BINARIES = server_binaries()
pytestmark = pytest.mark.skipif(not BINARIES, reason="no redis-server or valkey-server binary installed")
BINARY = BINARIES.get("redis") or next(iter(BINARIES.values()), None)
OTHER_SECRET = "another fleet's secret, 32 bytes"


@pytest.fixture(scope="module")
def module_server():
    with ThrowawayServer(BINARY) as server:
        yield server


@pytest.fixture
def server(module_server, monkeypatch):
    redis.Redis.from_url(module_server.url).flushall()
    for name in ("SPEC_CACHE_SHARED_SECRET", "SPEC_CACHE_SHARED_TRUSTED", "SPEC_CACHE_SHARED"):
        monkeypatch.delenv(name, raising=False)
    return module_server


def _secret_file(tmp_path, name, secret):
    path = tmp_path / name
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return str(path)


def test_shared_stats_reads_the_keyed_prefix_and_names_a_secret_mismatch(server, hosts, tmp_path, capsys):  # noqa: F811
    a = hosts("a", server.url, secret=SECRET)
    save(a, a.namespace(TARGET, PREFIX_NS), prompt(37, 40))
    assert a.shared.drain(10)
    good, wrong = _secret_file(tmp_path, "good", SECRET), _secret_file(tmp_path, "wrong", OTHER_SECRET)

    rc, out = run_cli(["shared-stats", "--shared", server.url, "--shared-secret-file", good, "--json"], capsys)
    d = json.loads(out)
    assert (rc, d["prefix"], d["published_checkpoints"], d["problems"]) == (0, "sc:3:", 1, [])

    # a host holding another secret: its names are other names, it misses silently; shared-stats says why
    rc, out = run_cli(["shared-stats", "--shared", server.url, "--shared-secret-file", wrong], capsys)
    assert rc == 1 and out.count("secret mismatch?") == 1, out
    problem = next(line for line in out.splitlines() if "secret mismatch?" in line)
    assert "another fleet secret" in problem and SECRET not in out and OTHER_SECRET not in out

    # no secret at all: the unkeyed prefix is empty, the keyed one is not
    rc, out = run_cli(["shared-stats", "--shared", server.url, "--json"], capsys)
    d = json.loads(out)
    assert rc == 1 and d["prefix"] == "sc:1:" and len(d["problems"]) == 1
    assert "secret mismatch?" in d["problems"][0] and "sc:3:" in d["problems"][0]

    # once the wrong host publishes, a good host's shared-stats sees a second secret in its fleet
    b = hosts("b", server.url, secret=OTHER_SECRET)
    save(b, b.namespace(TARGET, PREFIX_NS), prompt(38, 40))
    assert b.shared.drain(10)
    rc, out = run_cli(["shared-stats", "--shared", server.url, "--shared-secret-file", good, "--json"], capsys)
    d = json.loads(out)
    assert rc == 1 and len(d["problems"]) == 1 and "another fleet secret" in d["problems"][0]


def _sigs_key(url: str) -> bytes:
    (key,) = redis.Redis.from_url(url).scan_iter(match="sc:3:sigs:*")
    return key


def test_garbage_signature_members_cost_at_most_a_miss(server, hosts):  # noqa: F811
    a = hosts("a", server.url, secret=SECRET)
    ns = a.namespace(TARGET, PREFIX_NS)
    p = prompt(39, 40)
    save(a, ns, p)
    assert a.shared.drain(10)
    r = redis.Redis.from_url(server.url)
    key = _sigs_key(server.url)
    (genuine,) = r.smembers(key)
    # 100 members sorting before any genuine one, bare and shaped like authenticated members
    garbage = [bytes([0, i]) + os.urandom(24) for i in range(50)] + [bytes([1, i]) for i in range(50)]
    r.sadd(key, *garbage)

    b = hosts("b", server.url, secret=SECRET)  # a host that never saw the namespace
    hit = b.restore(b.namespace(TARGET, PREFIX_NS), p + [1])
    assert hit is not None and hit.tier == "shared" and hit.length == 40
    assert_holds(hit, p)
    left = r.smembers(key)
    assert genuine in left and not any(g in left for g in garbage if g[:1] == b"\x00")  # forged ones pruned

    # a flood of members is trimmed by the next publish: the set stays bounded
    r.sadd(key, *[b"\x00" + os.urandom(40) for _ in range(3 * SIG_SET_CAP)],
           *[b"\x92" + os.urandom(20) for _ in range(3 * SIG_SET_CAP)])
    save(a, ns, prompt(40, 48))
    assert a.shared.drain(10)
    left = r.smembers(key)
    assert genuine in left and len(left) <= SIG_SET_CAP
    c = hosts("c", server.url, secret=SECRET)
    assert c.restore(c.namespace(TARGET, PREFIX_NS), p + [1]).length == 40
    assert MAX_SIGNATURES < SIG_SET_CAP
