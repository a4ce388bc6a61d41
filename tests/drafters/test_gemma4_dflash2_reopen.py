"""Issue 38 item 6: dflash2 on a Gemma 4 target after reopening the store (the README's "every yes cell is tested
after reopening"; ``test_projected_seed`` reopened deepspec and dflash on gemma4_text, not dflash2).

The tiny gemma4_text target of ``test_projected_seed`` (4 decoder layers: sliding, global, then a KV-shared sliding
and a KV-shared global layer; window 6, shorter than the prompts, so the rings wrap) with a tiny dflash2 drafter:
a first ``SpecCache`` stores the runs; a new one over the same directory restores the prompt boundary (target and
the drafter's context: ``restored_drafter``) and an extended turn beside a cold prompt; tokens == mlx-lm's plain
greedy every time.
"""

from __future__ import annotations

from spec_cache.decode.generator import Generator
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny, plain_greedy  # noqa: F401

MAX = 12


def test_dflash2_on_gemma4_restores_after_reopen(tmp_path):
    gemma4 = build_tiny(tmp_path / "tiny", "gemma4_text", num_layers=4, kv_shared_layers=2, sliding_window=6,
                        drafters={"dflash2": ("dflash2", {})})
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(gemma4.target, p, MAX) for p in prompts]
    target_dir, drafter_dir = gemma4.root / "target", gemma4.drafter_dir("dflash2")
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        first = Generator.load(target_dir, drafter_dir, cache=cache).generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in first] == expected
        assert sum(r.drafted for r in first) > 0  # the drafter ran
    with SpecCache.open(tmp_path / "store") as cache:  # a new SpecCache over the same directory
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        assert gen.drafter_namespace.startswith("dflash2-context-v1:")
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert [r.cached_tokens for r in again] == [len(p) - 1 for p in prompts]
        assert all(r.restored_drafter for r in again)  # the drafter's context came back from the store too
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        mixed = follow + [list(range(100, 120))]
        results = gen.generate(mixed, max_tokens=MAX)
        for prompt, result in zip(mixed, results):
            assert result.tokens == plain_greedy(gemma4.target, prompt, MAX)
        assert [r.cached_tokens for r in results] == [len(f) - 3 for f in follow] + [0]
