"""Issue 38 item 6: yes cells of the README's targets x drafters table ("every cell marked yes is tested ... after
reopening") that no test reopened: gemma3_text ("all seven") with ngram, deepspec, dflash2 and qwen-mtp
(``test_sliding_window`` reopens assistant, draft-model and dflash), and qwen3_next with qwen-mtp
(``test_hybrid_target`` reopens ngram and draft-model; ``test_mtp_drafters`` runs the hybrid's head without a store).

The tiny gemma3_text target (3 layers, window 6 < the prompts: the rings wrap) in the shape of
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


def test_qwen_mtp_on_a_hybrid_qwen3_next_target_restores_after_reopen(tmp_path):
    """The qwen3_next row's qwen-mtp cell (the head copies the target's gated attention layer): recurrent state
    and the head's row come back from a reopened store; an extended turn and a cold row beside it equal plain
    greedy."""
    from spec_cache.rows.target import TargetModel
    from spec_cache.testing.tiny import write_tiny_target
    from spec_cache.testing.tiny_writers import write_tiny_drafter_extra

    target_dir = write_tiny_target(tmp_path / "target", "qwen3_next", tokenizer=False)
    drafter_dir = write_tiny_drafter_extra(tmp_path / "mtp", "qwen-mtp", target_dir)
    target = TargetModel.load(target_dir)
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(target, p, MAX) for p in prompts]
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        first = Generator.load(target_dir, drafter_dir, cache=cache).generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in first] == expected and sum(r.drafted for r in first) > 0
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        mixed = follow + [list(range(100, 120))]
        for prompt, r in zip(mixed, gen.generate(mixed, max_tokens=MAX)):
            assert r.tokens == plain_greedy(target, prompt, MAX)
            assert r.cached_tokens == (len(prompt) - 3 if prompt in follow else 0)
