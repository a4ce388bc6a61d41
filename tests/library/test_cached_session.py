"""``CachedSession`` (issue 34, item 1): the decode room's one loop. Rows restore from the cache, decode in one
engine session, and their checkpoints go back through one path, when the caller says: tokens equal the target's
own greedy tokens; ``close(write=False)`` stores nothing; a refused restored state is a miss plus a warning with
``cold_fallback`` (and raises without it); a rider factory's record is held at once and written with its
checkpoint; replay keeps what the restored state covers.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from spec_cache.decode.cached_session import CachedSession
from spec_cache.decode.generator import Generator
from spec_cache.errors import RestoreRefused
from spec_cache.schemas import SchemaError
from spec_cache.tiers.cache import CacheWarning, SpecCache
from spec_cache.tiers.continuations import Continuations, record_at
from tests.runtime_fixtures import _identity_memo, build_tiny, plain_greedy  # noqa: F401

PROMPT = [5 + (i * 7) % 180 for i in range(30)]
OTHER = [9 + (i * 13) % 170 for i in range(24)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("cached-session"), drafters={})


def _generator(tiny, path):
    cache = SpecCache.open(path)
    gen = Generator.load(tiny.root / "target", cache=cache)
    gen.write_behind = False
    return gen


def test_rows_decode_exactly_and_checkpoint_when_the_caller_writes(tiny, tmp_path):
    gen = _generator(tiny, tmp_path / "store")
    try:
        session = gen.session()
        assert isinstance(session, CachedSession)
        handles = [session.submit(prompt, 6) for prompt in (PROMPT, OTHER)]
        session.run()
        assert [h.output for h in handles] == [plain_greedy(tiny.target, p, 6) for p in (PROMPT, OTHER)]
        assert [h.result.tokens for h in handles] == [h.output for h in handles]
        assert session.pending_checkpoints > 0  # taken, not written: off the decoding path
        assert gen.restore_for_prompt(PROMPT) is None
        session.close()
        assert session.pending_checkpoints == 0
        again = gen.session()
        handle = again.submit(PROMPT, 6)
        assert handle.cached_tokens == len(PROMPT) - 1  # the prompt boundary came back
        again.run()
        again.close()
        assert handle.output == plain_greedy(tiny.target, PROMPT, 6)
    finally:
        gen.cache.close()


def test_close_without_writing_stores_nothing(tiny, tmp_path):
    gen = _generator(tiny, tmp_path / "store")
    try:
        session = gen.session()
        session.submit(PROMPT, 4)
        session.run()
        assert session.pending_checkpoints > 0
        session.close(write=False)
        assert gen.restore_for_prompt(PROMPT) is None
    finally:
        gen.cache.close()


def _refused(handle) -> None:
    """Make the restored state one the engine refuses (it claims a token more than its caches hold)."""
    request = handle.prepared.request
    handle.prepared.request = dataclasses.replace(request, restored_tokens=request.restored_tokens - 1)


def test_a_refused_restore_is_a_miss_with_cold_fallback(tiny, tmp_path):
    gen = _generator(tiny, tmp_path / "store")
    try:
        gen.generate([PROMPT], max_tokens=2)  # stores the prompt boundary
        strict = gen.session()
        handle = strict.prepare(PROMPT, 5)
        assert handle.cached_tokens == len(PROMPT) - 1
        _refused(handle)
        with pytest.raises((RestoreRefused, SchemaError)):
            strict.admit(handle)
        strict.close()

        lenient = gen.session(cold_fallback=True)
        handle = lenient.prepare(PROMPT, 5)
        _refused(handle)
        replanned = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lenient.admit(handle, on_cold=lambda h, exc: replanned.append((h, type(exc))))
        assert replanned and replanned[0][0] is handle  # the caller's hook saw the cold row before it went in
        assert any(issubclass(w.category, CacheWarning) and "prefilling cold" in str(w.message) for w in caught)
        assert handle.prepared.cached_tokens == 0 and handle.prepared.request.restored_caches is None
        lenient.run()
        lenient.close()
        assert handle.output == plain_greedy(tiny.target, PROMPT, 5)
    finally:
        gen.cache.close()


def test_a_riders_record_is_held_at_once_and_replay_resumes(tiny, tmp_path):
    gen = _generator(tiny, tmp_path / "store")
    key = b"k" * 32
    try:
        session = gen.session()

        def rider(handle, tokens):
            return record_at(key, gen.ns_key, handle.prompt, handle.output, len(tokens))

        handle = session.submit(PROMPT, 8, rider=rider)
        session.run()
        session.close()
        conts = Continuations.of(gen.cache)
        rec = conts.get(key, gen.ns_key, len(PROMPT))
        assert rec is not None and list(rec.tokens) == handle.output  # the finish checkpoint's record
        # a retry replays what the stored state covers and generates the rest, token-identically
        retry = gen.session()
        again = retry.submit(PROMPT, 8, replay=list(rec.tokens)[:5])
        assert again.replayed == 5 and again.output == handle.output[:5]
        retry.run()
        retry.close()
        assert again.output == handle.output
    finally:
        gen.cache.close()
