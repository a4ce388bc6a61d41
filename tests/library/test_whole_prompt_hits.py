"""A stored whole prompt serves a request that repeats it (issue 36 first hour, item 9).

A request looks up its prompt without the last token (the token it must forward). ``spec-cache serve`` stores a
checkpoint at the end of each prompt, so a repeated question, or the CLI on a store serve wrote, found only a
shorter prefix in LMDB (the memory tier already trimmed a longer entry; LMDB could not): "serve restores 100 of
101, the CLI 81". ``SpecCache.restore(next_token=...)`` now lets an LMDB entry of exactly the whole prompt serve
by trimming its last token (target only). Exactness: the tokens equal the target's own greedy tokens.
"""

from __future__ import annotations

import pytest

from spec_cache.decode.generator import Generator
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, build_tiny, plain_greedy  # noqa: F401

PROMPT = [5 + (i * 11) % 200 for i in range(40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("whole-prompt"),
                      drafters={"ngram": ("ngram", {}), "draft-model": ("draft-model", {})})


def _store_whole_prompt(tiny, path, drafter, prompt):
    """A checkpoint of exactly ``prompt`` in LMDB (as serve writes at a prompt's end), nothing shorter but the
    boundary of an unrelated prompt."""
    cache = SpecCache.open(path, memory_bytes=0)
    try:
        gen = Generator.load(tiny.root / "target", drafter, cache=cache)
        gen.write_behind = False
        # the finish checkpoint of prompt[:-2] decoding 3 tokens covers prompt[:-2] + 2 generated: make the
        # prompt of the repeat exactly that, so the stored entry is the repeat's whole prompt
        head = prompt[:-2]
        first = gen.generate([head], max_tokens=3)[0].tokens
        return head + first[:2]
    finally:
        cache.close()


@pytest.mark.parametrize("drafter", [None, "ngram", "draft-model"])
def test_an_entry_of_the_whole_prompt_serves_its_repeat_exactly(tiny, tmp_path, drafter):
    directory = None if drafter is None else (drafter if drafter == "ngram" else tiny.root / drafter)
    whole = _store_whole_prompt(tiny, tmp_path / "store", directory, PROMPT)
    cache = SpecCache.open(tmp_path / "store", memory_bytes=0)  # a fresh process: LMDB only
    try:
        gen = Generator.load(tiny.root / "target", directory, cache=cache)
        hit = gen.restore_for_prompt(whole)
        assert hit is not None and hit.length == len(whole) - 1  # was the 37-token boundary before (issue 36)
        assert hit.draft_checkpoint is None  # target only: the drafter row opens cold beside it
        result = gen.generate([whole], max_tokens=6)[0]
    finally:
        cache.close()
    assert result.cached_tokens == len(whole) - 1
    assert result.tokens == plain_greedy(tiny.target, whole, 6)


def test_no_whole_prompt_entry_leaves_the_lookup_as_it_was(tiny, tmp_path):
    """A prompt whose whole is not stored restores the longest shorter prefix, as before."""
    whole = _store_whole_prompt(tiny, tmp_path / "store", None, PROMPT)
    other = whole[:-1] + [(whole[-1] + 1) % 200 + 3]  # same head, another last token
    cache = SpecCache.open(tmp_path / "store", memory_bytes=0)
    try:
        gen = Generator.load(tiny.root / "target", None, cache=cache)
        hit = gen.restore_for_prompt(other)
        result = gen.generate([other], max_tokens=4)[0]
    finally:
        cache.close()
    assert hit is not None and hit.length < len(other) - 1
    assert result.tokens == plain_greedy(tiny.target, other, 4)


def test_a_stored_prefix_with_the_drafter_row_beats_a_trimmed_whole_prompt(tiny, tmp_path):
    """A prompt decoded for one token stores both its boundary (with the drafter row) and its whole prompt: the
    repeat restores the boundary with the row, not the trimmed whole (target only)."""
    for _ in range(2):
        cache = SpecCache.open(tmp_path / "store", memory_bytes=0)
        try:
            gen = Generator.load(tiny.root / "target", tiny.root / "draft-model", cache=cache)
            gen.write_behind = False
            result = gen.generate([PROMPT], max_tokens=1)[0]
        finally:
            cache.close()
    assert result.cached_tokens == len(PROMPT) - 1 and result.restored_drafter
