"""KV quantization end to end: the runtime converts where mlx-lm's ``generate_step`` converts, speculative
decoding equals ``generate_step(kv_bits=..., quantized_kv_start=...)``, restored == cold (also after reopening
the store), a stored state is reused only by requests that convert at the same point, and stored quantized state
comes back bit-identical."""

from __future__ import annotations

import itertools
import json

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from spec_cache.apps.bench.quantized_baseline import PerRowQuantizedTargetRows
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import KVLayerConfig, KVOptions
from spec_cache.rows.kv_quant import KVPlan, LayerQuant, converted_at, plan_kv, reusable
from spec_cache.rows.quantized_rows import QuantizedTargetRows
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import (  # noqa: F401
    CheckpointRecorder,
    _identity_memo,
    build_tiny,
    per_layer_greedy,
    plain_greedy,
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 44))]
MAX = 16
#: (kv_bits, quantized_kv_start): converting right after the prompt's prefill, inside it (for the long prompt)
#: and while decoding (start 20 is past every prompt here)
CASES = [(4, 0), (8, 0), (4, 9), (8, 9), (4, 20)]


@pytest.fixture(scope="session")
def qtiny(tmp_path_factory):
    """A tiny llama whose greedy output is sensitive to 4-bit KV (larger weights than the default tiny)."""
    return build_tiny(tmp_path_factory.mktemp("tiny-quantized"), init_scale=2.0)


def reference(target, prompt, bits, start, step=512, max_tokens=MAX):
    return plain_greedy(target, prompt, max_tokens, kv_bits=bits, kv_group_size=64, quantized_kv_start=start,
                        prefill_step_size=step)


def engine(tiny, name, bits=None, start=None, step=512, depth=4, **kv):
    options = KVOptions(kv_bits=bits, quantized_kv_start=start, **kv)
    return SpeculativeEngine(tiny.target, tiny.provider(name), draft_depth=depth, kv=options, prefill_step_size=step,
                             adaptive=False)  # fixed depth: the tests below count drafts


# -- where conversion happens ------------------------------------------------------------------------------
def test_conversion_point_is_where_generate_step_converts(qtiny):
    """``KVPlan.conversion_point`` against the offset at which mlx-lm's own hook calls ``to_quantized``."""
    seen = []

    class Watched(KVCache):
        def to_quantized(self, **options):
            seen.append(self.offset)
            return KVCache.to_quantized(self, **options)

    for n, start, step in itertools.product([1, 2, 5, 9], [0, 1, 3, 8, 9, 12], [2, 4, 512]):
        seen.clear()
        caches = [Watched() for _ in range(qtiny.target.num_layers)]
        for _ in generate_step(mx.array(list(range(3, 3 + n))), qtiny.target.model, max_tokens=14,
                               prompt_cache=caches, kv_bits=8, quantized_kv_start=start, prefill_step_size=step):
            pass
        plan = KVPlan((LayerQuant(8, 64),) * qtiny.target.num_layers, start)
        assert seen[0] == plan.conversion_point(n, step), (n, start, step)


def test_quantized_references_depend_on_bits_and_conversion_point(qtiny):
    """The exactness tests below have teeth: 4-bit KV changes this target's greedy output, and so does moving
    the conversion point."""
    plain = [plain_greedy(qtiny.target, p, MAX) for p in PROMPTS]
    q4 = [reference(qtiny.target, p, 4, 0) for p in PROMPTS]
    late = [reference(qtiny.target, p, 4, 20) for p in PROMPTS]
    assert any(a != b for a, b in zip(q4, plain))
    assert any(a != b for a, b in zip(q4, late))


# -- speculative == plain greedy ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", [None, "draft-model", "assistant", "ngram", "deepspec"])
@pytest.mark.parametrize("bits,start", CASES)
def test_speculative_equals_generate_step(qtiny, name, bits, start):
    run = engine(qtiny, name, bits, start)
    recorder = CheckpointRecorder()
    results = run.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for index, (prompt, result) in enumerate(zip(PROMPTS, results)):
        assert result.tokens == reference(qtiny.target, prompt, bits, start)
        _, tokens, caches, _ = recorder.finish(index)
        point = run.conversion_point(len(prompt))
        if len(tokens) >= point:
            assert all(isinstance(c, QuantizedKVCache) and c.bits == bits and c.converted_at == point for c in caches)
        else:  # this row finished before it reached its conversion point
            assert all(type(c) is KVCache for c in caches)
    if name is not None:
        assert sum(r.drafted for r in results) > 0


@pytest.mark.parametrize("start", [1, 5])
def test_conversion_inside_a_chunked_prefill(qtiny, start):
    """prefill_step_size 4: a long prompt converts at a chunk end (4 or 8), as generate_step does."""
    for name in (None, "draft-model"):
        results = engine(qtiny, name, 4, start, step=4).run([RowRequest(p, max_tokens=MAX) for p in PROMPTS])
        for prompt, result in zip(PROMPTS, results):
            assert result.tokens == reference(qtiny.target, prompt, 4, start, step=4)


@pytest.mark.parametrize("start", [0, 9])
@pytest.mark.parametrize("name", ["assistant", "ngram"])
def test_per_layer_kv_config(qtiny, name, start):
    """kv_config quantizes layer 0 only (4 bits); layer 1 stays full precision."""
    config = (KVLayerConfig(0, bits=4, group_size=64),)
    run = engine(qtiny, name, None, start, kv_config=config)
    recorder = CheckpointRecorder()
    results = run.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for index, (prompt, result) in enumerate(zip(PROMPTS, results)):
        assert result.tokens == per_layer_greedy(qtiny.target, prompt, MAX, {0: (4, 64)}, start, 512)
        caches = recorder.finish(index)[2]
        assert isinstance(caches[0], QuantizedKVCache) and type(caches[1]) is KVCache
    tokens = [r.tokens for r in results]  # the per-layer plan is neither the uniform one nor full precision
    assert tokens != [reference(qtiny.target, p, 4, start) for p in PROMPTS]
    assert tokens != [plain_greedy(qtiny.target, p, MAX) for p in PROMPTS]


# -- restored == cold ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["draft-model", "assistant", "ngram"])
def test_engine_restore_equals_cold(qtiny, name):
    """Step 4, start 1: every prompt longer than 5 tokens converts at 4, so a finish checkpoint (converted at
    4) serves the next turn; the prompt boundary serves a repeat."""
    prompts = [PROMPTS[0], PROMPTS[2], [20, 21, 22, 23, 24, 25]]
    run = engine(qtiny, name, 4, 1, step=4)
    recorder = CheckpointRecorder()
    first = run.run([RowRequest(p, max_tokens=9) for p in prompts], on_checkpoint=recorder)
    repeat = [RowRequest(p, *recorder.boundary(i)[2:3], len(p) - 1, recorder.boundary(i)[3], max_tokens=MAX)
              for i, p in enumerate(prompts)]
    for prompt, result in zip(prompts, run.run(repeat)):
        assert result.tokens == reference(qtiny.target, prompt, 4, 1, step=4)
        assert result.cached_tokens >= len(prompt) - 2
    follow, requests = [], []
    for index, (prompt, result) in enumerate(zip(prompts, first)):
        _, tokens, caches, draft = recorder.finish(index)
        follow.append(prompt + result.tokens + [3 + index, 50])
        requests.append(RowRequest(follow[-1], caches, len(tokens), draft, max_tokens=MAX))
    for prompt, result in zip(follow, run.run(requests)):
        assert result.tokens == reference(qtiny.target, prompt, 4, 1, step=4)


def test_engine_refuses_a_state_converted_elsewhere(qtiny):
    """Start 0, step 512: a prompt converts at its own last prefill offset, so the boundary state of a shorter
    prompt (converted at 6) is not what a cold run of a longer one holds."""
    run = engine(qtiny, None, 4, 0)
    recorder = CheckpointRecorder()
    run.run([RowRequest(PROMPTS[0], max_tokens=2)], on_checkpoint=recorder)
    _, tokens, caches, _ = recorder.boundary(0)
    longer = PROMPTS[0] + [40, 41, 42]
    with pytest.raises(ValueError, match="converted at offset 6"):
        run.run([RowRequest(longer, caches, len(tokens), max_tokens=2)])
    plain = engine(qtiny, None)
    with pytest.raises(ValueError, match="without KV quantization"):
        plain.run([RowRequest(PROMPTS[0], caches, len(tokens), max_tokens=2)])


def load(tiny, cache, name, bits, start, step=512, **kwargs):
    return Generator.load(tiny.root / "target", None if name is None else tiny.drafter_dir(name), cache=cache,
                          kv=KVOptions(kv_bits=bits, quantized_kv_start=start), prefill_step_size=step, **kwargs)


@pytest.mark.parametrize("bits,start", [(4, 0), (8, 9)])
@pytest.mark.parametrize("name", ["assistant", "draft-model", "dflash"])
def test_generator_restored_equals_cold_also_after_reopen(qtiny, tmp_path, name, bits, start):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [reference(qtiny.target, p, bits, start) for p in prompts]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(qtiny, cache, name, bits, start)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
        warm = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in warm] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, warm))
        assert cache.drain()  # the checkpoints are written behind the request: LMDB holds them after the drain
        hit = cache.store.lookup(gen.ns_key, prompts[0][:-1])
        assert hit.minimum_reusable == gen.engine.conversion_point(len(prompts[0]))  # recorded conversion point
    with SpecCache.open(tmp_path / "store") as cache:
        again = load(qtiny, cache, name, bits, start).generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))


@pytest.mark.parametrize("name", ["deepspec", "ngram"])
def test_generator_per_layer_kv_config_restored_equals_cold_also_after_reopen(qtiny, tmp_path, name):
    """kv_config (layer 1 at 4 bits, group 32; start defaults to 0 for a kv_config): stored entries mix full
    precision and quantized layers."""
    kv = KVOptions(kv_config=(KVLayerConfig(1, bits=4, group_size=32),))
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [per_layer_greedy(qtiny.target, p, MAX, {1: (4, 32)}, 0, 512) for p in prompts]
    target, drafter = qtiny.root / "target", qtiny.drafter_dir(name)
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target, drafter, cache=cache, kv=kv)
        assert json.loads(gen.prefix_namespace)["kvConfig"] == [{"layerIdx": 1, "bits": 4, "groupSize": 32}]
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:
        again = Generator.load(target, drafter, cache=cache, kv=kv).generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        hit = cache.restore(gen.ns_key, prompts[0][:-1], drafter_namespace=gen.drafter_namespace)
        assert type(hit.caches[0]) is KVCache and hit.caches[1].group_size == 32
        assert hit.caches[1].converted_at == len(prompts[0]) - 1


def test_generator_next_turn_reuses_states_converted_at_its_point(qtiny, tmp_path):
    """Step 8, start 1: prompts longer than 9 convert at 8, so turn two resumes from turn one's finish."""
    prompt = list(range(3, 30))
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(qtiny, cache, "ngram", 4, 1, step=8)
        (first,) = gen.generate([prompt], max_tokens=MAX)
        follow = prompt + first.tokens + [7, 8, 9]
        (second,) = gen.generate([follow], max_tokens=MAX)
        assert second.cached_tokens == len(prompt) + MAX - 1
        assert second.tokens == reference(qtiny.target, follow, 4, 1, step=8)


def test_generator_skips_states_a_cold_run_would_not_hold(qtiny, tmp_path):
    """Start 40: turn one converts while decoding (at 40); turn two's cold run converts at its own last
    prefill offset, so turn one's finish state is unusable and the full-precision prompt boundary serves."""
    prompt = list(range(3, 40))
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(qtiny, cache, "assistant", 4, 40)
        (first,) = gen.generate([prompt], max_tokens=MAX)
        follow = prompt + first.tokens + [7, 8, 9]
        (second,) = gen.generate([follow], max_tokens=MAX)
        assert second.cached_tokens == len(prompt) - 1
        assert second.tokens == reference(qtiny.target, follow, 4, 40)


def test_chunk_prefix_below_the_conversion_point_is_not_reused(qtiny, tmp_path):
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        gen = load(qtiny, cache, None, 4, 0)
        gen.generate([list(range(3, 43))], max_tokens=4)  # converts at 39: chunks 0..31 are quantized
        diverged = list(range(3, 38)) + [250, 251, 252]
        (r,) = gen.generate([diverged], max_tokens=MAX)
        assert r.cached_tokens == 0
        assert r.tokens == reference(qtiny.target, diverged, 4, 0)


def test_stored_quantized_state_is_bit_identical(qtiny, tmp_path):
    recorder = CheckpointRecorder()
    engine(qtiny, None, 4, 0).run([RowRequest(PROMPTS[2], max_tokens=6)], on_checkpoint=recorder)
    _, tokens, caches, _ = recorder.finish(0)
    with SpecCache.open(tmp_path / "store") as cache:
        ns = cache.namespace("ab" * 32, "quantized")
        assert cache.save(ns, tokens, caches, minimum_reusable=caches[0].converted_at)
    with SpecCache.open(tmp_path / "store") as cache:
        hit = cache.restore(cache.namespace("ab" * 32, "quantized"), tokens + [1])
    assert hit.length == len(tokens)
    for before, after in zip(caches, hit.caches):
        assert (after.bits, after.group_size, after.converted_at) == (before.bits, before.group_size, before.converted_at)
        for a, b in zip((*before.keys, *before.values), (*after.keys, *after.values)):
            assert a.dtype == b.dtype and mx.array_equal(a[..., : len(tokens), :], b).item()


# -- quantized rows -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows_class", [QuantizedTargetRows, PerRowQuantizedTargetRows])
def test_quantized_rows_convert_exactly_at_the_point(qtiny, rows_class):
    """Batched rows (tests/library/test_quantized_batch.py) and the per-row reference path alike."""
    target = qtiny.target
    plan = plan_kv(KVOptions(kv_bits=4, quantized_kv_start=5), target.num_layers, [64, 64])
    rows = rows_class.from_row_caches(target, plan, [None, None], [5, 9])
    rows.prefill([[1, 2, 3, 4, 5, 6, 7], [1, 2]], step=512)
    assert rows.offsets == (7, 2) and rows.window_limits() == [None, 7]
    rows.verify([[8, 9, 10], [3, 4, 5]])
    rows.rollback([0, 1])
    assert rows.offsets == (10, 4) and rows.window_limits() == [None, 5]
    first, second = rows.extract(0), rows.extract(1)
    assert all(c.converted_at == 5 for c in first) and all(type(c) is KVCache for c in second)
    donor = rows.donors(0)
    assert donor.keys.shape == (2, 1, 10, 64) and donor.valid[1, 0, 0].tolist() == [False] * 6 + [True] * 4
    with pytest.raises(ValueError, match="conversion point"):
        rows.rollback([6, 0])  # would cut into the converted part of row 0
    with pytest.raises(ValueError, match="not what a cold run"):
        rows_class.from_row_caches(target, plan, [first], [7])


def test_reusable_rule():
    assert reusable(5, None, 8) and reusable(8, None, 8) and not reusable(9, None, 8)
    assert reusable(12, 8, 8) and reusable(8, 8, 8) and not reusable(12, 6, 8)


# -- refusals -----------------------------------------------------------------------------------------------
def test_turbo_quant_is_refused_before_anything_is_registered(qtiny, tmp_path):
    with pytest.raises(NotImplementedError, match="TurboQuant codec"):
        SpeculativeEngine(qtiny.target, None, kv=KVOptions(turbo_quant={"kBits": 8, "vBits": 3}))
    with SpecCache.open(tmp_path / "store") as cache:
        with pytest.raises(NotImplementedError, match="TurboQuant codec"):
            Generator.load(qtiny.root / "target", cache=cache, kv=KVOptions(kv_bits=4, turbo_quant={"kBits": 8}))
        from spec_cache.store import maintenance

        assert maintenance.namespaces(cache.store) == []


@pytest.mark.parametrize("options,error,match", [
    (KVOptions(kv_bits=7), ValueError, "7-bit"),
    (KVOptions(kv_bits=4, kv_group_size=128), ValueError, "not a multiple"),
    (KVOptions(kv_bits=4, kv_group_size=16), ValueError, "group size 16"),
    (KVOptions(kv_config=(KVLayerConfig(5, bits=4),)), ValueError, "2 layers"),
    (KVOptions(kv_config=(KVLayerConfig(0),)), ValueError, "no bits"),
])
def test_bad_kv_options_are_refused(qtiny, options, error, match):
    with pytest.raises(error, match=match):
        SpeculativeEngine(qtiny.target, None, kv=options)


def test_options_that_quantize_nothing_run_full_precision(qtiny):
    for options in (KVOptions(), KVOptions(kv_group_size=32), KVOptions(quantized_kv_start=3)):
        run = SpeculativeEngine(qtiny.target, None, kv=options)
        assert run.plan is None
        (result,) = run.run([RowRequest(PROMPTS[0], max_tokens=6)])
        assert result.tokens == plain_greedy(qtiny.target, PROMPTS[0], 6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_batches_restore_points_and_row_churn(qtiny, data):
    """Random prompts, budgets, depths, KV settings and restore points (kept only where a cold run would hold
    the same state), rows joining and leaving between rounds: always generate_step's tokens."""
    name = data.draw(st.sampled_from([None, "draft-model", "assistant", "ngram", "deepspec"]), label="provider")
    bits = data.draw(st.sampled_from([4, 8]), label="bits")
    start = data.draw(st.sampled_from([0, 3, 9, 40]), label="start")
    step = data.draw(st.sampled_from([4, 512]), label="step")
    run = engine(qtiny, name, bits, start, step=step, depth=data.draw(st.integers(0, 4), label="depth"))
    count = data.draw(st.integers(1, 4), label="rows")
    prompts = [data.draw(st.lists(st.integers(3, 255), min_size=1, max_size=16), label="prompt") for _ in range(count)]
    budgets = [data.draw(st.integers(1, 10), label="max_tokens") for _ in range(count)]
    requests = []
    for prompt, budget in zip(prompts, budgets):
        restored = data.draw(st.integers(0, len(prompt) - 1), label="restored_tokens")
        request = RowRequest(prompt, max_tokens=budget)
        if restored:
            recorder = CheckpointRecorder()
            run.run([RowRequest(prompt[: restored + 1], max_tokens=1)], on_checkpoint=recorder)
            _, tokens, caches, draft = recorder.boundary(0)
            if reusable(restored, converted_at(caches), run.conversion_point(len(prompt))):
                request = RowRequest(prompt, caches, restored, draft, max_tokens=budget)
        requests.append(request)
    max_rows = data.draw(st.one_of(st.none(), st.integers(1, 3)), label="max_rows")
    run.max_rows = max_rows
    for prompt, budget, result in zip(prompts, budgets, run.run(requests)):
        assert result.tokens == reference(qtiny.target, prompt, bits, start, step=step, max_tokens=budget)


def test_an_engine_built_directly_refuses_what_cannot_run():
    """plan_kv applies namespace.check_runnable: a layer named twice or a group size of 0 is refused, not
    silently resolved (last entry wins / 64)."""
    from spec_cache.naming.namespace import capture_options
    from spec_cache.rows.kv_quant import plan_kv

    with pytest.raises(ValueError, match="more than once"):
        plan_kv(capture_options({"kvConfig": [{"layerIdx": 0, "bits": 4}, {"layerIdx": 0, "bits": 8}]}), 2, [64, 64])
    with pytest.raises(ValueError, match="kv_group_size"):
        plan_kv(capture_options({"kvBits": 4, "kvGroupSize": 0}), 2, [64, 64])
