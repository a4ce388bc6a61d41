"""The target-only namespace through ``spec-cache serve`` (issue 38): a server started with a second drafter of
the same target (tiny dflash drafters, seeds 31 and 32) reports the prompt the first server stored as cached on its
first request (``usage.prompt_tokens_details.cached_tokens``), answers as the first one did (greedy, float32), and
keeps tenants apart; the next turn of that conversation is served from the second server's own checkpoints."""

from __future__ import annotations

import pytest

from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target
from tests.apps.test_cache_controls import cached, complete, greedy, prompt, text_of
from tests.apps.test_server import KEY_B, Server, stopped

MAX = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("target-only-serve")
    target = write_tiny_target(root / "tiny", seed=7)
    drafters = {seed: write_tiny_drafter(root / f"dflash-{seed}", "dflash", target, seed=seed, gamma=4)
                for seed in (31, 32)}
    return root, target, drafters


def serve(pair, seed: int, store, tmp) -> Server:
    _, target, drafters = pair
    return Server(target, store, tmp, "--drafter", str(drafters[seed]), "--method", "dflash",
                  probe_while_loading=False)  # no requests but the test's own


def tokens_of(answer: dict) -> str:
    return answer["choices"][0]["text"]


def test_second_drafter_server_restores_what_the_first_stored(pair, tmp_path):
    prompts = [prompt(1, 60), prompt(2, 97)]
    store = tmp_path / "store"
    first = serve(pair, 31, store, tmp_path)
    try:
        answers = [complete(first, p, max_tokens=MAX) for p in prompts]
        assert [cached(a) for a in answers] == [0, 0]
        first.wait_durable()
    finally:
        stopped(first)
    second = serve(pair, 32, store, tmp_path)
    try:
        again = [complete(second, p, max_tokens=MAX) for p in prompts]
        assert [tokens_of(a) for a in again] == [tokens_of(a) for a in answers]
        assert [cached(a) for a in again] == [len(p) - 1 for p in prompts]
        # another tenant (API key) shares nothing
        assert cached(complete(second, prompts[0], key=KEY_B, max_tokens=MAX)) == 0
        # the next turn: the second server's own checkpoint of the first turn (both parts) serves it
        follow = prompts[1] + [5, 6, 7]
        turn = complete(second, follow, max_tokens=MAX)
        assert cached(turn) >= len(prompts[1])
        second.wait_durable()
    finally:
        stopped(second)
    # its checkpoints of the target-only rows carry its own (partial) drafter row (issue 38, item 2): the next
    # turn's lookup under its namespace finds both parts
    parts = drafter_parts(store, pair[2][32])
    mine = [partial for length, partial in parts if length >= len(prompts[1])]  # KEY_A's second prompt, its turn
    assert mine and all(mine)  # rows opened beside a restored target: partial, stored all the same
    # the answers are the target's own greedy tokens
    for p, a in zip(prompts, again):
        assert tokens_of(a) == text_of(pair[1], greedy(pair[1], p, MAX))
    assert tokens_of(turn) == text_of(pair[1], greedy(pair[1], follow, MAX))


def drafter_parts(store, drafter_dir) -> list[tuple[int, bool]]:
    """(length, partial row) of each stored entry carrying ``drafter_dir``'s part, read back through the store as
    a restore reads it."""
    from spec_cache.drafters import load_provider
    from spec_cache.drafters.base import PartialRowCheckpoint, opened
    from spec_cache.state.cache_state import checkpoint_from_store
    from spec_cache.store import Store
    from spec_cache.store.index import Index, draft_key
    from spec_cache.store.read import piece_reader, read_attachment

    namespace = load_provider(drafter_dir).namespace
    out = []
    with Store.open(store, readonly=True) as opened_store:
        with opened_store.reading() as txn:
            index = Index(txn, opened_store.env.dbs)

            def raw(kind, k):
                return txn.get(k, db=opened_store.env.dbs["drafts"])
            for key, _ in txn.cursor(db=opened_store.env.dbs["entries"]):
                entry = index.entry(bytes(key))
                if entry is None or namespace not in entry.drafters:
                    continue
                dk = draft_key(bytes(key), namespace)
                attachment = read_attachment(raw("draft", dk), dk, entry.length, [], get_piece=piece_reader(raw))
                row = opened(checkpoint_from_store(entry.length, attachment))
                out.append((entry.length, isinstance(row, PartialRowCheckpoint)))
    return out
