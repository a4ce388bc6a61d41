"""Issue 38 item 6: the gemma3_text row of the README's table ("all seven" drafters; "every yes cell is tested ...
after reopening") for the drafters ``test_sliding_window`` did not reopen: ngram, deepspec, dflash2, qwen-mtp.

The same tiny gemma3_text target (3 layers, window 6 < the prompts: the rings wrap) and the same shape as
``test_sliding_window.test_generator_restored_equals_cold_also_after_reopen``: a first ``SpecCache`` stores the runs,
a new one over the same directory restores the prompt boundary (target and drafter state) and an extended turn;
tokens == mlx-lm's plain greedy.
"""

from __future__ import annotations

import pytest

from spec_cache.decode.generator import Generator
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny, plain_greedy  # noqa: F401

WINDOW = 6
MAX = 12
DRAFTERS = {"ngram": ("ngram", {}), "deepspec": ("deepspec", {}), "dflash2": ("dflash2", {"gamma": 4}),
            "qwen-mtp": ("qwen-mtp", {})}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-gemma3-reopen"), "gemma3_text", num_layers=3,
                      sliding_window=WINDOW, drafters=DRAFTERS)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_generator_restored_equals_cold_also_after_reopen(gemma, tmp_path, name):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(gemma.target, p, MAX) for p in prompts]
    target_dir, drafter_dir = gemma.root / "target", gemma.drafter_dir(name)
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        for prompt, r in zip(follow, gen.generate(follow, max_tokens=MAX)):
            assert r.tokens == plain_greedy(gemma.target, prompt, MAX) and r.cached_tokens == len(prompt) - 3
