"""Fault injection, in quick form: each harness of ``tools/faults`` (crash, corruption, concurrency, space,
hostile input) at a small trial count, plus one deterministic test per failure those harnesses found and the
store now handles. The full runs and their figures are in RELIABILITY.md.

The promise under test: a cache may miss; it never returns wrong state, never loses a committed checkpoint,
never takes the inference engine down (only typed ``StoreError``s leave the store, never a crash).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from spec_cache.schemas import CheckpointAttachment, SchemaError
from spec_cache.schemas.names import GEMMA_ASSISTANT_V1, NGRAM_HISTORY_V1
from spec_cache.store import LayerState, Store, StoreError, StoreFullError, StoreOpenError, Tensor, maintenance
from spec_cache.store.index import Index
from spec_cache.store.repair import repair
from tools.faults import concurrency, corruption, crash, hostile, space
from tools.faults import workload as W

REPO = Path(__file__).resolve().parents[2]


# --- the harnesses, quick -----------------------------------------------------------------------------------------
def test_crash_quick(tmp_path):
    result = crash.run(5, seed=11, epoch=5, max_run_s=0.8, workdir=str(tmp_path))
    assert result["failures"] == []
    assert result["trials"] == 5 and result["puts_committed"] > 0 and result["committed_checked"] > 0


def test_corruption_quick(tmp_path):
    result = corruption.run(30, seed=5, workdir=str(tmp_path))
    assert result["failures"] == []
    assert result["fetches_wrong"] == 0 and result["fetches_exact"] > 0
    assert not {"crash", "untyped", "hang", "wrong"} & set(result["outcomes"])
    assert result["outcomes"].get("detected", 0) > 0  # the damage was real and noticed


def test_concurrency_quick(tmp_path):
    result = concurrency.run(8, seed=3, hold_every_s=2.5, writer_kill_every_s=2, workdir=str(tmp_path),
                             roles=("writer", "mixed", "operator"))
    assert result["failures"] == []
    assert result["holders_killed"] >= 1 and result["writers_killed"] >= 1 and result["puts"] > 20


def test_space_quick(tmp_path):
    scenarios = ("map", "map-pinned", "rlimit") + (("tmpfs",) if space.can_mount_tmpfs() else ())
    result = space.run(120, seed=2, scenarios=scenarios, workdir=str(tmp_path))
    assert result["failures"] == []
    assert result["map-pinned"]["puts_full"] > 0  # refused cleanly once nothing could be evicted


def test_hostile_quick():
    result = hostile.run(2000, seed=4)
    assert result["failures"] == []
    assert result["max_peak_mib"] < 32


# --- deterministic forms of what the harnesses found ----------------------------------------------------------------
@pytest.fixture
def filled(tmp_path):
    """A closed store holding a few workload checkpoints (all three structures, drafter parts)."""
    path = tmp_path / "store"
    specs = [W.Spec(ns, f, n) for ns in range(3) for f in range(2) for n in (31, 60, 64)]
    with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
        W.register(store)
        for spec in specs:
            W.put_spec(store, spec)
    return path, specs


def _fetch_all(store, specs) -> list[str]:
    """Fetch every spec; returns the wrong answers (there must be none)."""
    wrong = []
    for spec in specs:
        why = W.check(store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER), spec)
        if why:
            wrong.append(f"{spec.name()}: {why}")
    return wrong


def _in_child(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_truncated_file_is_refused_not_a_sigbus(filled):
    """Found: opening a truncated data.mdb died with SIGBUS on the first page past its end (every trial)."""
    path, _ = filled
    os.truncate(path / "data.mdb", os.path.getsize(path / "data.mdb") // 2)
    out = _in_child("""
        import sys
        from spec_cache.store import Store, StoreOpenError
        try:
            Store.open(sys.argv[1])
        except StoreOpenError as exc:
            print("refused:", exc)
    """, path)
    assert out.returncode == 0, out.stderr
    assert "truncated" in out.stdout
    cli = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(path), "stats"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and len(cli.stderr.splitlines()) == 1 and "truncated" in cli.stderr


def test_a_record_under_another_key_is_never_served(filled):
    """Found: two entry records of equal size and equal tail tokens (different prefixes) swapped between their
    keys were served as each other's state. Records now name their key; a swapped one is corrupt."""
    path, specs = filled
    with Store.open(path, durable=False) as store:
        a, b = W.Spec(0, 0, 60), W.Spec(2, 1, 60)  # both "small"; tails are the common run: identical tokens
        ka, kb = store.lookup(a.ns_key, a.tokens).entry, store.lookup(b.ns_key, b.tokens).entry

        def swap(txn):
            db = store.env.dbs["edata"]
            ra, rb = bytes(txn.get(ka, db=db)), bytes(txn.get(kb, db=db))
            assert len(ra) == len(rb)
            txn.put(ka, rb, db=db)
            txn.put(kb, ra, db=db)
        store.env.write(swap)
        assert maintenance.verify(store).corrupt == 2
        for spec in (a, b):
            notes: list[str] = []
            restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER, warnings=notes)
            assert W.check(restored, spec) is None
            assert restored is None or restored.length < spec.length
            assert any("another key" in n for n in notes)
        assert _fetch_all(store, specs) == []


DAMAGE = {
    "undecodable": lambda v: b"\xc1" + v[1:],
    "truncated": lambda v: v[: len(v) // 2],
    "wrong type": lambda v: msgpack.packb([1, 2, 3]),
    "field of wrong type": lambda v: msgpack.packb({k: ({"ns": "x", "target": 5}.get(k, x)) for k, x in
                                                    msgpack.unpackb(v, strict_map_key=False).items()},
                                                   use_bin_type=True),
    "field missing": lambda v: msgpack.packb({k: x for k, x in msgpack.unpackb(v, strict_map_key=False).items()
                                              if k not in ("tails", "drafters", "sigs", "bytes")}, use_bin_type=True),
}


@pytest.mark.parametrize("db", ["nodes", "entries", "nsinfo"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_index_values_are_typed_errors_and_gc_repairs_them(filled, db, damage):
    """Found: a damaged node, entry or namespace value escaped as KeyError, TypeError, ValueError or
    UnicodeDecodeError from deep inside a lookup. Now: CorruptIndex (a StoreError, so the runtime misses), and
    gc removes it and rebuilds the bookkeeping."""
    path, specs = filled
    with Store.open(path, durable=False) as store:
        def hurt(txn):
            for key, value in list(txn.cursor(db=store.env.dbs[db]))[:3]:
                txn.put(bytes(key), DAMAGE[damage](bytes(value)), db=store.env.dbs[db])
        store.env.write(hurt)
        for spec in specs:
            try:
                W.check(store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER), spec) is None or \
                    pytest.fail(f"wrong state for {spec.name()}")
                W.put_spec(store, spec)
            except StoreError:
                pass  # typed: the runtime treats it as a miss / an unstored checkpoint
        assert maintenance.verify(store).index_problems
        report = maintenance.gc(store)
        assert report.index_rows_removed >= 1
        after = maintenance.verify(store)
        assert (after.corrupt, after.index_problems) == (0, [])
        assert _fetch_all(store, specs) == []
        W.register(store)  # a rebuilt namespace row learns again what it stands for
        assert {n["target"] for n in maintenance.namespaces(store)} == {W.TARGET_A, W.TARGET_B}
        for spec in specs:  # writable again, every checkpoint storable and served exactly
            W.put_spec(store, spec)
        assert all(store.fetch(s.ns_key, s.tokens).length == s.length for s in specs)


def test_a_flipped_complete_flag_never_serves_partial_state(filled):
    """An index flip that marks a chunk boundary usable for a checkpoint with an untrimmable layer would serve
    its KV without the ring layer; the chunk record says whether its checkpoint was complete."""
    path, _ = filled
    spec = W.Spec(0, 2, 60)  # "mixed": KV + an untrimmable ring layer
    assert spec.structure == "mixed"
    with Store.open(path, chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
        W.put_spec(store, spec)
        chain = store.lookup(spec.ns_key, spec.tokens).chain

        def flip(txn):
            ix = Index(txn, store.env.dbs)
            for key in chain[1:]:
                node = ix.get("nodes", key)
                node["complete"] = True
                ix.put("nodes", key, node)
        store.env.write(flip)
        longer = W.Spec(0, 2, 70)  # asks past the entry: only the (flipped) chunk boundary at 64 could serve
        notes: list[str] = []
        restored = store.fetch(longer.ns_key, longer.tokens, warnings=notes)
        assert W.check(restored, longer) is None
        assert restored is None or restored.length == 60


def test_lmdb_page_damage_is_a_store_error_and_repair_salvages(filled, tmp_path):
    """Found: a zeroed B-tree page made liblmdb abort (assert in mdb_cursor_next) inside `spec-cache verify`.
    Now verify checks the page structure first (pure Python) and walks nothing on a damaged file; reads that
    meet a damaged page raise StoreError; gc refuses; repair copies out what still reads back whole."""
    path, specs = filled
    with Store.open(path, durable=False) as store:  # enough nodes for several leaf pages: the damage is partial
        specs = specs + [W.Spec(ns, f, n) for ns in range(3) for f in range(2, 8) for n in (16, 48, 64, 100)]
        for spec in specs:
            W.put_spec(store, spec)
    _zero_page_of(path, "nodes")
    out = _in_child("""
        import sys
        from spec_cache.store import Store, StoreError, maintenance
        from tools.faults import workload as W
        with Store.open(sys.argv[1], durable=False) as store:
            v = maintenance.verify(store)
            print("structure", len(v.structure_problems), "records", v.records)
            typed = 0
            for spec in [W.Spec(ns, f, n) for ns in range(3) for f in range(8) for n in (16, 31, 48, 60, 64, 100)]:
                try:
                    restored = store.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
                    assert W.check(restored, spec) is None, spec
                except StoreError:
                    typed += 1
            print("typed", typed)
            try:
                maintenance.gc(store)
            except StoreError as exc:
                print("gc refused:", exc)
    """, path)
    assert out.returncode == 0, out.stderr
    assert "structure 0" not in out.stdout and "records 0" in out.stdout
    assert "gc refused:" in out.stdout and "repair" in out.stdout
    report = repair(str(path), str(tmp_path / "salvaged"))
    assert report.structure_problems and report.entries_copied + report.entries_lost == len(specs)
    assert report.entries_copied > 0
    with Store.open(tmp_path / "salvaged", durable=False) as fresh:
        v = maintenance.verify(fresh)
        assert not v.damaged and v.records > 0
        assert _fetch_all(fresh, specs) == []


def test_repair_copies_everything_from_a_sound_store(filled, tmp_path):
    path, specs = filled
    report = repair(str(path), str(tmp_path / "copy"))
    assert (report.entries_copied, report.entries_lost, report.structure_problems) == (len(specs), 0, [])
    with Store.open(tmp_path / "copy", durable=False) as fresh:
        assert not maintenance.verify(fresh).damaged
        for spec in specs:
            restored = fresh.fetch(spec.ns_key, spec.tokens, drafter=W.DRAFTER)
            assert restored.length == spec.length and W.check(restored, spec) is None
            assert (restored.attachment is not None) == spec.drafter
    with pytest.raises(StoreOpenError):
        repair(str(path), str(tmp_path / "copy"))  # the destination must be new


def _cli(*args) -> tuple[int, str, str]:
    """``spec-cache`` in-process (repair is one of its commands)."""
    from spec_cache.apps import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(map(str, args)))
    return code, out.getvalue(), err.getvalue()


def test_repair_command(filled, tmp_path):
    path, specs = filled
    code, out, err = _cli("--cache", path, "--json", "repair", "--to", tmp_path / "new")
    assert code == 0, err
    d = json.loads(out)
    assert d["entries_copied"] == len(specs) and d["stopped"] is False
    code, out, err = _cli("--cache", path, "repair", "--to", tmp_path / "new")
    assert code == 2 and err.startswith("spec-cache: error:") and "not empty" in err
    code, out, err = _cli("--cache", tmp_path / "nowhere", "repair", "--to", tmp_path / "new2")
    assert code == 2 and "no spec-cache store" in err


def test_reads_never_fail_because_counters_cannot_be_written(tmp_path, monkeypatch):
    """Found: on a full store (everything pinned, map at its limit) a plain fetch raised StoreFullError because
    its batched hit/miss counters could not be flushed. Counters are best effort now."""
    import spec_cache.store.env as store_env

    monkeypatch.setattr(store_env, "MAX_MAP_SIZE", 8 << 20)
    rng = np.random.default_rng(0)
    committed = []
    with Store.open(tmp_path / "s", chunk_tokens=W.CHUNK_TOKENS, durable=False, map_size=1 << 20) as store:
        W.register(store)
        refused = 0
        for _ in range(80):
            spec = W.random_spec(rng, large=0.5)
            try:
                W.put_spec(store, spec, pin=True)
                committed.append(spec)
            except StoreFullError as exc:
                refused += 1
                assert "full" in str(exc)
        assert refused > 0 and committed
        for _ in range(3):  # enough fetches to force several counter flushes
            assert _fetch_all(store, committed) == []
            assert all(store.fetch(s.ns_key, s.tokens).length == s.length for s in committed)
        for spec in committed:  # a full store can still be unpinned and evicted (map headroom)
            store.pin(spec.ns_key, spec.tokens, False)
        report = maintenance.evict(store, to_size=0)
        assert report.entries > 0
        W.put_spec(store, W.Spec(0, 47, 60))


def test_writers_clear_reader_slots_of_killed_processes(tmp_path, monkeypatch):
    """A reader SIGKILLed inside a transaction leaves its slot; a long-running writer (that never reopens the
    store) now clears such slots itself, so the pages the dead reader pinned are reused."""
    import spec_cache.store.env as store_env

    monkeypatch.setattr(store_env, "READER_CHECK_S", 0.0)
    with Store.open(tmp_path / "s", chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
        W.register(store)
        holder_pid = concurrency.kill_reader_holder(str(tmp_path / "s"), str(REPO))
        size0 = os.path.getsize(tmp_path / "s" / "data.mdb")
        for i in range(40):  # replace one 256 KiB checkpoint again and again
            data = np.full((1, 1, 8, 8192), i, np.float32)
            store.put(W.NS_KEYS[0], list(range(8)), [LayerState("ring", {}, [Tensor.from_numpy(data)])])
        growth = os.path.getsize(tmp_path / "s" / "data.mdb") - size0
        assert str(holder_pid) not in store.env.env.readers()
    assert growth < 4 << 20  # 40 x 256 KiB would be 10 MiB if the dead reader still pinned old pages


# --- hostile checkpoints: refused before anything changes ----------------------------------------------------------
def _dump(store) -> dict:
    with store.env.read() as txn:
        return {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                for name, db in store.env.dbs.items() if name != "memo"}


def _hidden(n: int, *, processed=None, shape=(1, 1, 64), dtype=np.float32) -> CheckpointAttachment:
    return CheckpointAttachment(GEMMA_ASSISTANT_V1, {"processedTokens": n if processed is None else processed},
                                (np.zeros(shape, dtype),))


BAD_CHECKPOINTS = {
    "processedTokens off by one": lambda t: dict(drafter=(W.DRAFTER, _hidden(len(t), processed=len(t) - 1))),
    "processedTokens of another prompt": lambda t: dict(drafter=(W.DRAFTER, _hidden(len(t), processed=3))),
    "hidden of wrong rank": lambda t: dict(drafter=(W.DRAFTER, _hidden(len(t), shape=(1, 64)))),
    "hidden of integer dtype": lambda t: dict(drafter=(W.DRAFTER, _hidden(len(t), dtype=np.int32))),
    "unknown schema": lambda t: dict(drafter=(W.DRAFTER, CheckpointAttachment("nope-v9", {}, ()))),
    "ngram history one token short": lambda t: dict(drafter=("ngram-history-v1:3:1", CheckpointAttachment(
        NGRAM_HISTORY_V1, {"max": 3, "min": 1}, (np.asarray(t[:-1], np.int32),)))),
    "layer one token short": lambda t: dict(layers=W.layers_for(W.NS_KEYS[0], "small", t[:-1])),
    "layers of two lengths": lambda t: dict(layers=W.layers_for(W.NS_KEYS[0], "small", t)[:1]
                                            + W.layers_for(W.NS_KEYS[0], "small", t + [1])[1:]),
    "tensor dtype that does not fit its data": lambda t: dict(layers=[LayerState(
        "kv", {}, [Tensor("float16", (1, 1, len(t), 4), np.zeros((1, 1, len(t), 4), np.float32))], token_axis=2)]),
    "tensor data shorter than its shape": lambda t: dict(layers=[LayerState(
        "kv", {}, [Tensor("float32", (1, 1, len(t), 4), np.zeros(3, np.float32))], token_axis=2)]),
    "minimum reusable past the end": lambda t: dict(minimum_reusable=len(t) + 1),
    "negative token": lambda t: dict(tokens=[-1] + t[1:]),
    "token past 2**32": lambda t: dict(tokens=[2**32] + t[1:]),
    "no tokens": lambda t: dict(tokens=[]),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints_are_refused_before_anything_changes(tmp_path, case):
    tokens = W.Spec(0, 0, 40).tokens
    with Store.open(tmp_path / "s", chunk_tokens=W.CHUNK_TOKENS, durable=False) as store:
        W.register(store)
        W.put_spec(store, W.Spec(0, 0, 31))
        store.flush()
        before = _dump(store)
        args = {"tokens": tokens, "layers": W.layers_for(W.NS_KEYS[0], "small", tokens), "drafter": None,
                "minimum_reusable": 0}
        args.update(BAD_CHECKPOINTS[case](tokens))
        with pytest.raises((StoreError, SchemaError, ValueError)):
            store.put(W.NS_KEYS[0], args["tokens"], args["layers"], drafter=args["drafter"],
                      minimum_reusable=args["minimum_reusable"])
        assert _dump(store) == before


# --- the CLI on stores that cannot be used -------------------------------------------------------------------------
def _zero_page_of(path: Path, db: str) -> None:
    """Zero a live leaf page of sub-database ``db`` (a torn or lost B-tree page): among the leaf pages that hold
    its first key (stale copies sit in free pages too), the one whose loss LMDB's structure check notices."""
    from spec_cache.store.structure import check_structure

    with Store.open(path, durable=False) as store:
        with store.env.read() as txn:
            first = bytes(next(iter(txn.cursor(db=store.env.dbs[db])))[0])
    original = (path / "data.mdb").read_bytes()
    at = original.find(first)
    while at >= 0:
        page = at // 4096
        header = original[page * 4096:page * 4096 + 12]
        if int.from_bytes(header[:8], "little") == page and int.from_bytes(header[10:12], "little") == 0x02:
            data = bytearray(original)
            data[page * 4096:(page + 1) * 4096] = bytes(4096)
            (path / "data.mdb").write_bytes(bytes(data))
            if any(f"/{db} DB" in problem for problem in check_structure(str(path)) or []):
                return
        at = original.find(first, at + 1)
    (path / "data.mdb").write_bytes(original)
    raise AssertionError(f"no live leaf page of {db} found")


BROKEN = {
    "truncated": lambda p: os.truncate(p / "data.mdb", os.path.getsize(p / "data.mdb") // 3),
    "empty data file": lambda p: os.truncate(p / "data.mdb", 0),
    "data file is a directory": lambda p: (os.remove(p / "data.mdb"), os.mkdir(p / "data.mdb")),
    "garbage lock file": lambda p: (p / "lock.mdb").write_bytes(b"\xff" * 100),
    "zeroed nodes page": lambda p: _zero_page_of(p, "nodes"),
    "zeroed nsinfo page": lambda p: _zero_page_of(p, "nsinfo"),
    "damaged totals": lambda p: _raw_put(p, b"meta", b"totals", b"\xc1"),
    "damaged format record": lambda p: _raw_put(p, b"meta", b"format", b"\x93\x01"),
}


def _raw_put(path: Path, db: bytes, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(key, value, db=env.open_db(db, txn=txn, create=False))
    env.close()


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_cli_on_broken_stores_gives_one_line_and_no_traceback(filled, broken):
    path, _ = filled
    BROKEN[broken](path)
    for command in (["ls"], ["stats"], ["verify"], ["gc"], ["evict", "--to-size", "1KiB"]):
        out = subprocess.run([sys.executable, "-m", "spec_cache", "--cache", str(path), *command], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode in (0, 1, 2), (broken, command, out.returncode, out.stderr[-2000:])
        assert "Traceback" not in out.stderr, (broken, command, out.stderr)
        if out.returncode == 2:
            assert len(out.stderr.strip().splitlines()) == 1, (broken, command, out.stderr)
        if broken == "truncated" and command == ["verify"]:  # damage is verify's finding: exit 1, a one-line report
            assert out.returncode == 1 and len((out.stdout + out.stderr).strip().splitlines()) == 1, out.stdout
            assert "truncated" in out.stdout and "spec-cache repair" in out.stdout
        elif broken in ("truncated", "data file is a directory", "damaged format record"):
            assert out.returncode == 2, (broken, command, out.stdout, out.stderr)


def test_a_wrong_layer_signature_is_found_and_rebuilt(filled):
    """Found (1 of 1000 corruption trials): a bit flip inside a namespace's layer signature, still well-formed,
    hid its chains without a word. verify now checks signatures against the chain roots; gc rebuilds them."""
    path, specs = filled
    with Store.open(path, durable=False) as store:
        def flip(txn):
            ix = Index(txn, store.env.dbs)
            info = ix.nsinfo(W.NS_KEYS[0])
            info["sigs"] = [bytes([sig[0] ^ 1]) + sig[1:] for sig in info["sigs"]]
            ix.put("nsinfo", W.NS_KEYS[0], info)
        store.env.write(flip)
        hidden = [s for s in specs if s.ns == 0]
        assert all(store.fetch(s.ns_key, s.tokens) is None for s in hidden)  # a miss, never wrong
        assert any("signatures" in p for p in maintenance.verify(store).index_problems)
        maintenance.gc(store)
        assert not maintenance.verify(store).damaged
        assert all(store.fetch(s.ns_key, s.tokens).length == s.length for s in hidden)


def test_open_adopts_a_map_another_process_grew(tmp_path, monkeypatch):
    """Found (a flaky multi-process test): opening while another process grows the map failed with
    MDB_MAP_RESIZED. The open now adopts the new size and retries."""
    import spec_cache.store.env as store_env

    with Store.open(tmp_path / "s", durable=False):
        pass
    original, calls = store_env.Environment._existing_format, {"n": 0}

    def resized_once(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")
        return original(self)
    monkeypatch.setattr(store_env.Environment, "_existing_format", resized_once)
    with Store.open(tmp_path / "s", durable=False) as store:
        assert store.chunk_tokens > 0
    assert calls["n"] == 3  # the lock-free format check before the open retried once, then the open itself
