"""Batched quantized KV: ``BatchQuantizedKVCache`` keeps each row's quantized words, scales and biases bit for bit
(merge / extract / per-row rollback / filter / extend), and ``QuantizedTargetRows`` (rows batched by phase) gives
bit-identical logits to the per-row path (``PerRowQuantizedTargetRows``) through prefill, speculative rounds with
rejected drafts, rows joining and leaving, and restored rows, and the tokens of a cold ``generate_step``."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from spec_cache.apps.bench.quantized_baseline import PerRowQuantizedTargetRows
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.naming.namespace import KVOptions
from spec_cache.rows.kv_quant import KVPlan, LayerQuant
from spec_cache.rows.protocol import apply_state_changes
from spec_cache.rows.quantized_batch import BatchQuantizedKVCache
from spec_cache.rows.quantized_rows import QuantizedTargetRows
from tests.runtime_fixtures import (  # noqa: F401
    CheckpointRecorder,
    _identity_memo,
    build_tiny,
    per_layer_greedy,
    plain_greedy,
)

MAX = 12
STEP = 4
START = 9  # with STEP 4: prompts of 14 and 20 tokens convert at 12 (inside prefill), 3 and 9 tokens at 9 (decoding)
#: (prompt, restored tokens): a converted restored row, a cold row converting while decoding, a cold row, a
#: full-precision restored row below its point
ROWS = [(list(range(30, 44)), 13), ([20, 21, 22], 0), ([5, 6, 7, 8, 9, 10, 11, 12, 13], 0), (list(range(60, 80)), 5)]
JOINING = [(list(range(100, 117)), 14), ([7, 3, 9, 4], 2)]


@pytest.fixture(scope="module")
def qtiny(tmp_path_factory):
    """A tiny llama whose greedy output is sensitive to 4-bit KV (larger weights than the default tiny)."""
    return build_tiny(tmp_path_factory.mktemp("tiny-qbatch"), init_scale=2.0,
                      drafters={"draft-model": ("draft-model", {}), "ngram": ("ngram", {})})


def uniform(target, bits, group):
    return KVPlan((LayerQuant(bits, group),) * target.num_layers, START)


_PER_LAYER: dict = {}


def reference(target, plan, prompt, max_tokens=MAX):
    """A cold ``generate_step`` under ``plan`` (memoized)."""
    quants = {i: (q.bits, q.group_size) for i, q in enumerate(plan.layers) if q is not None}
    if len(quants) < len(plan.layers):
        key = (id(target), plan, tuple(prompt), max_tokens)
        if key not in _PER_LAYER:
            _PER_LAYER[key] = per_layer_greedy(target, prompt, max_tokens, quants, plan.start, STEP)
        return list(_PER_LAYER[key])
    (bits, group), = set(quants.values())
    return plain_greedy(target, prompt, max_tokens, kv_bits=bits, kv_group_size=group, quantized_kv_start=plan.start,
                        prefill_step_size=STEP)


def arrays(cache):
    if cache.keys is None:
        return []
    return [*cache.keys, *cache.values] if isinstance(cache, QuantizedKVCache) else [cache.keys, cache.values]


def same_caches(a, b):
    assert [type(x) for x in a] == [type(y) for y in b]
    for x, y in zip(a, b):
        assert x.offset == y.offset and getattr(x, "converted_at", None) == getattr(y, "converted_at", None)
        for p, q in zip(arrays(x), arrays(y)):
            n = x.offset
            assert mx.array_equal(p[..., :n, :], q[..., :n, :]).item()


# -- the cache ----------------------------------------------------------------------------------------------
def quantized_row(length, bits=4, group=32, seed=0):
    cache = KVCache()
    if length:
        mx.random.seed(seed)
        cache.update_and_fetch(mx.random.normal((1, 2, length, 64)), mx.random.normal((1, 2, length, 64)))
    converted = cache.to_quantized(group_size=group, bits=bits)
    converted.offset = length
    return converted


def test_merge_extract_roundtrip_is_bit_exact():
    rows = [quantized_row(n, seed=n) for n in (5, 0, 300, 17)]
    batch = BatchQuantizedKVCache.merge(rows, group_size=32, bits=4)
    assert batch.offset.tolist() == [5, 0, 300, 17] and batch.left_padding.tolist() == [295, 300, 0, 283]
    for index, row in enumerate(rows):
        same_caches([batch.extract(index)], [row])
    mask = batch.make_mask(2)
    assert mask.shape == (4, 1, 2, 302) and not mask[0, 0, 0, 294].item() and mask[0, 0, 0, 295].item()


def test_rollback_filter_extend_keep_each_row():
    rows = [quantized_row(n, seed=n) for n in (6, 9, 3)]
    batch = BatchQuantizedKVCache.merge(rows, group_size=32, bits=4)
    mx.random.seed(7)
    new_k, new_v = mx.random.normal((3, 2, 4, 64)), mx.random.normal((3, 2, 4, 64))
    batch.update_and_fetch(new_k, new_v)
    batch.prepare(right_padding=[0, 3, 4])
    batch.finalize()
    assert batch.offset.tolist() == [10, 10, 3]
    for index, (row, kept) in enumerate(zip(rows, [4, 1, 0])):
        single = quantized_row(row.offset, seed=row.offset)
        single.update_and_fetch(new_k[index : index + 1, :, :4], new_v[index : index + 1, :, :4])
        single.trim(4 - kept)
        same_caches([batch.extract(index)], [single])
    expected = [batch.extract(i) for i in range(3)]
    batch.filter(mx.array([2, 0]))
    assert batch.offset.tolist() == [3, 10] and min(batch.left_padding.tolist()) == 0
    same_caches([batch.extract(0), batch.extract(1)], [expected[2], expected[0]])
    batch.extend(BatchQuantizedKVCache.merge([quantized_row(40, seed=40)], group_size=32, bits=4))
    same_caches([batch.extract(i) for i in range(3)], [expected[2], expected[0], quantized_row(40, seed=40)])
    with pytest.raises(ValueError, match="8-bit / group 32 rows to 4-bit / group 32"):
        batch.extend(BatchQuantizedKVCache([0], group_size=32, bits=8))
    with pytest.raises(ValueError, match="row 0: 4-bit / group 32 KV, the batch holds 4-bit / group 64"):
        BatchQuantizedKVCache.merge(rows, group_size=64, bits=4)
    with pytest.raises(ValueError, match="row 0: a KVCache cannot join quantized rows"):
        BatchQuantizedKVCache.merge([KVCache()], group_size=32, bits=4)


# -- batched rows == per-row rows, in lockstep -----------------------------------------------------------------
def restore(target, plan, prompt, tokens):
    """A restored state of ``prompt[:tokens]`` as a cold run converting at the full prompt's point holds it."""
    rows = PerRowQuantizedTargetRows.from_row_caches(target, plan, [None], [plan.conversion_point(len(prompt), STEP)])
    rows.prefill([prompt[:tokens]], STEP)
    return rows.extract(0)


def build(cls, target, plan, specs):
    caches = [restore(target, plan, prompt, n) if n else None for prompt, n in specs]
    points = [plan.conversion_point(len(prompt), STEP) for prompt, _ in specs]
    return cls.from_row_caches(target, plan, caches, points)


class Lockstep:
    """The same prefill and speculative rounds on batched and per-row rows; every output compared bitwise.

    Drafts come from the reference continuation with random corruptions, so rounds accept some drafts and roll the
    rest back; a row that has not converted keeps at most its window limit."""

    def __init__(self, target, plan, specs, seed=0):
        self.target, self.plan, self.rng = target, plan, random.Random(seed)
        self.batched = build(QuantizedTargetRows, target, plan, specs)
        self.per_row = build(PerRowQuantizedTargetRows, target, plan, specs)
        self.prompts = [prompt for prompt, _ in specs]
        self.out = [[] for _ in specs]
        self.pending = [prompt[-1] for prompt in self.prompts]
        self._prefill(self.batched, self.per_row, specs)

    @staticmethod
    def _prefill(batched, per_row, specs):
        tokens = [prompt[n:-1] for prompt, n in specs]
        a, b = batched.prefill(tokens, STEP, tap_layers=(0,)), per_row.prefill(tokens, STEP, tap_layers=(0,))
        assert a.lengths == b.lengths
        if any(a.lengths):
            assert mx.array_equal(a.last_hidden, b.last_hidden).item() and mx.array_equal(a.taps[0], b.taps[0]).item()

    def join(self, specs):
        joining = [build(cls, self.target, self.plan, specs)
                   for cls in (QuantizedTargetRows, PerRowQuantizedTargetRows)]
        self._prefill(*joining, specs)
        apply_state_changes([lambda: self.batched.prepare_append(joining[0]),
                             lambda: self.per_row.prepare_append(joining[1])])
        self.prompts += [prompt for prompt, _ in specs]
        self.out += [[] for _ in specs]
        self.pending += [prompt[-1] for prompt, _ in specs]

    def leave(self, keep):
        for rows in (self.batched, self.per_row):
            rows.filter_rows(keep)
        self.prompts, self.out, self.pending = ([xs[i] for i in keep] for xs in (self.prompts, self.out, self.pending))

    def round(self, depth):
        assert self.batched.offsets == self.per_row.offsets
        limits = self.batched.window_limits()
        assert limits == self.per_row.window_limits()
        windows = []
        for prompt, out, pending in zip(self.prompts, self.out, self.pending):
            guess = (reference(self.target, self.plan, prompt, MAX + depth + 1)[len(out):] + [1] * depth)[:depth]
            windows.append([pending] + [self.rng.randrange(3, 250) if self.rng.random() < 0.3 else t for t in guess])
        a, b = self.batched.verify(windows), self.per_row.verify(windows)
        assert mx.array_equal(a.logits, b.logits).item() and mx.array_equal(a.hidden, b.hidden).item()
        greedy = mx.argmax(a.logits, axis=-1).tolist()
        rejected = []
        for row, (window, picks, limit) in enumerate(zip(windows, greedy, limits)):
            kept = 1
            while kept < len(window) and window[kept] == picks[kept - 1]:
                kept += 1
            kept = kept if limit is None else min(kept, limit)
            self.out[row] += picks[:kept]
            self.pending[row] = picks[kept - 1]
            rejected.append(len(window) - kept)
        for rows in (self.batched, self.per_row):
            rows.rollback(rejected)
        return rejected

    def check(self):
        for row, (prompt, out) in enumerate(zip(self.prompts, self.out)):
            assert out[:MAX] == reference(self.target, self.plan, prompt)[: len(out)]
            same_caches(self.batched.extract(row), self.per_row.extract(row))
        for layer in range(self.target.num_layers):
            a, b = self.batched.donors(layer), self.per_row.donors(layer)
            assert a.positions.tolist() == b.positions.tolist()
            for row, length in enumerate(a.positions.tolist()):
                if length == 0:
                    continue
                for view in (a, b):  # right-aligned: exactly the last `length` keys are valid
                    valid = view.valid[row, 0, 0].tolist()
                    assert valid[len(valid) - length :] == [True] * length and not any(valid[: len(valid) - length])
                assert mx.array_equal(a.keys[row, :, -length:], b.keys[row, :, -length:]).item()
                assert mx.array_equal(a.values[row, :, -length:], b.values[row, :, -length:]).item()


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("count", [1, 3, 4])
def test_batched_rows_equal_per_row_and_generate_step(qtiny, count, bits, group):
    target = qtiny.target
    plan = uniform(target, bits, group)
    run = Lockstep(target, plan, ROWS[:count], seed=count * bits + group)
    rejected = 0
    for index in range(40):
        if index == 2:
            run.join(JOINING)  # a converted restored row and a cold one join mid-decode
        rejected += sum(run.round(depth=3))
        done = [len(out) >= MAX for out in run.out]
        if index >= 2 and any(done) and not all(done):
            run.check()
            run.leave([row for row, finished in enumerate(done) if not finished])
        if all(done):
            break
    assert all(len(out) >= MAX for out in run.out) and rejected > 0
    run.check()


def test_per_layer_plan_batches_mixed_layer_kinds(qtiny):
    """kv_config-like plan: layer 1 quantized (4-bit, group 32), layer 0 full precision in the converted group."""
    target = qtiny.target
    plan = KVPlan((None, LayerQuant(4, 32)), START)
    run = Lockstep(target, plan, ROWS, seed=5)
    while not all(len(out) >= MAX for out in run.out):
        run.round(depth=2)
    run.check()
    converted = run.batched.extract(0)
    assert type(converted[0]) is KVCache and isinstance(converted[1], QuantizedKVCache)


def test_rows_share_one_forward_per_phase(qtiny, monkeypatch):
    """The point of batching: 4 converted rows verify in one forward; rows before and after their conversion
    point in two; the per-row path takes one per row."""
    target = qtiny.target
    plan = uniform(target, 4, 64)
    batch_sizes = []
    forward = target.forward

    def counted(ids, caches, **options):
        batch_sizes.append(ids.shape[0])
        return forward(ids, caches, **options)

    specs = [(list(range(30, 44)), 13), (list(range(60, 80)), 13), (list(range(90, 110)), 0), ([9] * 16, 0)]
    monkeypatch.setattr(target, "forward", counted)
    for cls, expected in ((QuantizedTargetRows, [4]), (PerRowQuantizedTargetRows, [1, 1, 1, 1])):
        rows = build(cls, target, plan, specs)
        rows.prefill([prompt[n:-1] for prompt, n in specs], STEP)
        batch_sizes.clear()
        rows.verify([[1, 2]] * 4)
        assert batch_sizes == expected
    mixed = build(QuantizedTargetRows, target, plan, ROWS)
    mixed.prefill([prompt[n:-1] for prompt, n in ROWS], STEP)
    assert mixed.window_limits() == [None, 7, 1, None]  # rows 1 and 2 convert at 9, while decoding
    batch_sizes.clear()
    mixed.verify([[1]] * 4)
    assert sorted(batch_sizes) == [2, 2]


def test_refusals(qtiny):
    target = qtiny.target
    plan = uniform(target, 4, 64)
    rows = build(QuantizedTargetRows, target, plan, ROWS)
    with pytest.raises(ValueError, match="equal length"):
        rows.verify([[1], [1, 2], [1], [1]])
    with pytest.raises(ValueError, match="cannot roll back below its conversion point 12"):
        rows.rollback([2, 0, 0, 0])
    with pytest.raises(ValueError, match="another KV plan"):
        rows.prepare_append(build(QuantizedTargetRows, target, uniform(target, 8, 64), ROWS[:1]))
    restored = restore(target, plan, *ROWS[0])
    with pytest.raises(ValueError, match="not what a cold run converting at 9 holds"):
        QuantizedTargetRows.from_row_caches(target, plan, [restored], [9])
    with pytest.raises(ValueError, match="the plan wants 8-bit / group 64"):
        QuantizedTargetRows.from_row_caches(target, uniform(target, 8, 64), [restored], [12])


# -- the engine -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["draft-model", "ngram"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_engine_restored_and_cold_rows_equal_generate_step(qtiny, name, bits, group):
    """Four rows, two restored (one converted, one below its point), one joining later (max_rows 3)."""
    options = KVOptions(kv_bits=bits, kv_group_size=group, quantized_kv_start=START)
    run = SpeculativeEngine(qtiny.target, qtiny.provider(name), draft_depth=3, kv=options, prefill_step_size=STEP,
                            adaptive=False)
    plan = run.plan
    requests = []
    for prompt, restored in ROWS:
        if restored:
            recorder = CheckpointRecorder()
            run.run([RowRequest(prompt[: restored + 1], max_tokens=1)], on_checkpoint=recorder)
            # a boundary state at `restored` tokens only converted where the full prompt converts
            caches = restore(qtiny.target, plan, prompt, restored)
            requests.append(RowRequest(prompt, caches, restored, recorder.boundary(0)[3], max_tokens=MAX))
        else:
            requests.append(RowRequest(prompt, max_tokens=MAX))
    run.max_rows = 3
    results = run.run(requests)
    for (prompt, _), result in zip(ROWS, results):
        assert result.tokens == reference(qtiny.target, plan, prompt)
    if name == "draft-model":
        assert sum(r.drafted for r in results) > sum(r.accepted for r in results) > 0


def test_bench_runs_and_asserts_identical_tokens():
    from spec_cache.apps.bench.quantized import run

    figures = run(hidden=128, layers=2, vocab=256, prompt_tokens=12, new_tokens=4, rows=3, bits=(4,),
                  drafted=False, reps=1)
    assert figures["quantized_batch_speedup"] > 0 and figures["rows"] == 3
    assert set(figures) >= {"q4_batch_tok_s", "q4_per_row_tok_s", "fp32_batch_tok_s", "blas"}
