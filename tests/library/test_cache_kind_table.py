"""A new mlx-lm cache class is one table entry plus its tests (issue 34, item 3).

A toy kind (``ScaledKVCache``: mlx-lm's ``KVCache`` plus a scalar a rebuild must keep) is registered through the
table alone (``cache_kinds.register``) and runs through every public route: capture and rebuild (store and memory
tier, LMDB included), the one prefix-cut rule (``row_caches.prefix_caches``), batched rows (restored into
``TargetRows`` by the engine, bit-identical to a cold run) and the drafter codec's refusal. A kind with no batch
cache is refused by a named error. And no module outside the table dispatches on an mlx-lm cache class.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.drafters.cache_codec import capture_kv_attachment
from spec_cache.errors import RestoreRefused
from spec_cache.state import cache_kinds
from spec_cache.state.cache_kinds import CacheKind, KindCannot, kind_named, kind_of
from spec_cache.state.cache_state import from_layer_state, layer_state
from spec_cache.state.row_caches import prefix_caches
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.memory_tier import MemoryTier
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 9, 2, 7, 11, 3, 8, 14, 6, 1, 12]


class ScaledKVCache(KVCache):
    """The toy: a ``KVCache`` with one scalar of its own (as a newer mlx-lm class would bring)."""

    scale = 1.0


class ScaledKind(CacheKind):
    """The toy's whole table entry: what it stores, how it is rebuilt, what a batched row reads of it. Cut, merge,
    split and the rest come from the protocol's defaults and from ``kv``, whose batch cache its rows join."""

    name, cache_class, token_axis, batch = "scaled-kv", "ScaledKVCache", 2, "kv"

    def mlx_class(self):
        return ScaledKVCache

    def capture(self, cache):
        n = cache.offset
        return {"scale": cache.scale}, [cache.keys[..., :n, :], cache.values[..., :n, :]]

    def build(self, meta, arrays):
        built = ScaledKVCache()
        built.scale = meta["scale"]
        if arrays:
            built.keys, built.values = arrays
            built.offset = built.keys.shape[2]
        return built

    def content(self, cache, window, where):
        return None if not cache.offset else (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])


class UnbatchedKind(ScaledKind):
    """A kind whose rows join no batch cache: every batched route refuses it by name."""

    name, cache_class, batch = "unbatched-kv", "UnbatchedKVCache", None

    def mlx_class(self):
        return UnbatchedKVCache


class UnbatchedKVCache(KVCache):
    scale = 1.0


@pytest.fixture
def toy_kinds():
    kinds = [cache_kinds.register(ScaledKind()), cache_kinds.register(UnbatchedKind())]
    yield kinds
    for kind in kinds:
        cache_kinds.unregister(kind.name)


def bits(a) -> tuple:
    return str(a.dtype), tuple(a.shape), np.array(a).tobytes()


def scaled(n: int, scale: float = 0.5, cls=ScaledKVCache):
    rng = np.random.default_rng(n)
    cache = cls()
    cache.scale = scale
    cache.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, n, 16)).astype(np.float32)) for _ in range(2)))
    return cache


def same(a, b) -> bool:
    n = a.offset
    return (type(a) is type(b) and a.offset == b.offset and a.scale == b.scale
            and bits(a.keys[..., :n, :]) == bits(b.keys[..., :n, :])
            and bits(a.values[..., :n, :]) == bits(b.values[..., :n, :]))


def test_a_registered_kind_is_found_and_taken_out_again(toy_kinds):
    assert kind_of(scaled(3)) is kind_named("scaled-kv") is toy_kinds[0]
    assert ScaledKVCache in cache_kinds.cache_types()
    with pytest.raises(ValueError, match="already has a kind"):
        cache_kinds.register(ScaledKind())
    cache_kinds.unregister("scaled-kv")
    assert kind_of(scaled(3)).name == "kv"  # back to its nearest listed ancestor
    cache_kinds.register(toy_kinds[0])


def test_capture_and_rebuild_through_the_store_and_the_memory_tier(toy_kinds, tmp_path):
    cache = scaled(12)
    layer = layer_state(cache)
    assert (layer.kind, layer.meta, layer.token_axis) == ("scaled-kv", {"scale": 0.5}, 2)
    assert same(from_layer_state(layer), cache)
    tier = MemoryTier(1 << 30, idle_seconds=None)
    tier.put(b"ns", list(range(12)), [cache])
    (back,), _ = tier.take(tier.lookup(b"ns", list(range(12))))
    assert same(back, cache)
    (cut,), _ = tier.take(tier.lookup(b"ns", list(range(7)) + [99]))  # trimmable: a shorter prefix too
    assert cut.offset == 7 and cut.scale == 0.5
    with SpecCache.open(tmp_path / "c", memory_bytes=0) as store:
        ns = store.namespace("ab" * 32, "toy")
        assert store.save(ns, list(range(12)), [cache, scaled(12, 2.0)])
    with SpecCache.open(tmp_path / "c", memory_bytes=0) as store:
        hit = store.restore(store.namespace("ab" * 32, "toy"), list(range(12)) + [99])
        assert hit.length == 12 and same(hit.caches[0], cache) and hit.caches[1].scale == 2.0


def test_the_one_prefix_rule_cuts_the_new_kind(toy_kinds):
    cache = scaled(10)
    (cut,) = prefix_caches([cache], 6, [None])
    assert type(cut) is ScaledKVCache and cut.offset == 6 and cut.scale == 0.5
    assert bits(cut.keys) == bits(cache.keys[..., :6, :])
    assert cache.offset == 10  # only read


def test_restored_rows_of_the_new_kind_batch_exactly(toy_kinds, tiny):  # noqa: F811
    target = tiny.target
    caches = target.make_caches()
    target.forward(mx.array([PROMPT[:-1]]), caches)
    restored = []
    for cache in caches:
        toy = ScaledKVCache()
        toy.keys, toy.values, toy.offset = cache.keys, cache.values, cache.offset
        restored.append(toy)
    engine = SpeculativeEngine(target, None)
    (result,) = engine.run([RowRequest(PROMPT, restored, len(PROMPT) - 1, None, max_tokens=6)])
    assert result.tokens == plain_greedy(target, PROMPT, 6) and result.cached_tokens == len(PROMPT) - 1


def test_a_kind_without_a_batch_cache_or_codec_is_refused_by_name(toy_kinds, tiny):  # noqa: F811
    from spec_cache.rows.target import TargetRows

    layers = [scaled(4, cls=UnbatchedKVCache) for _ in range(tiny.target.num_layers)]
    with pytest.raises(RestoreRefused, match="row 0 layer 0: UnbatchedKVCache layers cannot join batched "
                                             "full-precision rows"):
        TargetRows.from_row_caches(tiny.target, [layers])
    with pytest.raises(KindCannot, match="the unbatched-kv cache kind .* does not support batched rows"):
        cache_kinds.batch_kind_of(UnbatchedKVCache())  # a model whose layer makes one cannot batch its rows
    assert issubclass(KindCannot, NotImplementedError) and issubclass(KindCannot, ValueError)
    with pytest.raises(NotImplementedError, match="spec-cache-kv-v1 writes kv, qkv, arrays layers .* got Scaled"):
        capture_kv_attachment("standalone-draft-v1", [scaled(4)], {"processedTokens": 4})


# -- the table is the only place that dispatches on a cache class ------------------------------------------------
CACHE_CLASSES = {name for name, value in vars(mlx_cache).items() if isinstance(value, type) and name.endswith("Cache")}
CACHE_CLASSES |= {"BatchQuantizedKVCache"}  # spec-cache's own batch cache

#: modules that still test a cache class, and why (each is another room's, or not the runtime's); the table itself
#: finds a class's kind through its MRO, with no test of its own
ALLOWED = {
    "spec_cache/tiers/prefix_files.py": "validates an imported mlx-lm prompt-cache file layer by layer (shape, "
                                        "dtype, ring parameters per class) before anything runs it: the tiers' room",
    "spec_cache/convert/interop.py": "_drop_past_offset cuts trimmed caches' buffers before mlx-lm's "
                                     "save_prompt_cache writes them: an export format, the convert room's",
    "spec_cache/apps/bench/quantized_baseline.py": "the per-row reference implementation the batched quantized rows "
                                                   "are measured against: a bench, kept as it was",
}


def _dispatches(tree: ast.AST) -> list[int]:
    """Lines that test a cache class: ``isinstance``/``issubclass`` against one, ``type(x) is/in`` one, or a
    class-name string compared."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & CACHE_CLASSES:
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            consts = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
            calls_type = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "type" for n in ast.walk(node))
            if (calls_type and names & CACHE_CLASSES) or consts & CACHE_CLASSES:
                lines.append(node.lineno)
    return lines


def test_no_module_outside_the_table_dispatches_on_a_cache_class():
    found = {}
    for path in sorted((ROOT / "spec_cache").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = _dispatches(ast.parse(path.read_text()))
        if lines:
            found[rel] = lines
    unexplained = {rel: lines for rel, lines in found.items() if rel not in ALLOWED}
    assert not unexplained, f"cache-class dispatch outside cache_kinds.py (use the table): {unexplained}"
    assert set(ALLOWED) <= set(found), f"allowed but clean now (drop them): {set(ALLOWED) - set(found)}"


def test_the_check_sees_a_dispatch():
    caught = _dispatches(ast.parse("if isinstance(c, ArraysCache):\n    pass\nok = type(c) is KVCache\n"
                                   "name = type(c).__name__ == 'RotatingKVCache'\n"))
    assert caught == [1, 3, 4]
