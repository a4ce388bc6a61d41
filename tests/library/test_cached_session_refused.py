"""``CachedSession(on_refused=...)`` (issue 34, item 1: the server's scheduler on the one decode loop): with
``cold_fallback``, a refused restored state is reported through the caller's hook (the server logs it) instead of a
``CacheWarning``; the row still goes in cold, re-planned by ``on_cold``, and decodes exactly.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from spec_cache.decode.generator import Generator
from spec_cache.tiers.cache import CacheWarning, SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny, plain_greedy  # noqa: F401

PROMPT = [5 + (i * 7) % 180 for i in range(30)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("cached-session-refused"), drafters={})


def test_on_refused_reports_the_refusal_instead_of_a_warning(tiny, tmp_path):
    cache = SpecCache.open(tmp_path / "store")
    gen = Generator.load(tiny.root / "target", cache=cache)
    gen.write_behind = False
    try:
        gen.generate([PROMPT], max_tokens=2)  # stores the prompt boundary
        reported, replanned = [], []
        session = gen.session(cold_fallback=True, on_refused=reported.append)
        handle = session.prepare(PROMPT, 5)
        assert handle.cached_tokens == len(PROMPT) - 1
        request = handle.prepared.request  # a state the engine refuses: it claims a token more than it holds
        handle.prepared.request = dataclasses.replace(request, restored_tokens=request.restored_tokens - 1)

        def replan(h, exc):  # as the scheduler does: a fresh cold plan of the same sequence
            replanned.append(type(exc))
            h.prepared = session.prepare(PROMPT, 5, lookup=False).prepared

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session.admit(handle, on_cold=replan)
        assert len(reported) == 1 and isinstance(reported[0], Exception)
        assert replanned == [type(reported[0])]
        assert not any(issubclass(w.category, CacheWarning) for w in caught)
        assert handle.prepared.cached_tokens == 0 and handle.prepared.request.restored_caches is None
        session.run(write_each_step=True)
        session.close()
        assert handle.output == plain_greedy(tiny.target, PROMPT, 5)
    finally:
        gen.cache.close()
