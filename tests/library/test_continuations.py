"""Persisted continuations (issue 24 row 29): a generation killed part-way (SIGKILL) resumes after a restart, and the
whole output equals an uninterrupted run; from the library (``Generator.generate(..., checkpoint_every=N,
resume=True)``) and from a real ``spec-cache serve`` process. Records are per namespace, prompt, sampling, seed,
EOS rule and tenant; a corrupted record is a miss; verify/gc know them; golden vectors pin key and record bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from spec_cache.decode.generator import Generator
from spec_cache.rows.sampling import RowSampling
from spec_cache.store import Store
from spec_cache.store.continuations import (
    DB,
    RECORD_PREFIX,
    Continuation,
    ContinuationTable,
    continuation_key,
    continuation_params,
    decode_continuation,
    encode_continuation,
)
from spec_cache.store.maintenance import gc, verify
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.continuations import request_key

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parents[1] / "golden" / "continuations.json"
PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX = 80
EVERY = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_target

    return write_tiny_target(tmp_path_factory.mktemp("cont-model") / "tiny", seed=7)  # float32


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    memo = tmp_path_factory.mktemp("identity-memo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPEC_CACHE_IDENTITY_DIR", str(memo))
        yield dict(os.environ, SPEC_CACHE_IDENTITY_DIR=str(memo), PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def plain(target, env):
    """Uninterrupted runs without any cache: ``plain(max_tokens, temperature=0, seed=0)`` -> tokens."""
    gen = Generator.load(target)
    memo = {}

    def run(max_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
        key = (max_tokens, temperature, seed)
        if key not in memo:
            memo[key] = gen.generate([PROMPT], max_tokens=max_tokens, temperature=temperature, seed=seed)[0].tokens
        return memo[key]
    return run


def test_golden_keys_and_records_are_unchanged():
    for case in json.loads(GOLDEN.read_text()):
        params = continuation_params(temperature=case["temperature"], top_p=case["top_p"], seed=case["seed"],
                                     eos_ids=case["eos_ids"])
        assert params.decode() == case["params"], case["name"]
        ns_key = bytes.fromhex(case["ns_key"])
        key = continuation_key(ns_key, case["prompt"], params)
        assert key.hex() == case["key"], case["name"]
        rec = Continuation(key, ns_key, len(case["prompt"]), tuple(case["tokens"]), case["finished"],
                           case["written_ns"])
        assert encode_continuation(rec).hex() == case["record"], case["name"]
        assert decode_continuation(bytes.fromhex(case["record"]), key) == rec
    by_name = {c["name"]: c for c in json.loads(GOLDEN.read_text())}
    assert by_name["greedy-eos"]["key"] == by_name["greedy-ignores-seed-and-top-p"]["key"]
    assert by_name["greedy-eos"]["key"] != by_name["greedy-eos-ignored"]["key"]
    assert by_name["sampled-seeded"]["key"] != by_name["sampled-other-seed"]["key"]


CHILD = textwrap.dedent("""
    import sys, threading, time
    from spec_cache.tiers import continuations as C
    from spec_cache.tiers.cache import SpecCache
    from spec_cache.decode.engine import DecodeSession
    from spec_cache.decode.generator import Generator

    store, target = sys.argv[1], sys.argv[2]
    after, max_tokens, every = (int(a) for a in sys.argv[3:6])
    prompt = [5, 6, 7, 8, 9, 10, 11]
    cache = SpecCache.open(store)
    gen = Generator.load(target, cache=cache)
    gen.generate([prompt], max_tokens=20, temperature=0.8, seed=5, checkpoint_every=every)  # a finished sampled one
    cache.drain()
    ready = threading.Event()
    remember = C.Continuations.remember

    def spy(self, rec):  # once a record this long is taken, the generation stops where it stands
        remember(self, rec)
        if len(rec.tokens) >= after and not rec.finished:
            ready.set()
    C.Continuations.remember = spy
    step = DecodeSession.step

    def held(self):
        if ready.is_set():
            cache.drain()  # its checkpoint, then its record, are in LMDB
            print("READY", flush=True)
            time.sleep(600)
        return step(self)
    DecodeSession.step = held
    gen.generate([prompt], max_tokens=max_tokens, checkpoint_every=every)
    print("FINISHED", flush=True)
""")


def kill_mid_generation(store: Path, target: Path, env: dict, tmp_path: Path, after: int) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(store), str(target), str(after), str(MAX), str(EVERY)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() in ("READY", "FINISHED"):
                break
        assert lines and lines[-1].strip() == "READY", "".join(lines)
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-generation: no drain, no close
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_library_resumes_after_sigkill_token_identically(target, env, plain, tmp_path):
    store = tmp_path / "store"
    kill_mid_generation(store, target, env, tmp_path, after=16)
    cache = SpecCache.open(store)
    try:
        table = cache.continuations.table
        left = [r for r in table.records() if not r.finished]
        assert left and 16 <= len(left[0].tokens) < MAX  # the killed run left a record part-way
        assert verify(cache.store).damaged is False  # continuation records are verified as sound

        gen = Generator.load(target, cache=cache)
        # another tenant, another seed: never another's continuation (and still the right tokens)
        other = Generator.load(target, cache=cache, tenant="someone-else")
        got = other.generate([PROMPT], max_tokens=MAX, checkpoint_every=EVERY, resume=True)[0]
        assert got.resumed == 0 and got.tokens == plain(MAX)
        sampled_other = gen.generate([PROMPT], max_tokens=40, temperature=0.8, seed=6, resume=True)[0]
        assert sampled_other.resumed == 0 and sampled_other.tokens == plain(40, 0.8, 6)

        resumed = gen.generate([PROMPT], max_tokens=MAX, checkpoint_every=EVERY, resume=True)[0]
        assert 16 <= resumed.resumed < MAX
        assert resumed.tokens == plain(MAX)  # equals an uninterrupted greedy run
        # sampled with a seed: the finished 20-token record continues to 40 exactly as a fresh run
        sampled = gen.generate([PROMPT], max_tokens=40, temperature=0.8, seed=5, resume=True)[0]
        assert sampled.resumed == 20 and sampled.tokens == plain(40, 0.8, 5)
        # a whole answer replays with nothing run
        again = gen.generate([PROMPT], max_tokens=30, resume=True)[0]
        assert again.resumed == 30 and again.tokens == plain(MAX)[:30] and again.drafted == 0
        cache.drain()
        report = verify(cache.store)
        assert not report.damaged and report.corrupt == 0
    finally:
        cache.close()


def _corrupt(store: Store, key: bytes, value: bytes) -> None:
    store.env.write(lambda txn: txn.put(RECORD_PREFIX + key, value, db=store.env.dbs[DB]))


def test_a_corrupted_record_is_a_miss_never_a_wrong_answer(target, env, plain, tmp_path):
    path = tmp_path / "store"
    with SpecCache.open(path) as cache:
        gen = Generator.load(target, cache=cache)
        gen.generate([PROMPT], max_tokens=24, checkpoint_every=EVERY)
        gen.generate([PROMPT[:5]], max_tokens=24, checkpoint_every=EVERY)
        cache.drain()
        key = request_key(gen.ns_key, PROMPT, RowSampling(0.0, 1.0, 0), True, gen.eos_token_ids)
        short = request_key(gen.ns_key, PROMPT[:5], RowSampling(0.0, 1.0, 0), True, gen.eos_token_ids)
        with cache.store.reading() as txn:
            raw = bytes(txn.get(RECORD_PREFIX + key, db=cache.store.env.dbs[DB]))
            other = bytes(txn.get(RECORD_PREFIX + short, db=cache.store.env.dbs[DB]))
        flipped = bytearray(raw)
        flipped[-40] ^= 0x01  # one bit of the last token
        _corrupt(cache.store, key, bytes(flipped))
        _corrupt(cache.store, short, raw)  # a sound record under another request's key
        report = verify(cache.store)
        assert report.damaged and report.corrupt == 2
        assert {c["db"] for c in report.corrupt_keys} == {"continuations"}
        assert "stored under another key" in json.dumps(report.corrupt_keys)
    with SpecCache.open(path) as cache:  # a new process's view: nothing in memory
        gen = Generator.load(target, cache=cache)
        got = gen.generate([PROMPT], max_tokens=40, resume=True)[0]
        assert got.resumed == 0 and got.tokens == plain(40)
        assert gen.generate([PROMPT[:5]], max_tokens=8, resume=True)[0].resumed == 0
        gc(cache.store)
        report = verify(cache.store)
        assert not report.damaged and report.corrupt == 0
        _corrupt(cache.store, short, other)  # put back, then break the bookkeeping: gc mends it
        assert verify(cache.store).damaged  # a record without its LRU row
        gc(cache.store)
        assert not verify(cache.store).damaged


def test_records_are_bounded_and_gc_drops_those_of_vanished_namespaces(tmp_path):
    with Store.open(tmp_path / "store") as store:
        ns = bytes(range(32))
        store.register_namespace(ns, target="t", prefix_namespace="p")
        table = ContinuationTable(store, max_records=3)
        params = continuation_params(temperature=0.0, top_p=1.0, seed=None, eos_ids=[2])
        keys = [continuation_key(ns, [i, 1, 2], params) for i in range(5)]
        for i, key in enumerate(keys):
            table.put(Continuation(key, ns, 3, (i, i + 1), False, 1000 + i))
        assert [r.key for r in table.records()] == keys[2:]  # least recently written evicted first
        table.put(Continuation(keys[2], ns, 3, (2,), False, 2000))  # a shorter late write never goes back
        assert table.get(keys[2]).tokens == (2, 3)
        by_bytes = ContinuationTable(store, max_records=100, max_bytes=2 * len(encode_continuation(
            Continuation(keys[0], ns, 3, (0, 1, 2), True, 1))))
        by_bytes.put(Continuation(keys[0], ns, 3, (0, 1, 2), True, 3000))
        assert len(by_bytes.records()) == 2
        gone = bytes(32)  # a namespace the store has no row for
        table.put(Continuation(continuation_key(gone, [9], params), gone, 1, (7,), True, 4000))
        assert not verify(store).damaged
        report = gc(store)
        assert report.orphans_removed == 1 and all(r.ns_key == ns for r in table.records())
        assert not verify(store).damaged


def ours(store: Store) -> list[Continuation]:
    """Records of PROMPT's requests (the test harness's start-up probes leave records of their own)."""
    return [r for r in ContinuationTable(store).records() if r.prompt_tokens == len(PROMPT)]


def test_serve_retry_after_sigkill_and_restart_resumes(target, env, plain, tmp_path):
    from tests.apps.test_server import Server

    max_tokens, every = 400, 32
    want = plain(max_tokens)
    store = tmp_path / "store"
    srv = Server(target, store, tmp_path, "--checkpoint-every", str(every))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", headers=srv.headers(), json={**body, "stream": True},
                          timeout=60) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks >= 2 * every:
                    break
            deadline = time.monotonic() + 30  # wait until a record part-way is in LMDB, then kill
            while time.monotonic() < deadline:
                with Store.open(store, readonly=True) as seen:
                    if any(len(r.tokens) >= every for r in ours(seen)):
                        break
                time.sleep(0.02)
    finally:
        srv.stop(signal.SIGKILL)
    with Store.open(store, readonly=True) as seen:
        stored = max(len(r.tokens) for r in ours(seen))
    assert every <= stored
    again = Server(target, store, tmp_path, "--checkpoint-every", str(every))
    try:
        before = again.metric("spec_cache_replayed_tokens")  # (the harness's start-up probes may have replayed)
        other = httpx.post(again.url + "/v1/completions", headers=again.headers("test-key-b"), json=body, timeout=120)
        assert other.status_code == 200 and again.metric("spec_cache_replayed_tokens") == before  # another tenant
        reply = httpx.post(again.url + "/v1/completions", headers=again.headers(), json=body, timeout=120).json()
        replayed = again.metric("spec_cache_replayed_tokens") - before
        assert replayed == stored < max_tokens  # every token the record held, no more
        from mlx_lm.utils import load_tokenizer

        from tests.apps.test_server import expected_text

        text = expected_text(load_tokenizer(target), want)
        assert reply["choices"][0]["text"] == text
        assert other.json()["choices"][0]["text"] == text
    finally:
        again.stop()
