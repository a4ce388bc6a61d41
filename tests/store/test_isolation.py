"""Isolation between tenants and namespaces, and the store's file permissions.

A namespace key is a hash of (target identity, prefix namespace, tenant salt), and every store key below it
(chain roots, chunks, entries, drafter parts) is derived from it. So two distinct combinations never share a
key, and a tenant can observe nothing of another tenant's entries: not through lookups or fetches, not through
the counters of its own namespace, not through what its own puts report (no chunk is shared across tenants).
Timing is measured by ``tools/faults/timing.py`` (reported in RELIABILITY.md); here only the answers are checked.
"""

from __future__ import annotations

import os
import random
import stat

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.naming.namespace import namespace_key
from spec_cache.store import LayerState, Store, Tensor, maintenance
from tools.faults import timing

HEX = "0123456789abcdef"


def _normal(target: str, prefix: str, tenant) -> tuple:
    """What a namespace key stands for: a str tenant is its UTF-8 bytes; None (shared) is not b""."""
    return (target, prefix, None if tenant is None else (tenant.encode() if isinstance(tenant, str) else bytes(tenant)))


def _adversarial_triples(rnd: random.Random, n: int) -> list[tuple]:
    """Random triples, many built to collide under a naive concatenation: shifted boundaries between prefix and
    tenant, separators and NULs inside strings, empty vs missing tenants, str vs bytes tenants."""
    targets = ["".join(rnd.choice(HEX) for _ in range(64)) for _ in range(40)] + ["0" * 64, "f" * 64]
    pieces = ["", "a", "b", "ab", "\x00", '{"method":null,"adapters":""}', "tenant", "+", "@", "é", "\u2028",
              "adapter@rev", '"', ",", "\x01" * 3]
    out = []
    for _ in range(n):
        whole = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 4)))
        cut = rnd.randint(0, len(whole))
        prefix, tail = whole[:cut], whole[cut:]
        r = rnd.random()
        if r < 0.2:
            tenant = None
        elif r < 0.3:
            tenant = ""
        elif r < 0.6:
            tenant = tail
        elif r < 0.8:
            tenant = tail.encode()
        else:
            tenant = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 12)))
        out.append((rnd.choice(targets), prefix, tenant))
    return out


def test_no_two_distinct_combinations_share_a_key():
    """10 000 random (target, prefix namespace, tenant) cases: equal keys exactly when the triples are equal."""
    seen: dict[bytes, tuple] = {}
    triples = _adversarial_triples(random.Random(6), 10_000)
    for target, prefix, tenant in triples:
        key = namespace_key(target, prefix, tenant)
        normal = _normal(target, prefix, tenant)
        assert seen.setdefault(key, normal) == normal, f"{normal} and {seen[key]} share a key"
    distinct = {_normal(*t) for t in triples}
    assert len(seen) == len(distinct) > 5_000  # many repeats too: equal triples gave equal keys


@settings(max_examples=300, deadline=None)
@given(st.tuples(st.sampled_from(["a" * 64, "b" * 64]), st.text(max_size=12),
                 st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=8))),
       st.tuples(st.sampled_from(["a" * 64, "b" * 64]), st.text(max_size=12),
                 st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=8))))
def test_keys_are_equal_exactly_when_the_combinations_are(one, two):
    assert (namespace_key(*one) == namespace_key(*two)) == (_normal(*one) == _normal(*two))


# --- tenants in one store -----------------------------------------------------------------------------------------
TARGET, PREFIX = "c" * 64, '{"method":null,"adapters":""}'
NS_A = namespace_key(TARGET, PREFIX, "tenant-a")
NS_B = namespace_key(TARGET, PREFIX, "tenant-b")
NS_SHARED = namespace_key(TARGET, PREFIX, None)


def layers(tokens) -> list[LayerState]:
    t = np.asarray(tokens, np.float32)[None, None, :, None] * np.ones((1, 2, 1, 4), np.float32)
    return [LayerState("kv", {}, [Tensor.from_numpy(t), Tensor.from_numpy(-t)], token_axis=2)]


def _open(path) -> Store:
    store = Store.open(path, chunk_tokens=4, durable=False)
    for ns in (NS_A, NS_B, NS_SHARED):
        store.register_namespace(ns, target=TARGET, prefix_namespace=PREFIX, tenant=ns != NS_SHARED)
    return store


def _b_view(store: Store, queries, own) -> list:
    """Everything tenant B can observe: its puts' results, its lookups and fetches, its namespace's row."""
    seen = []
    for tokens in own:
        r = store.put(NS_B, tokens, layers(tokens))
        seen.append(("put", r.bytes_written, r.new_chunks, r.evicted))
    for tokens in queries:
        hit = store.lookup(NS_B, tokens)
        notes: list[str] = []
        restored = store.fetch(NS_B, tokens, warnings=notes)
        seen.append(("get", None if hit is None else (hit.length, hit.has_drafter),
                     None if restored is None else restored.length, tuple(notes)))
    store.flush()
    row = next(n for n in maintenance.namespaces(store) if n["key"] == NS_B.hex())
    seen.append(("row", row["entries"], row["bytes"], row["hits"], row["misses"]))
    return seen


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=13), min_size=1, max_size=5),
       st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=13), max_size=3))
def test_a_tenant_sees_nothing_of_another_tenants_entries(tmp_path_factory, a_prompts, b_prompts):
    """B's view is identical whether or not A stored the very prompts B asks for, and A's row is untouched."""
    with_a = _open(tmp_path_factory.mktemp("with"))
    without_a = _open(tmp_path_factory.mktemp("without"))
    try:
        for tokens in a_prompts:
            with_a.put(NS_A, tokens, layers(tokens))
        with_a.flush()
        a_row = next(n for n in maintenance.namespaces(with_a) if n["key"] == NS_A.hex())
        queries = a_prompts + [t + [9] for t in a_prompts]
        view_with = _b_view(with_a, queries, b_prompts)
        view_without = _b_view(without_a, queries, b_prompts)
        assert view_with == view_without
        if not b_prompts:  # B has nothing of its own: every one of its lookups is a miss
            assert all(item[1] is None and item[2] is None for item in view_with if item[0] == "get")
        a_after = next(n for n in maintenance.namespaces(with_a) if n["key"] == NS_A.hex())
        assert (a_after["hits"], a_after["misses"], a_after["entries"]) == (a_row["hits"], a_row["misses"],
                                                                          a_row["entries"])
    finally:
        with_a.close()
        without_a.close()


def test_tenants_share_no_records(tmp_path):
    """Identical tokens and state under two tenants (and the shared namespace) are stored three times: no chunk
    is deduplicated across them, so a put's new_chunks reveals nothing about the other tenants."""
    tokens = list(range(14))
    with _open(tmp_path / "s") as store:
        results = [store.put(ns, tokens, layers(tokens)) for ns in (NS_A, NS_B, NS_SHARED)]
        assert len({r.entry for r in results}) == 3
        assert [r.new_chunks for r in results] == [3, 3, 3]
        assert maintenance.stats(store)["chunks"] == 9
        for ns in (NS_A, NS_B, NS_SHARED):
            assert store.fetch(ns, tokens).length == 14


def test_the_shared_namespace_is_not_the_empty_tenant():
    assert namespace_key(TARGET, PREFIX, None) != namespace_key(TARGET, PREFIX, "")
    assert namespace_key(TARGET, PREFIX, "x") == namespace_key(TARGET, PREFIX, b"x")
    assert namespace_key(TARGET, PREFIX + "x", None) != namespace_key(TARGET, PREFIX, "x")


def test_a_miss_is_a_miss_whatever_other_tenants_hold():
    """The timing harness's answers (not its times): tenant B misses in every store, same or other content."""
    result = timing.run(samples=200, prompts=20, length=300)
    assert result["failures"] == []
    assert result["lookup_ks_same_vs_other"] >= 0  # a measurement, reported in RELIABILITY.md; not asserted


# --- permissions ---------------------------------------------------------------------------------------------------
def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_store_directory_is_0700_and_files_0600_under_any_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with Store.open(tmp_path / "store", durable=False) as store:
            store.register_namespace(NS_A, target=TARGET, prefix_namespace=PREFIX, tenant=True)
            store.put(NS_A, [1, 2, 3], layers([1, 2, 3]))
    finally:
        os.umask(old)
    assert _mode(tmp_path / "store") == 0o700
    names = sorted(os.listdir(tmp_path / "store"))
    assert {"data.mdb", "lock.mdb"} <= set(names)
    for name in names:
        assert _mode(tmp_path / "store" / name) == 0o600, name


def test_existing_loose_permissions_are_tightened(tmp_path):
    path = tmp_path / "store"
    with Store.open(path, durable=False):
        pass
    os.chmod(path, 0o755)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(path / name, 0o644)
    with Store.open(path, durable=False):
        pass
    assert _mode(path) == 0o700
    assert _mode(path / "data.mdb") == 0o600 and _mode(path / "lock.mdb") == 0o600
