"""Generator + SpecCache end to end: restored == cold, across turns, processes and mixed batches; namespaces
isolate; broken entries are misses, never crashes (float32, greedy, tiny local models)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import lmdb
import pytest

from spec_cache.decode.generator import Generator
from spec_cache.drafters import METHODS as DRAFTER_METHODS
from spec_cache.naming.namespace import KVOptions
from spec_cache.testing.tiny import write_tiny_adapter
from spec_cache.tiers.cache import CacheWarning, SpecCache
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

METHODS = list(DRAFTER_METHODS)
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9, 10], list(range(60, 110))]
MAX = 10


def target_dir(tiny) -> Path:
    return tiny.root / "target"


def load(tiny, cache, method, **kwargs) -> Generator:
    drafter = None if method is None else tiny.drafter_dir(method)
    return Generator.load(target_dir(tiny), drafter, cache=cache, **kwargs)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 3])
def test_restored_equals_cold_equals_plain_greedy(tiny, tmp_path, method, batch):
    prompts = PROMPTS[:batch]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, method)
        cold = gen.generate(prompts, max_tokens=MAX)
        for p, r in zip(prompts, cold):
            assert r.tokens == plain_greedy(tiny.target, p, MAX)
            assert r.cached_tokens == 0
        warm = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in warm] == [r.tokens for r in cold]
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, warm))
        # the next turn extends prompt + answer: it resumes from the finish checkpoint
        follow = [p + r.tokens + [7, 8, 9] for p, r in zip(prompts, cold)]
        ext = gen.generate(follow, max_tokens=MAX)
        for p, old, r in zip(follow, cold, ext):
            assert r.tokens == plain_greedy(tiny.target, p, MAX)
            assert r.cached_tokens >= len(p) - 4 - 1 > 0


def test_reopen_in_a_new_process_restores_identically(tiny, tmp_path):
    store = tmp_path / "store"
    with SpecCache.open(store) as cache:
        cold = load(tiny, cache, "assistant").generate(PROMPTS, max_tokens=MAX)
    script = (
        "import json, sys\n"
        "from spec_cache.tiers.cache import SpecCache\nfrom spec_cache.decode.generator import Generator\n"
        f"c = SpecCache.open({str(store)!r})\n"
        f"g = Generator.load({str(target_dir(tiny))!r}, {str(tiny.drafter_dir('assistant'))!r}, cache=c)\n"
        f"rs = g.generate({PROMPTS!r}, max_tokens={MAX})\n"
        "print(json.dumps([[r.tokens, r.cached_tokens, r.restored_drafter] for r in rs]))\n"
        "c.close()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r[0] for r in rows] == [r.tokens for r in cold]
    assert [r[1] for r in rows] == [len(p) - 1 for p in PROMPTS] and all(r[2] for r in rows)


def test_batch_mixing_restored_and_cold_rows(tiny, tmp_path):
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, "draft-model")
        gen.generate([PROMPTS[0]], max_tokens=MAX)
        fresh = [200, 201, 202, 203, 204]
        mixed = gen.generate([PROMPTS[0], fresh, PROMPTS[2]], max_tokens=MAX)
        assert [r.cached_tokens for r in mixed] == [len(PROMPTS[0]) - 1, 0, 0]
        for p, r in zip([PROMPTS[0], fresh, PROMPTS[2]], mixed):
            assert r.tokens == plain_greedy(tiny.target, p, MAX)


@pytest.mark.parametrize("memory", [0, None], ids=["lmdb", "memory-tier"])
@pytest.mark.parametrize("method", METHODS)
def test_target_only_prefix_gives_a_cold_drafter_row(tiny, tmp_path, method, memory):
    """A chunk-boundary hit (LMDB) or a trimmed memory-tier entry carries no drafter part: the target skips its
    prefill, the drafter starts cold (a projected-context or MTP row beside the restored target, over the tokens
    forwarded from there on). The memory tier trims a held state to the exact common prefix."""
    with SpecCache.open(tmp_path / "store", chunk_tokens=16, memory_bytes=memory) as cache:
        gen = load(tiny, cache, method)
        gen.generate([list(range(3, 43))], max_tokens=4)
        diverged = list(range(3, 38)) + [250, 251, 252]  # shares 35 tokens: chunks up to 32, no entry
        (r,) = gen.generate([diverged], max_tokens=MAX)
        if memory == 0:
            assert 0 < r.cached_tokens <= 32 and not r.restored_drafter
        else:
            assert r.cached_tokens == 35 and not r.restored_drafter
        assert r.tokens == plain_greedy(tiny.target, diverged, MAX)


def test_namespaces_isolate(tiny, tmp_path):
    with SpecCache.open(tmp_path / "store") as cache:
        load(tiny, cache, "assistant").generate(PROMPTS, max_tokens=4)
        # another drafter: its own namespace, but the target part is shared (the target-only namespace, issue 38):
        # the drafter part never crosses
        for gen in (load(tiny, cache, "ngram"), load(tiny, cache, "draft-model")):
            results = gen.generate(PROMPTS, max_tokens=4)
            assert [(r.cached_tokens, r.restored_drafter) for r in results] == [(len(p) - 1, False) for p in PROMPTS]
        others = [load(tiny, cache, "assistant", kv=KVOptions(kv_group_size=32)),  # other KV options
                  load(tiny, cache, "assistant", adapters=write_tiny_adapter(tmp_path / "lora-a", target_dir(tiny))),
                  load(tiny, cache, "assistant", tenant="tenant-b")]  # another tenant
        for gen in others:
            assert all(r.cached_tokens == 0 for r in gen.generate(PROMPTS, max_tokens=4))
        # another target: one byte of its weights changed
        other_dir = tmp_path / "target-copy"
        shutil.copytree(target_dir(tiny), other_dir)
        weights = other_dir / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01
        weights.write_bytes(data)
        gen = Generator.load(other_dir, tiny.drafter_dir("assistant"), cache=cache)
        assert all(r.cached_tokens == 0 for r in gen.generate(PROMPTS, max_tokens=4))
        # and the original still restores
        assert all(r.cached_tokens > 0 for r in load(tiny, cache, "assistant").generate(PROMPTS, max_tokens=4))


def test_corrupt_entry_is_a_miss_with_a_warning(tiny, tmp_path):
    store_dir = tmp_path / "store"
    with SpecCache.open(store_dir) as cache:
        cold = load(tiny, cache, "assistant").generate([PROMPTS[0]], max_tokens=MAX)
    env = lmdb.open(str(store_dir), max_dbs=16)
    edata = env.open_db(b"edata")
    with env.begin(write=True) as txn:
        for key, value in list(txn.cursor(db=edata)):
            bad = bytearray(value)
            bad[len(bad) // 2] ^= 0xFF
            txn.put(key, bytes(bad), db=edata)
    env.close()
    with SpecCache.open(store_dir) as cache:
        with pytest.warns(CacheWarning, match="corrupt"):
            (r,) = load(tiny, cache, "assistant").generate([PROMPTS[0]], max_tokens=MAX)
        assert r.tokens == cold[0].tokens and r.cached_tokens == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (again,) = load(tiny, cache, "assistant").generate([PROMPTS[0]], max_tokens=MAX)
        assert again.tokens == cold[0].tokens and again.cached_tokens == len(PROMPTS[0]) - 1


def test_turbo_quant_is_refused_until_a_codec_exists(tiny, tmp_path):
    with SpecCache.open(tmp_path / "store") as cache:
        with pytest.raises(NotImplementedError, match="TurboQuant codec"):
            load(tiny, cache, "assistant", kv=KVOptions(turbo_quant={"kBits": 8, "vBits": 3}))
        from spec_cache.store import maintenance
        assert maintenance.namespaces(cache.store) == []  # nothing registered for a refused configuration


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from tests.runtime_fixtures import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.mark.parametrize("method,kv", [
    ("assistant", KVOptions()), ("deepspec", KVOptions()), ("dflash", KVOptions()), ("draft-model", KVOptions()),
    ("ngram", KVOptions(kv_bits=4, quantized_kv_start=0)), ("assistant", KVOptions(kv_bits=8, quantized_kv_start=9)),
])
def test_qwen2_target_restored_equals_cold_also_after_reopen(qwen2, tmp_path, method, kv):
    """A qwen2 target (attention biases, head_dim from hidden / heads) through the cache, full precision and
    quantized: cold == mlx-lm greedy, warm == cold, next turn == cold, also from a reopened store."""
    reference_options = {} if kv.kv_bits is None else {
        "kv_bits": kv.kv_bits, "quantized_kv_start": kv.quantized_kv_start, "prefill_step_size": 512}
    expected = [plain_greedy(qwen2.target, p, MAX, **reference_options) for p in PROMPTS]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(qwen2, cache, method, kv=kv)
        assert [r.tokens for r in gen.generate(PROMPTS, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(qwen2, cache, method, kv=kv)
        warm = gen.generate(PROMPTS, max_tokens=MAX)
        assert [r.tokens for r in warm] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(PROMPTS, warm))
        follow = [p + e + [7, 8] for p, e in zip(PROMPTS, expected)]
        for prompt, r in zip(follow, gen.generate(follow, max_tokens=MAX)):
            assert r.tokens == plain_greedy(qwen2.target, prompt, MAX, **reference_options)
            if kv.kv_bits is None:
                assert r.cached_tokens == len(prompt) - 3 and r.restored_drafter


def test_ttft_counts_the_restore_and_saves_happen_after_decoding(tiny, tmp_path, monkeypatch):
    """Result.ttft_s covers lookup + restore; checkpoints are written after the engine ran, and a checkpoint
    that was just restored is not written again."""
    import time as _time

    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, "assistant")
        gen.generate([PROMPTS[0]], max_tokens=4)
        assert cache.drain()  # the first call's write-behind puts land before store.put is watched
        real_restore = cache.restore

        def slow_restore(*args, **kwargs):
            _time.sleep(0.2)
            return real_restore(*args, **kwargs)
        monkeypatch.setattr(cache, "restore", slow_restore)
        puts = []
        real_put = cache.store.put
        monkeypatch.setattr(cache.store, "put", lambda *a, **k: puts.append(len(a[1])) or real_put(*a, **k))
        (r,) = gen.generate([PROMPTS[0]], max_tokens=4)
        assert r.cached_tokens == len(PROMPTS[0]) - 1 and r.ttft_s >= 0.2
        assert cache.drain()
        assert puts == [len(PROMPTS[0]) + 3]  # only the finish checkpoint: the boundary one was just restored


def test_prepare_and_save_checkpoint_seams_per_tenant(tiny, tmp_path):
    """What a server calls: ``prepare`` (lookup + engine request), ``save_checkpoint`` under a namespace key per
    tenant; a tenant's prefixes are invisible to another."""
    from spec_cache.decode.engine import RowRequest  # noqa: F401

    with SpecCache.open(tmp_path / "store") as cache:
        gen = load(tiny, cache, "assistant")
        key_a, key_b = gen.namespace_key("tenant-a"), gen.namespace_key("tenant-b")
        assert key_a != key_b and gen.namespace_key() == gen.ns_key
        cold = gen.prepare(PROMPTS[0], MAX, ns_key=key_a)
        assert cold.cached_tokens == 0 and cold.request.restored_caches is None

        def on_checkpoint(row, tokens, caches, draft):
            if cold.needs_save(tokens, draft, gen.drafter_namespace):
                gen.save_checkpoint(tokens, caches, draft, ns_key=key_a, background=False)

        (result,) = gen.engine.run([cold.request], on_checkpoint=on_checkpoint)
        assert result.tokens == plain_greedy(tiny.target, PROMPTS[0], MAX)
        warm = gen.prepare(PROMPTS[0], MAX, ns_key=key_a)
        assert warm.cached_tokens == len(PROMPTS[0]) - 1 and warm.restored_drafter
        assert not warm.needs_save(PROMPTS[0][:-1], object(), gen.drafter_namespace)
        assert gen.prepare(PROMPTS[0], MAX, ns_key=key_b).cached_tokens == 0
        assert gen.prepare(PROMPTS[0], MAX).cached_tokens == 0  # the generator's own (no tenant) neither
        (again,) = gen.engine.run([warm.request])
        assert again.tokens == result.tokens
