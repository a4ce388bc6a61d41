"""A stored state that does not rebuild is a named ``RestoreRefused`` where the stored bytes are interpreted
(``cache_state.restore_caches``), which the cache turns into a miss with a ``CacheWarning``; any other exception
(a bug) is no longer read as a miss (issue 34 item 4: ``cache.py`` caught ``ValueError`` as "a damaged record")."""

from __future__ import annotations

import warnings

import pytest

from spec_cache.errors import RestoreRefused
from spec_cache.state import cache_state
from spec_cache.store import LayerState
from spec_cache.tiers import cache as cache_module
from spec_cache.tiers.cache import CacheWarning, SpecCache
from tests.library.test_memory_tier import kv


def test_a_layer_whose_meta_is_missing_is_a_named_refusal():
    rotating = LayerState("rotating", {"offset": 4}, [], 2)  # max_size, keep, idx missing
    with pytest.raises(RestoreRefused, match="stored layer 0 \\(rotating\\)"):
        cache_state.restore_caches([rotating])


def _stored(tmp_path):
    cache = SpecCache.open(tmp_path / "s", memory_bytes=0)  # LMDB only: every restore rebuilds
    ns = cache.namespace("ef" * 32, "prefix")
    tokens = list(range(10, 90))
    assert cache.save(ns, tokens, [kv(80, seed=1)]) is not None
    return cache, ns, tokens


def test_a_refused_rebuild_is_a_miss_with_a_warning(tmp_path, monkeypatch):
    cache, ns, tokens = _stored(tmp_path)
    try:
        assert cache.restore(ns, tokens + [5]) is not None

        def refused(layers):
            raise RestoreRefused("stored layer 0 (kv) does not rebuild: test")
        monkeypatch.setattr(cache_module, "restore_caches", refused)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cache.restore(ns, tokens + [5]) is None
        assert any(issubclass(w.category, CacheWarning) and "could not be rebuilt" in str(w.message)
                   for w in caught)
    finally:
        cache.close()


def test_a_bug_while_rebuilding_is_not_taken_for_a_miss(tmp_path, monkeypatch):
    cache, ns, tokens = _stored(tmp_path)
    try:
        def bug(layers):
            raise ValueError("an internal bug, not a damaged record")
        monkeypatch.setattr(cache_module, "restore_caches", bug)
        with pytest.raises(ValueError, match="internal bug"):
            cache.restore(ns, tokens + [5])
    finally:
        cache.close()
