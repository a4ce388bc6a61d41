"""spec_cache.decode.warmup: the kernel warm-up runs every class it promises, writes nothing, changes no token.

On the CPU there is nothing to compile, so these tests check the behaviour that holds everywhere (what runs, what
it leaves behind), not the GPU compile time it saves (measured on the H200: tools/device/shape_compile.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from spec_cache.decode import warmup
from spec_cache.store import maintenance


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    root = tmp_path_factory.mktemp("warmup")
    target = write_tiny_target(root / "target", seed=5)
    drafter = write_tiny_drafter(root / "draft", "draft-model", target, seed=5)
    return target, drafter


def _prompts() -> list[list[int]]:
    return [[3 + (i * 11) % 90 for i in range(n)] for n in (9, 30)]


def test_warm_up_covers_every_class_and_writes_nothing(models, tmp_path):
    from spec_cache import Generator, SpecCache

    target, drafter = models
    with SpecCache.open(tmp_path / "cache") as cache:
        gen = Generator.load(target, drafter, method="draft-model", cache=cache, draft_depth=3,
                             prefill_step_size=64)
        report = warmup.warm_up(gen.engine)
        labels = [label for label, _ in report.timings]
        assert [f"prompt {n + 1}" for n in warmup.BASE_LENGTHS if n <= 64] == labels[:len(labels) - 8 - 1 - 1 - 6]
        assert {f"{r} rows" for r in range(1, 9)} <= set(labels) and "8 rows leaving, 66 tokens" in labels
        assert "rows joining 66 tokens" in labels
        assert {f"depth {d}, {r} rows" for d in (1, 2, 3) for r in (1, 2)} <= set(labels)
        assert report.runs == len(labels) and report.seconds > 0 and report.slowest[0] in labels
        assert cache.drain()
        assert maintenance.entries(cache.store) == [] and cache.memory_stats().get("entries", 0) == 0
        warm = gen.generate(_prompts(), max_tokens=12)
    cold_gen = Generator.load(target, drafter, method="draft-model", draft_depth=3, prefill_step_size=64)
    cold = cold_gen.generate(_prompts(), max_tokens=12)
    assert [r.tokens for r in warm] == [r.tokens for r in cold]


def test_warm_up_respects_max_rows_and_plain_engines(models):
    from spec_cache.decode.engine import SpeculativeEngine
    from spec_cache.rows.target import TargetModel

    target, _ = models
    engine = SpeculativeEngine(TargetModel.load(target), None, 0, max_rows=2, prefill_step_size=16)
    report = warmup.warm_up(engine, lengths=[1, 5])
    assert [label for label, _ in report.timings] == ["prompt 2", "prompt 6", "1 rows", "2 rows",
                                                      "2 rows leaving, 18 tokens", "rows joining 18 tokens"]
    one = SpeculativeEngine(TargetModel.load(target), None, 0, max_rows=1, prefill_step_size=16)
    assert "rows joining 18 tokens" not in [label for label, _ in warmup.warm_up(one, lengths=[1]).timings]


def test_the_joining_case_joins_rows_to_a_decoding_batch_over_a_long_context(models, monkeypatch):
    """``_joining``: a long row joins chunk by chunk and short rows join whole while a row decodes over more than a
    prefill chunk (the merges and batch sizes a server meets at its next turns), within the engine's join budget."""
    from spec_cache.decode import engine as engine_module
    from spec_cache.decode.engine import SpeculativeEngine
    from spec_cache.rows.target import TargetModel

    target, _ = models
    engine = SpeculativeEngine(TargetModel.load(target), None, 0, max_rows=4, prefill_step_size=32)
    joined = []
    admit = engine_module.DecodeSession._admit

    def watched(self, cohort):
        joined.append((len(self.active), [len(row.request.prompt) for row in cohort]))
        return admit(self, cohort)

    monkeypatch.setattr(engine_module.DecodeSession, "_admit", watched)
    warmup._joining(engine, 33, 1000, 3)  # as warm_up calls it: long = the prefill step + 1
    assert joined[0] == (0, [34])  # the first row, alone
    assert (1, [73]) in joined  # a longer row, admitted while the first decodes (it joins by chunks)
    assert any(active >= 1 and lengths == [24] for active, lengths in joined)  # a short row, whole


def test_the_long_context_attention_runs_each_route_within_the_model_context(models, monkeypatch):
    """``warm_attention``: one unpadded row ("causal") and two left-padded rows (the array mask) per key length and
    chunk, keys capped by the model's context, the two-row cases bounded (their mask widens to a bias on CUDA);
    each call MLX's own ``scaled_dot_product_attention`` with those masks. Part of ``warm_up`` only on a GPU."""
    import mlx.core as mx

    from spec_cache.rows.target import TargetModel

    target = TargetModel.load(models[0])
    seen = []
    real = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask):
        seen.append((q.shape[0], q.shape[2], k.shape[2], mask if isinstance(mask, str) else mask.shape))
        return real(q, k, v, scale=scale, mask=mask)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    timings = warmup.warm_attention(target, 64, keys=(128, 512, 4096), max_keys=600)
    assert [label for label, _ in timings] == [
        f"attention {rows}x{chunk} over {keys} keys" for keys in (128, 512) for chunk in (64, 65)
        for rows in (1, 2) if chunk < keys]
    assert all(seconds >= 0 for _, seconds in timings)
    assert seen[0] == (1, 64, 128, "causal") and seen[1] == (2, 64, 728, (2, 1, 64, 728))  # 600 keys of padding
    monkeypatch.setattr(warmup, "ARRAY_MAX_KEYS", 256)
    seen.clear()
    warmup.warm_attention(target, 64, keys=(512,), max_keys=600)
    assert {rows for rows, *_ in seen} == {1}


def test_wanted_only_on_a_gpu(models):
    import mlx.core as mx

    assert warmup.wanted(None) == (mx.default_device() == mx.gpu)


def test_serve_warmup_on_reports_ready_after_the_warm_up(models, tmp_path):
    from tests.apps.test_server import Server

    target, _ = models
    srv = Server(Path(target), tmp_path / "store", tmp_path, "--warmup", "on", "--prefill-step-size", "64",
                 probe_while_loading=False)
    try:
        assert "warm-up compiled in" in srv.log.read_text()  # before /health said ready
        assert "copy routes ready in" in srv.log.read_text()  # the restore and capture routes set up too
        assert srv.metric("spec_cache_memory_tier_entries") == 0  # the warm-up stored nothing
        reply = httpx.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=60,
                           json={"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        srv.stop()
    off = Server(Path(target), tmp_path / "store-off", tmp_path, "--warmup", "off")
    try:
        assert "warm-up compiled in" not in off.log.read_text() and "copy routes ready" not in off.log.read_text()
    finally:
        off.stop()
