"""The target-only namespace (issue 38, items 1 and 2): the target part of a prefix stored under one drafter
serves every other drafter of the same target, adapters and KV options.

Two tiny drafters of one method (seeds 31 and 32: two artifact identities, two seed prefix namespaces) over one
tiny float32 llama target: the second drafter's first request restores the prompt the first one stored, target
only, and its tokens are the target's own greedy tokens. Lookups never cross tenants, adapters or KV options; the
seed's namespace strings are unchanged (``namespaces.json``); the target-only namespace has golden vectors of its
own (``target_namespaces.json``, written by ``make_target_namespaces.py`` from the formula)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec_cache.decode.generator import Generator
from spec_cache.naming.namespace import (
    TARGET_NAMESPACE_TAG,
    KVOptions,
    namespace_key_hex,
    ngram_namespace,
    prefix_namespace,
    target_namespace,
    target_namespace_of,
)
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import write_tiny_adapter, write_tiny_drafter, write_tiny_target
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import _identity_memo, plain_greedy  # noqa: F401

GOLDEN = Path(__file__).parents[1] / "golden"
TAPS = {"deepspec": {}, "dflash": {"gamma": 4}, "dflash2": {"gamma": 4}, "qwen-mtp": {}}
OTHERS = {"ngram": None, "draft-model": {}, "assistant": {}}
MAX = 8


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt * 13) % 240 for i in range(n)]


PROMPTS = [prompt(60), prompt(97, 1), prompt(300, 2)]


# --- the namespace: golden vectors, domain separation ----------------------------------------------------------

def _golden(name: str) -> list[dict]:
    return json.loads((GOLDEN / name).read_text(encoding="ascii"))


def _tenant(raw):
    return bytes.fromhex(raw["bytes_hex"]) if isinstance(raw, dict) else raw


@pytest.mark.parametrize("case", _golden("target_namespaces.json"), ids=lambda case: case["name"])
def test_target_namespace_golden_vector(case):
    text = target_namespace(case["adapters"], case["options"])
    assert text == case["target_namespace"] == target_namespace(case["adapters"],
                                                                 KVOptions.from_mapping(case["options"]))
    assert target_namespace_of(case["seed_namespace"]) == text  # the seed's string, method dropped
    assert namespace_key_hex(case["target_identity"], text, _tenant(case["tenant"])) == case["target_namespace_key"]


def test_golden_file_follows_the_formula_and_covers_every_seed_case():
    assert len(_golden("target_namespaces.json")) == len(_golden("namespaces.json"))
    run = subprocess.run([sys.executable, str(GOLDEN / "make_target_namespaces.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_target_namespace_collides_with_no_seed_or_drafter_namespace():
    seed = _golden("namespaces.json")
    drafters = _golden("drafter_namespaces.json")
    strings = {case["namespace"] for case in seed} | {json.dumps(case) for case in drafters}
    keys = {case["namespace_key"] for case in seed}
    for case in _golden("target_namespaces.json"):
        assert case["target_namespace"].startswith(TARGET_NAMESPACE_TAG)
        assert case["target_namespace"] not in strings
        assert case["target_namespace_key"] not in keys
    # every seed prefix namespace starts with "{", a drafter namespace with its schema: the tag starts with neither
    assert not TARGET_NAMESPACE_TAG.startswith("{") and ":" not in TARGET_NAMESPACE_TAG[:-1].split("/")[0]
    assert prefix_namespace(TARGET_NAMESPACE_TAG, "", {}) != target_namespace("", {})


def test_methods_share_one_target_namespace_and_options_and_adapters_do_not():
    base = target_namespace("", {})
    for method in (None, "", ngram_namespace(), "dflash-context-v1:" + "ab" * 32, 'we"ird\\', "\u2028"):
        assert target_namespace_of(prefix_namespace(method, "", {})) == base
    assert target_namespace_of(prefix_namespace("m", "", {"kvBits": 8})) == target_namespace("", {"kvBits": 8}) != base
    assert target_namespace_of(prefix_namespace("m", "a@1", {})) == target_namespace("a@1", {}) != base
    for junk in ("", "ngram-history-v1:3:1", "{}", '{"method":1,"adapters":""}', '{"method":"x"', base):
        assert target_namespace_of(junk) is None


# --- restores across drafters -----------------------------------------------------------------------------------

class Model:
    """One tiny llama target; per method two drafters of it, seeds 31 and 32."""

    def __init__(self, root: Path):
        self.root = root
        self.target_dir = write_tiny_target(root / "target", "llama", seed=0, tokenizer=False)
        self.target = TargetModel.load(self.target_dir)
        self.dirs = {}
        for method, options in {**TAPS, **OTHERS}.items():
            for seed in (31, 32):
                self.dirs[method, seed] = (None if options is None else write_tiny_drafter(
                    root / f"{method}-{seed}", method, self.target_dir, seed=seed, **options))

    def load(self, cache, method, seed, **options):
        if method == "ngram":
            return Generator.load(self.target_dir, "ngram", cache=cache, **options)
        return Generator.load(self.target_dir, None if method is None else self.dirs[method, seed], cache=cache,
                              **options)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model(tmp_path_factory.mktemp("target-only"))


def back(method) -> int:
    """Tokens a target-only hit gives back: the MTP head (and the assistant) need the hidden before the pending
    token, so the target forwards the last restored token again."""
    return 1 if method in ("qwen-mtp", "assistant") else 0


@pytest.mark.parametrize("reopen", [False, True], ids=["memory", "lmdb"])
@pytest.mark.parametrize("method", list(TAPS))
def test_second_drafter_restores_the_prompt_the_first_stored(model, tmp_path, method, reopen):
    store = tmp_path / "store"
    with SpecCache.open(store, memory_bytes=None if not reopen else 0) as cache:
        first = model.load(cache, method, 31)
        assert [r.cached_tokens for r in first.generate(PROMPTS, max_tokens=MAX)] == [0, 0, 0]
        if reopen:
            cache.close()
            cache = SpecCache.open(store, memory_bytes=0)
        second = model.load(cache, method, 32)
        assert second.ns_key != first.ns_key and second.prefix_namespace != first.prefix_namespace
        assert first.ns_key in second.target_members()
        results = second.generate(PROMPTS, max_tokens=MAX)
        for p, r in zip(PROMPTS, results):
            assert r.tokens == plain_greedy(model.target, p, MAX)
        assert [(r.cached_tokens, r.restored_drafter) for r in results] == [
            (len(p) - 1 - back(method), False) for p in PROMPTS]
        assert any(r.drafted for r in results)  # its own row drafted beside the restored target
        cache.close()


@pytest.mark.parametrize("pair", [("dflash", "deepspec"), ("ngram", "dflash"), ("draft-model", "assistant"),
                                  (None, "qwen-mtp"), ("dflash2", None), ("assistant", "ngram")],
                         ids=lambda pair: f"{pair[0]}-then-{pair[1]}")
def test_every_provider_restores_what_any_other_stored(model, tmp_path, pair):
    before, after = pair
    p = PROMPTS[0]
    with SpecCache.open(tmp_path / "store") as cache:
        model.load(cache, before, 31).generate([p], max_tokens=MAX)
        (r,) = model.load(cache, after, 32).generate([p], max_tokens=MAX)
        assert r.tokens == plain_greedy(model.target, p, MAX)
        assert (r.cached_tokens, r.restored_drafter) == (len(p) - 1 - back(after), False)


def test_own_namespace_wins_when_it_holds_as_much_and_a_longer_sibling_wins_otherwise(model, tmp_path):
    long_prompt = PROMPTS[1]
    short = long_prompt[:40] + [250, 251, 252]  # shares 40 tokens with the long one
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        b = model.load(cache, "dflash", 32)
        b.generate([short], max_tokens=MAX)
        (own,) = b.generate([short], max_tokens=MAX)  # its own entry, drafter part included
        assert (own.cached_tokens, own.restored_drafter) == (len(short) - 1, True)
        model.load(cache, "dflash", 31).generate([long_prompt], max_tokens=MAX)
        # a longer prompt: b's own namespace holds a 32-token chunk boundary at most; a's holds the prompt and its
        # answer (the memory tier serves a shorter prefix of a longer entry: all of ``long_prompt``)
        (longer,) = b.generate([long_prompt + [9]], max_tokens=MAX)
        assert longer.tokens == plain_greedy(model.target, long_prompt + [9], MAX)
        assert (longer.cached_tokens, longer.restored_drafter) == (len(long_prompt), False)
        # the same short prompt again: its own entry is as long as anything, and carries its row
        (again,) = b.generate([short], max_tokens=MAX)
        assert (again.cached_tokens, again.restored_drafter) == (len(short) - 1, True)


def test_no_sharing_across_tenants_options_or_adapters(model, tmp_path):
    p = PROMPTS[0]
    adapter = write_tiny_adapter(tmp_path / "lora", model.target_dir)
    with SpecCache.open(tmp_path / "store") as cache:
        model.load(cache, "dflash", 31, tenant="acme").generate([p], max_tokens=MAX)
        other_tenant = model.load(cache, "dflash", 32, tenant="globex")
        assert other_tenant.generate([p], max_tokens=MAX)[0].cached_tokens == 0
        same_tenant = model.load(cache, "dflash", 32, tenant="acme")
        assert same_tenant.generate([p], max_tokens=MAX)[0].cached_tokens == len(p) - 1
        # a tenant key made later through the seam (what serve does per API key) reads that tenant's members only
        fresh = model.load(cache, "deepspec", 32)
        assert fresh.generate([p], max_tokens=MAX, )[0].cached_tokens == 0
        key = fresh.namespace_key("acme")
        assert fresh.restore_for_prompt(p, ns_key=key).length == len(p) - 1
        assert fresh.restore_for_prompt(p, ns_key=fresh.namespace_key("initech")) is None
        quantized = model.load(cache, "dflash", 32, kv=KVOptions(kv_bits=8, quantized_kv_start=0), tenant="acme")
        assert quantized.generate([p], max_tokens=MAX)[0].cached_tokens == 0
        adapted = model.load(cache, "dflash", 32, adapters=adapter, tenant="acme")
        assert adapted.generate([p], max_tokens=MAX)[0].cached_tokens == 0


def test_a_store_written_without_the_target_only_namespace_serves_it(model, tmp_path):
    """Membership is read from the namespace rows every version writes: nothing new is stored for it."""
    p = PROMPTS[1]
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        first = model.load(cache, "dflash", 31)
        first.target_namespace = None  # as a version before issue 38 would run: no target-only lookups
        first.generate([p], max_tokens=MAX)
        assert cache.store.prefix_namespaces(first.target_identity) == {first.prefix_namespace}
    with SpecCache.open(tmp_path / "store", memory_bytes=0) as cache:
        (r,) = model.load(cache, "dflash", 32).generate([p], max_tokens=MAX)
        assert r.cached_tokens == len(p) - 1 and r.tokens == plain_greedy(model.target, p, MAX)


# --- item 2: the drafter part after a target-only hit -------------------------------------------------------------

@pytest.mark.parametrize("reopen", [False, True], ids=["memory", "lmdb"])
@pytest.mark.parametrize("method", list(TAPS))
def test_turn_two_after_a_target_only_hit_restores_both_parts(model, tmp_path, method, reopen):
    """Turn 1 of the second drafter starts from the first one's target part; its finish checkpoint stores its own
    (partial) row with it, so turns 2 and 3 restore both parts, tokens unchanged."""
    p = PROMPTS[1]
    store = tmp_path / "store"
    memory = 0 if reopen else None
    with SpecCache.open(store, memory_bytes=memory) as cache:
        model.load(cache, method, 31).generate([p], max_tokens=MAX)
    conversation, turns = list(p), []
    for turn in range(3):
        with SpecCache.open(store, memory_bytes=memory) as cache:
            (r,) = model.load(cache, method, 32).generate([conversation], max_tokens=MAX)
        assert r.tokens == plain_greedy(model.target, conversation, MAX)
        turns.append((r.cached_tokens, r.restored_drafter))
        conversation = conversation + r.tokens + [11 + turn, 12 + turn]
    first, second, third = turns
    assert first == (len(p) - 1 - back(method), False)
    assert second[1] and third[1]  # the drafter part came back with the target part
    assert second[0] == len(p) + MAX - 1 and third[0] == second[0] + 2 + MAX


@pytest.mark.parametrize("method", list(TAPS))
def test_a_stored_partial_row_opens_as_the_row_it_was(model, tmp_path, method):
    """What a partial row holds comes back bit for bit, through the memory tier and LMDB: ``padded`` writes the
    missing head as zero rows in the schema's own layout, ``opened`` reads it back."""
    import mlx.core as mx
    import numpy as np

    from spec_cache.decode.engine import RowRequest, SpeculativeEngine
    from spec_cache.drafters import load_provider
    from spec_cache.drafters.base import PartialRowCheckpoint, opened, padded
    from tests.runtime_fixtures import CheckpointRecorder

    p = PROMPTS[0]
    first = SpeculativeEngine(model.target, load_provider(model.dirs[method, 31]), draft_depth=3, adaptive=False)
    recorder = CheckpointRecorder()
    first.run([RowRequest(p, max_tokens=3)], on_checkpoint=recorder)
    _, tokens, caches, _ = recorder.boundary(0)
    provider = load_provider(model.dirs[method, 32])
    session = SpeculativeEngine(model.target, provider, draft_depth=3, adaptive=False).session()
    session.submit(RowRequest(p + [9, 10, 11], restored_caches=caches, restored_tokens=len(tokens), max_tokens=MAX))
    session.step()
    session.step()
    live = session.group.capture(0)
    assert isinstance(live, PartialRowCheckpoint)
    stored = padded(live)
    provider.validate_checkpoint(stored)  # its schema's checkpoint of every token the target covers
    assert stored.processed_tokens == live.processed_tokens

    def same(a, b):
        assert isinstance(b, PartialRowCheckpoint)
        assert (a.processed_tokens, a.start, a.base_tokens) == (b.processed_tokens, b.start, b.base_tokens)
        assert dict(a.attachment.metadata) == dict(b.attachment.metadata)
        for x, y in zip(a.attachment.tensors, b.attachment.tensors, strict=True):
            assert np.array_equal(np.array(mx.array(x)), np.array(mx.array(y)))
    same(live, opened(stored))
    session.close()
    # through the tiers: a finished row's checkpoint (what a store gets), restored after reopening
    recorder = CheckpointRecorder()
    SpeculativeEngine(model.target, provider, draft_depth=3, adaptive=False).run(
        [RowRequest(p + [9, 10, 11], restored_caches=caches, restored_tokens=len(tokens), max_tokens=MAX)],
        on_checkpoint=recorder)
    _, done, done_caches, done_draft = recorder.finish(0)
    held = opened(done_draft)
    assert isinstance(held, PartialRowCheckpoint) and held.start == len(tokens)  # where the target was restored
    for memory in (None, 0):
        with SpecCache.open(tmp_path / f"store-{memory}", memory_bytes=memory) as cache:
            key = cache.namespace("ab" * 32, "partial")
            cache.save(key, done, done_caches, drafter_namespace=provider.namespace, draft_checkpoint=done_draft)
        with SpecCache.open(tmp_path / f"store-{memory}", memory_bytes=memory) as cache:
            back_again = cache.restore(key, done, drafter_namespace=provider.namespace)
            assert back_again.length == len(done) and back_again.tier == "local"
            same(held, opened(back_again.draft_checkpoint))
    # a full checkpoint is not mistaken for a partial one
    recorder = CheckpointRecorder()
    SpeculativeEngine(model.target, provider, draft_depth=3, adaptive=False).run(
        [RowRequest(p, max_tokens=3)], on_checkpoint=recorder)
    full = recorder.boundary(0)[3]
    assert opened(full) is full


# --- item 3: the seed's "full" prefill mode is not implemented, and no row declares it ------------------------

def test_every_row_is_admitted_tail_split_and_only_the_mtp_head_consumes_appended_tokens(model):
    from spec_cache.decode.engine import _takes_external_tokens
    from spec_cache.drafters import load_provider
    from spec_cache.drafters.ngram import NgramProvider
    from spec_cache.rows.target import TargetRows

    rows = TargetRows.from_row_caches(model.target, [None])
    for method in {**TAPS, **OTHERS}:
        provider = NgramProvider() if method == "ngram" else load_provider(model.dirs[method, 31])
        group = provider.open(rows, [None])
        assert group.prefill_mode == "tail-split", method
        assert _takes_external_tokens(group) == (method == "qwen-mtp"), method


@pytest.mark.parametrize("reopen", [False, True], ids=["memory", "lmdb"])
def test_qwen_mtp_heads_share_a_hybrid_targets_prefix_and_turn_two_restores_both_parts(tmp_path, reopen):
    """qwen3_next (recurrent layers beside attention: its state is never trimmed) with two MTP heads: the second
    head's first turn restores the first one's prompt boundary whole (the row starts without the last hidden),
    its next turns restore its own partial row with the target."""
    target_dir = write_tiny_target(tmp_path / "target", "qwen3_next", tokenizer=False)
    target = TargetModel.load(target_dir)
    heads = {seed: write_tiny_drafter(tmp_path / f"mtp-{seed}", "qwen-mtp", target_dir, seed=seed)
             for seed in (31, 32)}
    p = [3 + (i * 7) % 200 for i in range(60)]
    memory = 0 if reopen else None
    with SpecCache.open(tmp_path / "store", memory_bytes=memory) as cache:
        Generator.load(target_dir, heads[31], cache=cache).generate([p], max_tokens=MAX)
    conversation, turns, finished = list(p), [], []
    for turn in range(3):
        with SpecCache.open(tmp_path / "store", memory_bytes=memory) as cache:
            (r,) = Generator.load(target_dir, heads[32], cache=cache).generate([conversation], max_tokens=MAX)
        assert r.tokens == plain_greedy(target, conversation, MAX)
        turns.append((r.cached_tokens, r.restored_drafter))
        finished.append(len(conversation) + len(r.tokens) - 1)  # its finish checkpoint
        conversation = conversation + r.tokens + [5 + turn, 6 + turn]
    assert turns == [(len(p) - 1, False), (finished[0], True), (finished[1], True)]
