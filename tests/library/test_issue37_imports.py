"""Issue 37 items 1, 6 and 10: every import path checks all of a file before it stores anything.

A cache import that does not fit the model (values' head size, token length, a rotating layer's ``max_size`` /
``keep``, an offset of None or inf) was stored and then failed the engine step of every row batched with the
uploader's next request; a file whose token list nests deeply raised a RecursionError; an import LMDB refused
stayed in the memory tier. Here the library paths (``cache_controls.import_prefix``, behind ``/v1/cache/import``;
``interop.import_mlx_lm``, behind ``spec-cache import-mlx-lm``) and the seed codec (``read_mlxkv``) on a tiny
gemma3 target (layer 0 sliding: ``RotatingKVCache(max_size=6, keep=0)``, layer 1 full: ``KVCache``).
"""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache, save_prompt_cache

from spec_cache.convert.interop import InteropError, import_mlx_lm
from spec_cache.convert.seed_codec import SeedFormatError, read_mlxkv, wyhash
from spec_cache.decode.generator import Generator
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import write_tiny_target
from spec_cache.tiers import cache_controls as controls
from spec_cache.tiers.cache import SpecCache

TOKENS = list(range(3, 13))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("i37") / "gemma", arch="gemma3_text", seed=1)
    return path, TargetModel.load(path)


@pytest.fixture
def cache(gemma, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "memo"))
    with SpecCache.open(tmp_path / "store", memory_bytes=1 << 24) as c:
        c.test_ns = Generator.load(gemma[0], cache=c).ns_key
        yield c


def made(target) -> list:
    caches = make_prompt_cache(target.model)
    target.model(mx.array([TOKENS]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def kv(keys_shape, values_shape, offset) -> KVCache:
    c = KVCache()
    c.state = (mx.zeros(keys_shape), mx.zeros(values_shape), offset)
    return c


def file_of(caches, path, metadata=None) -> bytes:
    save_prompt_cache(str(path), caches, metadata or {})
    return path.read_bytes()


def _values_dim(c):
    c[1] = kv((1, 1, 10, 64), (1, 1, 10, 32), 10)


def _values_len(c):
    c[1] = kv((1, 1, 10, 64), (1, 1, 7, 64), 10)


def _max_size(c):
    c[0].max_size = 3


def _keep(c):
    c[0].keep = 4


def _ring_index(c):
    c[0]._idx = 99


def _rotating_offset_none(c):
    c[0].offset = None


def _offset_inf(c):
    c[1].offset = float("inf")


def _offset_float(c):
    c[1].offset = 10.5


def _offset_past_buffer(c):
    c[1] = kv((1, 1, 4, 64), (1, 1, 4, 64), 10)


BROKEN = [_values_dim, _values_len, _max_size, _keep, _ring_index, _rotating_offset_none, _offset_inf, _offset_float,
          _offset_past_buffer]


def nothing_stored(cache, ns) -> bool:
    return cache.restore(ns, TOKENS + [1]) is None and cache.memory.sequences()[0] == 0


@pytest.mark.parametrize("damage", BROKEN, ids=lambda f: f.__name__.strip("_"))
def test_import_prefix_refuses_what_does_not_fit_and_stores_nothing(gemma, cache, tmp_path, damage):
    _, target = gemma
    caches = made(target)
    damage(caches)
    with pytest.raises(controls.BadPrefixFile) as refused:
        controls.import_prefix(cache, cache.test_ns, TOKENS, file_of(caches, tmp_path / "f.safetensors"), target)
    assert "\n" not in str(refused.value)
    assert nothing_stored(cache, cache.test_ns)
    # the same file untouched goes in
    good = file_of(made(target), tmp_path / "g.safetensors")
    assert controls.import_prefix(cache, cache.test_ns, TOKENS, good, target) == len(TOKENS)
    assert cache.restore(cache.test_ns, TOKENS + [1]).length == len(TOKENS)


@pytest.mark.parametrize("recorded", ["[" * 5000 + "]" * 5000, json.dumps([[3, 4]] * 10), json.dumps([3.5] * 10),
                                      json.dumps([10**100] * 10), json.dumps([-1] * 10)])
def test_recorded_tokens_nested_huge_or_fractional_are_one_line_errors(gemma, cache, tmp_path, recorded):
    _, target = gemma
    data = file_of(made(target), tmp_path / "f.safetensors", {"spec_cache_tokens": recorded})
    with pytest.raises(controls.BadPrefixFile, match="spec_cache_tokens"):
        controls.import_prefix(cache, cache.test_ns, None, data, target)
    assert nothing_stored(cache, cache.test_ns)


def test_an_import_lmdb_refuses_leaves_no_copy_in_the_memory_tier(gemma, tmp_path, monkeypatch):
    path, target = gemma
    monkeypatch.setenv("SPEC_CACHE_IDENTITY_DIR", str(tmp_path / "memo"))
    with SpecCache.open(tmp_path / "small", max_bytes=4096, memory_bytes=1 << 24) as cache:  # under one checkpoint
        ns = Generator.load(path, cache=cache).ns_key
        with pytest.raises(controls.BadPrefixFile, match="could not be stored"):
            with pytest.warns(Warning):
                controls.import_prefix(cache, ns, TOKENS, file_of(made(target), tmp_path / "f.safetensors"), target)
        assert nothing_stored(cache, ns)


@pytest.mark.parametrize("damage", [_values_dim, _max_size, _keep, _rotating_offset_none, _offset_inf],
                         ids=lambda f: f.__name__.strip("_"))
def test_import_mlx_lm_makes_the_same_checks(gemma, cache, tmp_path, damage):
    path, target = gemma
    caches = made(target)
    damage(caches)
    f = tmp_path / "f.safetensors"
    file_of(caches, f)
    gen = Generator.load(path)
    with pytest.raises(InteropError) as refused:
        import_mlx_lm(cache, f, path, TOKENS, prefix_namespace=gen.prefix_namespace)
    assert "\n" not in str(refused.value)
    assert cache.restore(cache.test_ns, TOKENS + [1]) is None
    file_of(caches, f, {"spec_cache_tokens": "[" * 5000 + "]" * 5000})
    with pytest.raises(InteropError, match="spec_cache_tokens"):
        import_mlx_lm(cache, f, path, None, prefix_namespace=gen.prefix_namespace)


# -- the seed codec ----------------------------------------------------------------------------------------------
def seed_file(header: bytes | dict) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<10sIIQ", b"MLXBUNKV2\n", len(head), 26 + len(head), wyhash(head)) + head


def slot(**over):
    return {"off": 0, "bytes": 4, "shape": [1, 1, 1, 1], "dtype": 10, "hash": "", **over}


HOSTILE = {
    "nested header": b"[" * 100_000 + b"]" * 100_000,
    "nested tokens": {"formatVersion": 4, "tokens": json.loads("[" * 500 + "]" * 500)},
    "huge token id": {"formatVersion": 4, "tokens": [10**100]},
    "negative token id": {"formatVersion": 4, "tokens": [-1]},
    "token past 32 bits": {"formatVersion": 4, "tokens": [2**32]},
    "attachments not a list": {"formatVersion": 4, "tokens": [1], "attachments": 7},
    "metadata not a dict": {"formatVersion": 4, "tokens": [1], "attachments": [{"schema": "s", "metadata": [1]}]},
    "negative tensor offset": {"formatVersion": 4, "tokens": [1],
                               "attachments": [{"schema": "s", "tensors": [slot(off=-26)]}]},
    "dims that wrap int64": {"formatVersion": 4, "tokens": [1],
                             "attachments": [{"schema": "s", "tensors": [slot(shape=[2**62, 2**62, 1, 1], bytes=0)]}]},
    "nested cache headers": {"formatVersion": 4, "tokens": [1], "attachments": [{"schema": "s", "metadata": {
        "cacheCodecs": "mlx-cache-v3", "cacheHeaders": "[" * 100_000 + "]" * 100_000}}]},
    "version true": {"formatVersion": True, "tokens": [1]},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_read_mlxkv_answers_hostile_headers_with_one_line_seed_format_errors(name):
    with pytest.raises(SeedFormatError) as refused:
        read_mlxkv(seed_file(HOSTILE[name]))
    assert type(refused.value) is SeedFormatError and "\n" not in str(refused.value)


def test_read_mlxkv_checks_token_ids_against_the_vocabulary():
    assert read_mlxkv(seed_file({"formatVersion": 4, "tokens": [1, 255]}), vocab_size=256).tokens == [1, 255]
    with pytest.raises(SeedFormatError, match="0..255"):
        read_mlxkv(seed_file({"formatVersion": 4, "tokens": [1, 256]}), vocab_size=256)
