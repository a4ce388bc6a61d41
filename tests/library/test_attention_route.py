"""Few-query attention through MLX's own ops (``spec_cache.rows.attention_route``): on MLX's CUDA backend a verify
window would otherwise build a cuDNN plan at every round (its key length is new each time). The routed function must
be MLX's fallback to the bit (on the CPU, where MLX always runs that fallback, it is compared with
``mx.fast.scaled_dot_product_attention``), decoding through it must give the target's own greedy tokens, and the
switch must route exactly what it says."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.rows import attention_route
from spec_cache.rows.target import TargetModel
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)


@pytest.fixture(autouse=True)
def _clean():
    attention_route.uninstall()
    yield
    attention_route.uninstall()


def _qkv(batch, heads, kv_heads, length, keys, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, length, 16)).astype(dtype)
    k = mx.random.normal((batch, kv_heads, keys, 16)).astype(dtype)
    v = mx.random.normal((batch, kv_heads, keys, 16)).astype(dtype)
    return q, k, v


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="bit-identity holds where MLX runs its fallback")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 2, 5, 9])
def test_the_ops_are_mlx_fallback_to_the_bit(dtype, heads, kv_heads, length):
    keys = 23
    q, k, v = _qkv(2, heads, kv_heads, length, keys, dtype)
    padded = create_causal_mask(length, offset=keys - length, left_padding=mx.array([0, 6]))
    additive = mx.where(padded, 0.0, -1e9).astype(dtype)  # MLX refuses one that does not promote to it
    for mask in (None, "causal", padded, additive, padded[:1, :, :, :]):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        got = attention_route.ops_attention(q, k, v, 0.25, mask)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item(), (None if mask is None else getattr(mask, "shape", mask))


def test_auto_routes_nothing_off_cuda_and_mlx_never(tiny, monkeypatch):
    layers = tiny.target._layers
    monkeypatch.setenv("SPEC_CACHE_ATTENTION", "auto")
    assert attention_route.install(layers, cuda=False) == []
    monkeypatch.setenv("SPEC_CACHE_ATTENTION", "mlx")
    assert attention_route.install(layers, cuda=True) == []
    monkeypatch.setenv("SPEC_CACHE_ATTENTION", "sometimes")
    with pytest.raises(ValueError, match="SPEC_CACHE_ATTENTION must be auto, mlx or ops"):
        attention_route.install(layers)


def test_on_cuda_auto_routes_verify_windows_and_leaves_prefill_chunks_to_mlx(tiny, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE_ATTENTION", "auto")
    layers = tiny.target._layers
    name = type(layers[0].self_attn).__module__
    assert attention_route.install(layers, cuda=True) == [name]
    assert attention_route.routed_modules() == {name: attention_route.DEFAULT_MAX_QUERIES}
    module = sys.modules[name]
    routed = module.scaled_dot_product_attention
    seen = []
    monkeypatch.setattr(attention_route, "ops_attention", lambda q, *a: seen.append(q.shape[2]) or q)
    q, k, v = _qkv(1, 2, 1, 40, 60, mx.float32)
    for length in (1, 2, 32, 33, 40):
        routed(q[:, :, :length], k, v, cache=None, scale=0.25, mask="causal" if length > 1 else None)
    assert seen == [2, 32]  # one query: the vector kernel; more than 32: a prefill chunk, cuDNN's
    assert attention_route.install(layers, cuda=True) == [name]  # idempotent: not wrapped twice
    assert module.scaled_dot_product_attention is routed
    attention_route.uninstall()
    assert not getattr(module.scaled_dot_product_attention, "spec_cache_routed", False)


@pytest.mark.parametrize("provider_name", ["ngram", "draft-model", None])
def test_decoding_through_the_ops_gives_the_target_greedy_tokens(tiny, monkeypatch, provider_name):
    """Every multi-query attention (prefill chunks and verify windows) through the ops: the same tokens as
    mlx-lm's own ``generate_step``, drafts accepted and rejected."""
    monkeypatch.setenv("SPEC_CACHE_ATTENTION", "ops")
    target = TargetModel.load(tiny.target.model_dir)
    assert target.attention_routed
    calls = []
    real = attention_route.ops_attention
    monkeypatch.setattr(attention_route, "ops_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    engine = SpeculativeEngine(target, tiny.provider(provider_name), draft_depth=3, adaptive=False)
    prompts = [PROMPTS[0], [5, 6, 7, 8, 9] * 4]  # a repeating one: prompt lookup drafts
    results = engine.run([RowRequest(p, max_tokens=16) for p in prompts])
    attention_route.uninstall()
    for prompt, result in zip(prompts, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, 16)
    assert calls and max(calls) > 1
    if provider_name is not None:
        assert sum(r.drafted for r in results) > 0


def test_the_query_limit_moves_with_its_variable_and_bad_values_are_named(tiny, monkeypatch):
    layers = tiny.target._layers
    name = type(layers[0].self_attn).__module__
    monkeypatch.setenv("SPEC_CACHE_ATTENTION_MAX_QUERIES", "4096")
    assert attention_route.install(layers, cuda=True) == [name]
    assert attention_route.routed_modules() == {name: 4096}
    monkeypatch.setenv("SPEC_CACHE_ATTENTION_MAX_QUERIES", "8")
    attention_route.install(layers, cuda=True)  # re-routed with the new limit, over mlx-lm's own function
    assert attention_route.routed_modules() == {name: 8}
    attention_route.uninstall()
    assert not getattr(sys.modules[name].scaled_dot_product_attention, "spec_cache_routed", False)
    for bad in ("1", "many", "-3"):
        monkeypatch.setenv("SPEC_CACHE_ATTENTION_MAX_QUERIES", bad)
        for cuda in (True, False):  # refused where it would not be used too: a typo is not found later on a GPU
            with pytest.raises(ValueError, match="SPEC_CACHE_ATTENTION_MAX_QUERIES must be an integer >= 2"):
                attention_route.install(layers, cuda=cuda)
