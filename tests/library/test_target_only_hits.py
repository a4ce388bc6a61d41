"""Target-only hits for the drafters that read the target's taps (deepspec, dflash, dflash2, qwen-mtp), and
externally supplied tokens fed to a "full"-prefill drafter through ``consume`` (issue 24, rows 15 and 27).

A prefix stored without this drafter's row (by another drafter of the same target, by none, or a chunk boundary)
restores the target; the drafter row opens cold beside it and covers the tokens forwarded from there on. The
tokens are the target's own greedy tokens whatever the drafter holds (float32, tiny local models)."""

from __future__ import annotations

import pytest

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.drafters import load_provider
from spec_cache.drafters.base import ColdRow, PartialRowCheckpoint, opened
from spec_cache.rows.target import TargetModel
from spec_cache.schemas import SchemaError
from spec_cache.testing.tiny import write_tiny_adapter, write_tiny_drafter, write_tiny_target
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import CheckpointRecorder, _identity_memo, build_tiny, plain_greedy  # noqa: F401

METHODS = {"deepspec": {}, "dflash": {"gamma": 4}, "dflash2": {"gamma": 4}, "qwen-mtp": {}}
LONG = list(range(3, 43))
OTHER = [60 + (i * 7) % 90 for i in range(30)]
FRESH = [200, 201, 202, 203, 204]
MAX = 10


class Two:
    """One tiny llama target; per method two drafters of it (seeds 0 and 1: two namespaces)."""

    def __init__(self, root):
        self.target_dir = write_tiny_target(root / "target", "llama", seed=0, tokenizer=False)
        self.target = TargetModel.load(self.target_dir)
        self.dirs = {(method, seed): write_tiny_drafter(root / f"{method}-{seed}", method, self.target_dir,
                                                        seed=seed, **options)
                     for method, options in METHODS.items() for seed in (0, 1)}

    def engine(self, method, seed):
        return SpeculativeEngine(self.target, load_provider(self.dirs[method, seed]), draft_depth=3, adaptive=False)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return Two(tmp_path_factory.mktemp("two-drafters"))


@pytest.mark.parametrize("method", list(METHODS))
def test_second_drafter_restores_the_first_ones_target_in_a_mixed_batch(two, method):
    first, second = two.engine(method, 0), two.engine(method, 1)
    assert first.provider.namespace != second.provider.namespace
    by_first = CheckpointRecorder()
    first.run([RowRequest(LONG, max_tokens=MAX)], on_checkpoint=by_first)
    by_second = CheckpointRecorder()
    second.run([RowRequest(OTHER, max_tokens=MAX)], on_checkpoint=by_second)
    _, tokens, caches, foreign = by_first.boundary(0)
    assert foreign is not None  # the first drafter's row: not the second's, so the second gets the target only
    _, own_tokens, own_caches, own = by_second.boundary(0)
    rows = [RowRequest(OTHER, restored_caches=own_caches, restored_tokens=len(own_tokens), draft_checkpoint=own,
                       max_tokens=MAX),  # warm: its own drafter row
            RowRequest(LONG, restored_caches=caches, restored_tokens=len(tokens), max_tokens=MAX),  # target only
            RowRequest(FRESH, max_tokens=MAX)]  # cold
    recorder = CheckpointRecorder()
    results = second.run(rows, on_checkpoint=recorder)
    for prompt, result in zip((OTHER, LONG, FRESH), results):
        assert result.tokens == plain_greedy(two.target, prompt, MAX)
    back = 1 if method == "qwen-mtp" else 0  # the head needs the hidden before the pending token
    assert [r.cached_tokens for r in results] == [len(OTHER) - 1, len(LONG) - 1 - back, 0]
    # the target-only row drafted all along, from its tail
    assert results[1].drafted > 0
    # its checkpoints: the MTP row's boundary one (it holds no row yet) is the target part only; its finish one
    # carries the partial row in its schema's layout, the missing head as zero rows (issue 38, item 2), which
    # opens as that partial row again; the others keep their full rows
    partial = [call[3] for call in recorder.calls if call[0] == 1]
    assert partial[:back] == [None] * back and len(partial) == 1 + back
    assert partial[-1] is not None and not isinstance(partial[-1], PartialRowCheckpoint)
    second.provider.validate_checkpoint(partial[-1])  # a checkpoint of its schema: a store takes it as it is
    reopened = opened(partial[-1])
    assert isinstance(reopened, PartialRowCheckpoint) and reopened.start == len(LONG) - 1 - back
    assert all(call[3] is not None for call in recorder.calls if call[0] != 1)
    # next turn of that conversation: prompt + answer + new tokens, from its finish checkpoint, target only and
    # with the partial drafter row: the same tokens either way
    _, done, done_caches, done_draft = recorder.finish(1)
    follow = LONG + results[1].tokens + [7, 8]
    for draft in (None, done_draft):
        (turn,) = second.run([RowRequest(follow, restored_caches=done_caches, restored_tokens=len(done),
                                         draft_checkpoint=draft, max_tokens=MAX)])
        assert turn.tokens == plain_greedy(two.target, follow, MAX)
        assert turn.cached_tokens == len(done)


@pytest.mark.parametrize("method", list(METHODS))
def test_partial_rows_move_between_groups_but_are_never_stored(two, method):
    provider = load_provider(two.dirs[method, 1])
    engine = SpeculativeEngine(two.target, provider, draft_depth=3, adaptive=False)
    by_first = CheckpointRecorder()
    engine.run([RowRequest(LONG, max_tokens=3)], on_checkpoint=by_first)
    _, tokens, caches, _ = by_first.boundary(0)
    session = engine.session()
    session.submit(RowRequest(LONG + [9, 10, 11], restored_caches=caches, restored_tokens=len(tokens),
                              max_tokens=MAX))
    session.step()
    partial = session.group.capture(0)
    assert isinstance(partial, PartialRowCheckpoint) and partial.processed_tokens == session.rows.offsets[0]
    assert 0 < partial.start <= len(tokens)
    with pytest.raises(SchemaError):  # not a checkpoint a store or a request may carry
        provider.validate_checkpoint(partial)
    with pytest.raises(ValueError, match="ColdRow"):
        ColdRow(0)
    session.close()


@pytest.mark.parametrize("method", ["dflash", "qwen-mtp"])
def test_generator_mixes_warm_target_only_and_cold_rows_after_reopening(two, tmp_path, method):
    drafter = two.dirs[method, 0]
    diverged = LONG[:35] + [250, 251, 252]  # shares 35 tokens with LONG: a chunk-boundary (target-only) hit at 32
    with SpecCache.open(tmp_path / "store", chunk_tokens=16, memory_bytes=0) as cache:
        Generator.load(two.target_dir, drafter, cache=cache).generate([LONG], max_tokens=4)
    with SpecCache.open(tmp_path / "store", chunk_tokens=16, memory_bytes=0) as cache:
        gen = Generator.load(two.target_dir, drafter, cache=cache)
        results = gen.generate([LONG, diverged, FRESH], max_tokens=MAX)
        for prompt, result in zip((LONG, diverged, FRESH), results):
            assert result.tokens == plain_greedy(two.target, prompt, MAX)
        assert [(r.cached_tokens, r.restored_drafter) for r in results] == [(len(LONG) - 1, True), (32, False),
                                                                            (0, False)]


@pytest.mark.parametrize("method", list(METHODS))
def test_two_drafters_share_the_target_prefix_under_an_adapter(two, tmp_path, method):
    """Under a target adapter these drafters cache no row of their own: every one of them (and a generator
    without a drafter) stores in one namespace, and each restores the target part another stored."""
    adapter = write_tiny_adapter(tmp_path / "lora", two.target_dir)
    prompts = [LONG, OTHER]
    plain = Generator.load(two.target_dir, None, cache=None, adapters=adapter).generate(prompts, max_tokens=MAX)
    with SpecCache.open(tmp_path / "store") as cache:
        first = Generator.load(two.target_dir, two.dirs[method, 0], cache=cache, adapters=adapter)
        assert [r.tokens for r in first.generate(prompts, max_tokens=MAX)] == [r.tokens for r in plain]
        second = Generator.load(two.target_dir, two.dirs[method, 1], cache=cache, adapters=adapter)
        assert second.ns_key == first.ns_key and second.drafter_namespace is None
        again = second.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == [r.tokens for r in plain]
        back = 1 if method == "qwen-mtp" else 0
        assert [r.cached_tokens for r in again] == [len(p) - 1 - back for p in prompts]
    with SpecCache.open(tmp_path / "store") as cache:  # reopened: from LMDB
        second = Generator.load(two.target_dir, two.dirs[method, 1], cache=cache, adapters=adapter)
        mixed = second.generate([LONG, FRESH], max_tokens=MAX)
        reference = Generator.load(two.target_dir, None, cache=None, adapters=adapter).generate([FRESH], MAX)
        assert [r.tokens for r in mixed] == [plain[0].tokens, reference[0].tokens]
        assert mixed[0].cached_tokens > 0 and mixed[1].cached_tokens == 0


class _Spy:
    """Wraps a provider: records every ``consume`` and ``prefill`` its row groups get."""

    def __init__(self, provider):
        self.provider, self.calls = provider, []
        original_consume = provider.rows_class.consume
        original_prefill = provider.rows_class.prefill
        spy = self

        class Rows(provider.rows_class):
            def consume(self, tokens_per_row, context, lengths):
                spy.calls.append(("consume", [list(t[:n]) for t, n in zip(tokens_per_row, lengths)]))
                return original_consume(self, tokens_per_row, context, lengths)

            def prefill(self, tokens_per_row, context):
                spy.calls.append(("prefill", [list(t) for t in tokens_per_row]))
                return original_prefill(self, tokens_per_row, context)

        provider.rows_class = Rows


def test_full_prefill_drafter_takes_appended_tokens_through_consume_and_drafts_as_if_prefilled(two):
    """A restored qwen-mtp row's new tokens reach the head through ``consume`` (the seed's external tokens), and
    the row drafts exactly as one that prefilled the whole prompt: same drafts accepted, same tokens."""
    provider = load_provider(two.dirs["qwen-mtp", 0])
    spy = _Spy(provider)
    engine = SpeculativeEngine(two.target, provider, draft_depth=3, adaptive=False)
    recorder = CheckpointRecorder()
    engine.run([RowRequest(LONG[:20], max_tokens=MAX)], on_checkpoint=recorder)
    _, tokens, caches, head = recorder.boundary(0)  # the head after its own prefill of LONG[:19]
    spy.calls.clear()
    (fed,) = engine.run([RowRequest(LONG, restored_caches=caches, restored_tokens=len(tokens), draft_checkpoint=head,
                                    max_tokens=MAX)])
    assert ("consume", [LONG[19:-1]]) in spy.calls  # the appended tokens, as external tokens
    assert all(call[1] == [[]] for call in spy.calls if call[0] == "prefill")
    spy.calls.clear()
    (prefilled,) = engine.run([RowRequest(LONG, max_tokens=MAX)])
    assert ("prefill", [LONG[:-1]]) in spy.calls and not any(call[0] == "consume" for call in spy.calls)
    assert fed.tokens == prefilled.tokens == plain_greedy(two.target, LONG, MAX)
    assert (fed.drafted, fed.accepted) == (prefilled.drafted, prefilled.accepted)
    assert fed.cached_tokens == 19 and prefilled.cached_tokens == 0


def test_mtp_head_beside_a_recurrent_target_keeps_the_whole_restore(tmp_path):
    """qwen3_next's recurrent state cannot be cut back one token for the head's hidden: the head starts beside the
    restored target without it (its first drafts are weaker), instead of the target forwarding everything again."""
    hybrid = build_tiny(tmp_path, "qwen3_next", num_layers=3, drafters={"qwen-mtp": ("qwen-mtp", {})})
    prompt = list(range(5, 30))
    calls = []  # (tokens, caches): recurrent layers have no offset for CheckpointRecorder to check
    SpeculativeEngine(hybrid.target, None).run([RowRequest(prompt, max_tokens=6)],
                                               on_checkpoint=lambda row, t, c, d: calls.append((list(t), c)))
    engine = SpeculativeEngine(hybrid.target, hybrid.provider("qwen-mtp"), draft_depth=3, adaptive=False)
    (tokens, caches), (done, done_caches) = calls
    follow = done + [77, 78, 79]
    at_boundary, next_turn = engine.run([
        RowRequest(prompt, restored_caches=caches, restored_tokens=len(tokens), max_tokens=MAX),
        RowRequest(follow, restored_caches=done_caches, restored_tokens=len(done), max_tokens=MAX)])
    assert at_boundary.tokens == plain_greedy(hybrid.target, prompt, MAX)
    assert next_turn.tokens == plain_greedy(hybrid.target, follow, MAX)
    assert (at_boundary.cached_tokens, next_turn.cached_tokens) == (len(prompt) - 1, len(done))
    assert at_boundary.drafted > 0 and next_turn.drafted > 0
