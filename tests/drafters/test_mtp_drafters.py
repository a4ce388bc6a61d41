"""Qwen MTP drafter rows (``qwen-mtp-v1``): the head lags the target by one token (``draftOffset ==
processedTokens - 1``), reads the target's pre-norm hidden, shares its embeddings and head. Speculative ==
plain greedy; restored == cold (engine, generator, after reopening, warm and cold rows in one batch); the
checkpoint is the head's state over its tokens; misaligned, foreign and mispaired state is refused."""

from __future__ import annotations

import inspect
import shutil

import mlx.core as mx
import pytest

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.drafters import METHODS, detect_method, load_provider
from spec_cache.naming.identity import model_identity
from spec_cache.rows.protocol import RoundContext
from spec_cache.rows.target import TargetModel, TargetRows
from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint, SchemaError
from spec_cache.testing.tiny import write_tiny_target
from spec_cache.testing.tiny_writers import write_tiny_drafter_extra
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import PROMPTS, CheckpointRecorder, _identity_memo, plain_greedy  # noqa: F401

MAX = 16
ALIGN = "invalid paired Qwen MTP checkpoint alignment"
#: a fixed draft depth (the engine may pick depths adaptively; acceptance comparisons need the same depth)
FIXED = {"adaptive": False} if "adaptive" in inspect.signature(SpeculativeEngine).parameters else {}


class Setup:
    def __init__(self, root):
        self.root = root
        self.target_dir = write_tiny_target(root / "target", tokenizer=False)
        self.drafter_dir = write_tiny_drafter_extra(root / "mtp", "qwen-mtp", self.target_dir)
        self.target = TargetModel.load(self.target_dir)

    def provider(self):
        return load_provider(self.drafter_dir)

    def engine(self, depth=3):
        return SpeculativeEngine(self.target, self.provider(), draft_depth=depth, **FIXED)


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("qwen-mtp"))


def test_method_is_registered_and_detected(mtp):
    assert "qwen-mtp" in METHODS and detect_method(mtp.drafter_dir) == "qwen-mtp"
    provider = mtp.provider()
    assert provider.namespace == "qwen-mtp-v1:" + model_identity(mtp.drafter_dir)
    assert provider.schema == "qwen-mtp-v1" and provider.prefill_needs_target_taps


def test_speculative_equals_plain_greedy(mtp):
    results = mtp.engine().run([RowRequest(p, max_tokens=MAX) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == plain_greedy(mtp.target, prompt, MAX)
    assert sum(r.accepted for r in results) > 0  # the head's drafts are accepted part of the time


def _head_state(provider, target, tokens):
    """What a row covering ``tokens`` should hold: one target forward for the pre-norm hiddens, then the head
    over the pairs (h_i, t_{i+1})."""
    last = target.num_layers - 1
    taps = target.forward(mx.array([tokens]), target.make_caches(), tap_layers=(last,)).taps[last]
    network = provider.network
    pairs = len(tokens) - 1
    if not pairs:
        return None, None, taps[:, -1:]
    embeddings = target.embed(mx.array([tokens[1:]], dtype=mx.uint32))
    from spec_cache.drafters.projected import ContextKV

    _, keys, values = network(embeddings, taps[:, :pairs], mx.array([0]), ContextKV(None, None, None))
    return keys, values, taps[:, -1:]


def test_checkpoint_is_the_heads_state_over_its_tokens(mtp):
    provider = mtp.provider()
    recorder = CheckpointRecorder()
    mtp.engine().run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for index, prompt in enumerate(PROMPTS):
        for _, tokens, _, checkpoint in (recorder.boundary(index), recorder.finish(index)):
            provider.validate_checkpoint(checkpoint)
            assert checkpoint.processed_tokens == len(tokens)
            assert checkpoint.attachment.metadata["draftOffset"] == len(tokens) - 1
            *kv, hidden = checkpoint.attachment.tensors
            keys, values, last = _head_state(provider, mtp.target, tokens)
            assert mx.allclose(hidden, last, atol=1e-4).item()
            if len(tokens) == 1:
                assert kv == []  # [hidden] while draftOffset == 0
                continue
            k, v = kv
            assert k.shape == keys.shape == (1, 1, len(tokens) - 1, 64)
            # prefill rows and verify rows come from different forwards: float noise only
            assert mx.allclose(k, keys, atol=1e-4).item() and mx.allclose(v, values, atol=1e-4).item()


class _Recorder(CheckpointRecorder):
    def __call__(self, row, tokens, caches, draft):
        self.calls.append((row, list(tokens), caches, draft))


def _restored(recorder, index, prompt, max_tokens=MAX, boundary=True):
    _, tokens, caches, checkpoint = (recorder.boundary if boundary else recorder.finish)(index)
    return RowRequest(prompt, restored_caches=caches, restored_tokens=len(tokens), draft_checkpoint=checkpoint,
                      max_tokens=max_tokens)


def test_restored_equals_cold_in_mixed_batches(mtp):
    engine = mtp.engine()
    recorder = CheckpointRecorder()
    cold = engine.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    # warm rows (restored at the prompt boundary, drafter row included) beside cold ones, in one batch
    requests = [_restored(recorder, 0, PROMPTS[0]), RowRequest(PROMPTS[1], max_tokens=MAX),
                _restored(recorder, 2, PROMPTS[2])]
    warm = engine.run(requests)
    for c, w in zip(cold, warm):
        assert w.tokens == c.tokens
        assert (w.drafted, w.accepted) == (c.drafted, c.accepted)  # the restored head is the cold head
    assert [w.cached_tokens for w in warm] == [len(PROMPTS[0]) - 1, 0, len(PROMPTS[2]) - 1]
    # an extended turn from the finish checkpoint: prompt + generated + new tokens
    follow = [PROMPTS[i] + cold[i].tokens + [7, 8] for i in (0, 2)]
    turn = engine.run([_restored(recorder, i, f, boundary=False) for i, f in zip((0, 2), follow)]
                      + [RowRequest(PROMPTS[1], max_tokens=4)])
    for prompt, result in zip(follow, turn):
        assert result.tokens == plain_greedy(mtp.target, prompt, MAX)
        assert result.cached_tokens == len(prompt) - 3


def test_cold_head_beside_restored_target_forwards_one_token(mtp):
    """A target-only hit at the prompt boundary: the head opens cold beside the target, which forwards only the
    last restored token again (the hidden before the pending token), never the whole prefix."""
    engine = mtp.engine()
    recorder = CheckpointRecorder()
    cold = engine.run([RowRequest(PROMPTS[2], max_tokens=MAX)], on_checkpoint=recorder)
    _, tokens, caches, _ = recorder.boundary(0)
    target_only = RowRequest(PROMPTS[2], restored_caches=caches, restored_tokens=len(tokens), max_tokens=MAX)
    again_recorder = CheckpointRecorder()
    again = engine.run([target_only], on_checkpoint=again_recorder)
    assert again[0].tokens == cold[0].tokens == plain_greedy(mtp.target, PROMPTS[2], MAX)
    assert again[0].cached_tokens == len(PROMPTS[2]) - 2
    # its boundary checkpoint (no pair held yet) carries the target part only; its finish checkpoint the partial
    # head in qwen-mtp-v1's layout, the early pairs it never had as zero rows (issue 38: ``drafters.base.padded``)
    from spec_cache.drafters.base import PartialRowCheckpoint, opened

    drafts = [call[3] for call in again_recorder.calls]
    assert drafts[0] is None and drafts[-1] is not None and len(drafts) == 2
    assert isinstance(opened(drafts[-1]), PartialRowCheckpoint) and opened(drafts[-1]).start == len(tokens) - 1


def test_generator_restored_equals_cold_also_after_reopen(mtp, tmp_path):
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(mtp.target, p, MAX) for p in prompts]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(mtp.target_dir, mtp.drafter_dir, cache=cache)
        assert [r.tokens for r in gen.generate(prompts, max_tokens=MAX)] == expected
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(mtp.target_dir, mtp.drafter_dir, cache=cache)
        again = gen.generate(prompts + [[50, 51, 52, 53]], max_tokens=MAX)  # two warm rows, one cold
        assert [r.tokens for r in again[:2]] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        assert again[2].cached_tokens == 0 and again[2].tokens == plain_greedy(mtp.target, [50, 51, 52, 53], MAX)
        turn = gen.generate(follow, max_tokens=MAX)
        for prompt, r in zip(follow, turn):
            assert r.tokens == plain_greedy(mtp.target, prompt, MAX)
            assert r.cached_tokens == len(prompt) - 3 and r.restored_drafter


def _one_row(mtp, tokens):
    provider = mtp.provider()
    provider.bind(mtp.target)
    rows = TargetRows.from_row_caches(mtp.target, [None])
    group = provider.open(rows, [None])
    group.prefill([tokens], rows.prefill([tokens], tap_layers=group.tap_layers))
    return provider, rows, group


def test_misaligned_foreign_or_mispaired_state_is_refused(mtp):
    provider, _, group = _one_row(mtp, [5, 6, 7, 8])
    good = group.capture(0)
    k, v, hidden = good.attachment.tensors
    schema = good.attachment.schema

    def cp(n, metadata, tensors):
        return DraftRowCheckpoint(n, CheckpointAttachment(schema, metadata, tensors))

    cases = {
        ALIGN: [DraftRowCheckpoint(5, good.attachment), cp(4, {"draftOffset": 2}, (k, v, hidden)),
                cp(4, {"draftOffset": 3}, (hidden,)), cp(1, {"draftOffset": 0}, (k, v, hidden))],
        "heads x": [cp(4, {"draftOffset": 3}, (mx.concatenate([k, k], axis=1), mx.concatenate([v, v], axis=1),
                                                hidden))],
        "K/V dtype": [cp(4, {"draftOffset": 3}, (k.astype(mx.float16), v.astype(mx.float16), hidden))],
        "hidden of size": [cp(4, {"draftOffset": 3}, (k, v, hidden[..., :64]))],
        "hidden dtype": [cp(4, {"draftOffset": 3}, (k, v, hidden.astype(mx.bfloat16)))],
        "expected 'qwen-mtp-v1'": [DraftRowCheckpoint(4, CheckpointAttachment(
            "gemma-assistant-v1", {"processedTokens": 4}, (hidden,)))],
    }
    before = group.processed
    for match, bad in cases.items():
        for checkpoint in bad:
            with pytest.raises(SchemaError, match=match):
                group.append([checkpoint])
    assert group.processed == before
    group.append([good])  # the good one still joins
    assert group.processed == (4, 4)


def test_head_for_another_target_is_refused(mtp, tmp_path):
    write_tiny_drafter_extra(tmp_path / "wide", "qwen-mtp", mtp.target_dir, hidden_size=64)
    with pytest.raises(ValueError):  # its weights do not load as a head of hidden 64
        load_provider(tmp_path / "wide")
    other = write_tiny_target(tmp_path / "other", hidden_size=64, head_dim=32, tokenizer=False)
    write_tiny_drafter_extra(tmp_path / "small", "qwen-mtp", other)
    with pytest.raises(ValueError, match="qwen MTP drafter hidden 64 != target 128"):
        SpeculativeEngine(mtp.target, load_provider(tmp_path / "small"))
    with pytest.raises(ValueError, match="qwen MTP drafter hidden 64 != target 128"):
        Generator.load(mtp.target_dir, tmp_path / "small")
    shutil.copytree(mtp.drafter_dir, tmp_path / "two-layers")
    config = (tmp_path / "two-layers" / "config.json").read_text().replace('"num_hidden_layers": 1',
                                                                           '"num_hidden_layers": 2')
    (tmp_path / "two-layers" / "config.json").write_text(config)
    with pytest.raises(ValueError, match="exactly one layer"):
        load_provider(tmp_path / "two-layers")


def test_commit_adds_accepted_plus_one_pairs_and_zero_depth_keeps_alignment(mtp):
    provider, rows, group = _one_row(mtp, [5, 6, 7, 8])
    assert group.processed == (4,) and group.capture(0).attachment.metadata["draftOffset"] == 3
    for window, kept in (([9], 0), ([10, 11, 12], 1), ([13, 14], 1)):  # a zero-depth round, then two
        out = rows.verify([window], tap_layers=group.tap_layers)
        rows.rollback([len(window) - 1 - kept])
        group.commit([kept], RoundContext([window], out.hidden, out.taps))
        assert group.processed == rows.offsets
    tokens = [5, 6, 7, 8, 9, 10, 11, 13, 14]
    checkpoint = group.capture(0)
    assert checkpoint.attachment.metadata["draftOffset"] == len(tokens) - 1
    keys, _, last = _head_state(provider, mtp.target, tokens)
    assert mx.allclose(checkpoint.attachment.tensors[0], keys, atol=1e-4).item()
    assert mx.allclose(checkpoint.attachment.tensors[2], last, atol=1e-4).item()


def test_consume_equals_prefill(mtp):
    _, _, whole = _one_row(mtp, [5, 6, 7, 8, 9, 10])
    _, rows, part = _one_row(mtp, [5, 6, 7])
    context = rows.prefill([[8, 9, 10, 99]], tap_layers=part.tap_layers)
    rows.rollback([1])  # the engine forwarded one token too many; only three are consumed
    part.consume([[8, 9, 10, 99]], context, [3])
    assert part.processed == whole.processed == (6,)
    for a, b in zip(part.capture(0).attachment.tensors, whole.capture(0).attachment.tensors):
        assert mx.allclose(a, b, atol=1e-5).item()
    with pytest.raises(ValueError, match="consume length"):
        part.consume([[1]], context, [2])


def test_a_row_before_its_first_token_has_no_checkpoint(mtp):
    provider = mtp.provider()
    rows = TargetRows.from_row_caches(mtp.target, [None, None])
    group = provider.open(rows, [None, None])
    assert group.capture(0) is None
    group.prefill([[5], [6, 7]], rows.prefill([[5], [6, 7]], tap_layers=group.tap_layers))
    one, two = group.capture(0), group.capture(1)
    assert one.attachment.metadata["draftOffset"] == 0 and len(one.attachment.tensors) == 1
    assert two.attachment.metadata["draftOffset"] == 1 and len(two.attachment.tensors) == 3
    assert group.draft([9, 9], 2) and all(len(d) == 2 for d in group.draft([9, 9], 2))


def test_prefill_mode_and_consume_across_providers(mtp, tmp_path):
    from spec_cache.drafters.ngram import NgramProvider
    from spec_cache.testing.tiny import write_tiny_drafter

    provider, rows, group = _one_row(mtp, [5, 6, 7])
    # tail-split, the one mode (the seed's "full" is not implemented, issue 38); appended tokens through consume
    assert group.prefill_mode == "tail-split" and group.consumes_appended_tokens and group.supports_external_tokens
    # a projected drafter consumes like it prefills
    write_tiny_drafter(tmp_path / "deepspec", "deepspec", mtp.target_dir)
    deepspec = load_provider(tmp_path / "deepspec")
    whole_rows = TargetRows.from_row_caches(mtp.target, [None])
    whole = deepspec.open(whole_rows, [None])
    whole.prefill([[5, 6, 7, 8, 9]], whole_rows.prefill([[5, 6, 7, 8, 9]], tap_layers=whole.tap_layers))
    part_rows = TargetRows.from_row_caches(mtp.target, [None])
    part = deepspec.open(part_rows, [None])
    assert part.prefill_mode == "tail-split" and part.supports_external_tokens and not part.consumes_appended_tokens
    part.prefill([[5, 6, 7]], part_rows.prefill([[5, 6, 7]], tap_layers=part.tap_layers))
    part.consume([[8, 9]], part_rows.prefill([[8, 9]], tap_layers=part.tap_layers), [2])
    assert part.processed == whole.processed == (5,)
    for a, b in zip(part.capture(0).attachment.tensors, whole.capture(0).attachment.tensors):
        assert mx.allclose(a, b, atol=1e-5).item()
    ngram = NgramProvider().open(rows, [None])
    ngram.consume([[4, 5, 6]], None, [2])
    assert ngram.processed == (2,)
    # a drafter that reads the target's own attention cannot take tokens it did not see verified
    write_tiny_drafter(tmp_path / "assistant", "assistant", mtp.target_dir)
    assistant = load_provider(tmp_path / "assistant").open(rows, [None])
    assert not assistant.supports_external_tokens
    with pytest.raises(NotImplementedError, match="cannot consume"):
        assistant.consume([[1]], None, [1])


def test_qwen3_next_target_with_its_gated_mtp_head(tmp_path):
    """The family the head comes from: a hybrid Qwen3-Next target (recurrent and gated full-attention layers);
    the head copies its gated, q/k-normed, partial-RoPE attention layer."""
    target_dir = write_tiny_target(tmp_path / "target", "qwen3_next", tokenizer=False)
    drafter_dir = write_tiny_drafter_extra(tmp_path / "mtp", "qwen-mtp", target_dir)
    provider = load_provider(drafter_dir)
    assert provider.config.attn_output_gate and provider.config.qk_norm
    assert provider.config.partial_rotary_factor < 1
    target = TargetModel.load(target_dir)
    engine = SpeculativeEngine(target, provider, draft_depth=3, **FIXED)
    recorder = _Recorder()  # recurrent layers have no offset to check
    cold = engine.run([RowRequest(p, max_tokens=MAX) for p in PROMPTS], on_checkpoint=recorder)
    for prompt, result in zip(PROMPTS, cold):
        assert result.tokens == plain_greedy(target, prompt, MAX)
    assert sum(r.accepted for r in cold) > 0
    warm = engine.run([_restored(recorder, 0, PROMPTS[0]), RowRequest(PROMPTS[1], max_tokens=MAX),
                       _restored(recorder, 2, PROMPTS[2])])
    for c, w in zip(cold, warm):
        assert (w.tokens, w.drafted, w.accepted) == (c.tokens, c.drafted, c.accepted)
    assert warm[2].cached_tokens == len(PROMPTS[2]) - 1
