"""The grouped-row protocol: two-phase state changes, target rows, and every draft provider's group."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from spec_cache.drafters.ngram import lookup
from spec_cache.rows.protocol import DraftGroup, DraftProvider, PreparedStateChange, RoundContext, apply_state_changes
from spec_cache.rows.target import TargetModel, TargetRows, check_kv_options
from spec_cache.schemas import CheckpointAttachment, DraftRowCheckpoint, SchemaError, validate_checkpoint
from tests.runtime_fixtures import DRAFTERS, _identity_memo, tiny  # noqa: F401

GROUPS = list(DRAFTERS)


# -- apply_state_changes ------------------------------------------------------------------------------------
class Slot:
    def __init__(self, value):
        self.value = value
        self.disposed = []

    def change(self, new):
        def put(value):
            self.value = value

        return PreparedStateChange.swap(lambda: self.value, put, new)


def test_apply_state_changes_commits_all_after_building_all():
    a, b = Slot("a0"), Slot("b0")
    order = []

    def build(slot, new):
        def builder():
            order.append(f"build {new}")
            assert (a.value, b.value) == ("a0", "b0")  # nothing committed while building
            return slot.change(new)

        return builder

    apply_state_changes([build(a, "a1"), build(b, "b1")])
    assert (a.value, b.value) == ("a1", "b1")
    assert order == ["build a1", "build b1"]


def test_apply_state_changes_failure_disposes_and_changes_nothing():
    a = Slot("a0")
    disposed = []

    def first():
        change = a.change("a1")
        return PreparedStateChange(change.commit, lambda: (disposed.append("first"), change.dispose()))

    def failing():
        raise RuntimeError("draft side failed")

    with pytest.raises(RuntimeError, match="draft side failed"):
        apply_state_changes([first, failing])
    assert a.value == "a0"
    assert disposed == ["first"]


def test_apply_state_changes_reports_cleanup_failures_too():
    def leaky():
        def dispose():
            raise OSError("cannot release")

        return PreparedStateChange(lambda: None, dispose)

    def failing():
        raise ValueError("bad")

    with pytest.raises(ExceptionGroup, match="execution and cleanup failed") as info:
        apply_state_changes([leaky, failing])
    assert [type(e) for e in info.value.exceptions] == [ValueError, OSError]


# -- target model and target rows -----------------------------------------------------------------------------
def test_forward_matches_the_mlx_lm_model_bit_for_bit(tiny):
    target = tiny.target
    ids = mx.array([[5, 6, 7, 8, 9]])
    theirs = target.model(ids, cache=target.make_caches())
    ours = target.forward(ids, target.make_caches(), tap_layers=[0])
    assert mx.array_equal(ours.logits, theirs)
    assert list(ours.taps) == [0] and ours.taps[0].shape == (1, 5, target.hidden_size)
    assert mx.array_equal(target.logits(ours.hidden), ours.logits)
    assert target.kv_geometry(0) == (1, 64)


def test_unsupported_architecture_is_refused(tiny):
    with pytest.raises(NotImplementedError, match="no target port"):
        TargetModel(tiny.target.model, {"model_type": "mamba"})


def _single_row_logits(target, tokens):
    caches = target.make_caches()
    return target.forward(mx.array([tokens]), caches).logits[0, -1]


def test_ragged_prefill_verify_and_rollback_are_exact(tiny):
    target = tiny.target
    prompts = [[5, 6, 7, 8, 9, 10], [20], [30, 31, 32]]
    rows = TargetRows.from_row_caches(target, [None] * 3)
    context = rows.prefill(prompts, step=4)  # chunked: rows end in different chunks
    assert rows.offsets == (6, 1, 3)
    for i, prompt in enumerate(prompts):
        single = target.forward(mx.array([prompt]), target.make_caches())
        assert mx.allclose(context.last_hidden[i, 0], single.hidden[0, -1], atol=1e-5)
    window = [[11, 12, 13], [21, 22, 23], [33, 34, 35]]
    rows.verify(window)
    keep = [3, 1, 0]
    rows.rollback([3 - k for k in keep])
    assert rows.offsets == (9, 2, 3)
    histories = [p + w[:k] for p, w, k in zip(prompts, window, keep)]
    nxt = rows.verify([[40], [41], [42]]).logits
    for i, history in enumerate(histories):
        reference = _single_row_logits(target, history + [[40], [41], [42]][i])
        assert mx.allclose(nxt[i, -1], reference, atol=1e-4)
        assert int(mx.argmax(nxt[i, -1])) == int(mx.argmax(reference))
    extracted = rows.extract(1)
    assert [c.offset for c in extracted] == [3] * target.num_layers


def test_target_rows_merge_restored_caches_without_touching_them(tiny):
    target = tiny.target
    caches = target.make_caches()
    target.forward(mx.array([[1, 2, 3, 4]]), caches)
    before = [np.array(c.keys[..., : c.offset, :]) for c in caches]
    rows = TargetRows.from_row_caches(target, [caches, None])
    assert rows.offsets == (4, 0)
    rows.prefill([[5], [6, 7]])
    rows.verify([[8], [9]])
    assert all(np.array_equal(np.array(c.keys[..., :4, :]), b) for c, b in zip(caches, before))
    assert all(c.offset == 4 for c in caches)
    ragged = target.make_caches()
    target.forward(mx.array([[1, 2]]), ragged)
    ragged[1].trim(1)  # layer 1 now holds one token less than layer 0
    with pytest.raises(ValueError, match="disagree"):
        TargetRows.from_row_caches(target, [ragged])
    with pytest.raises(ValueError, match="layer caches"):
        TargetRows.from_row_caches(target, [ragged[:1]])


def test_target_rows_prepare_append_is_two_phase(tiny):
    target = tiny.target
    running = TargetRows.from_row_caches(target, [None, None])
    running.prefill([[1, 2, 3], [4]])
    joining = TargetRows.from_row_caches(target, [None])
    joining.prefill([[7, 8]])
    change = running.prepare_append(joining)
    assert running.offsets == (3, 1)
    change.dispose()
    assert running.offsets == (3, 1)
    apply_state_changes([lambda: running.prepare_append(joining)])
    assert running.offsets == (3, 1, 2)
    k_joined = running.extract(2)[0].keys
    assert mx.array_equal(k_joined, joining.extract(0)[0].keys)
    running.filter_rows([2, 0])
    assert running.offsets == (2, 3)
    running.filter_rows([])
    assert running.row_count == 0 and running.donors(0).keys is None


def test_donor_view_marks_each_rows_real_positions(tiny):
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    rows.prefill([[1, 2, 3], [4]])
    donor = rows.donors(-1)
    assert donor.positions.tolist() == [3, 1]
    assert donor.valid[:, 0, 0, :].tolist() == [[True, True, True], [False, False, True]]


def test_kv_options_check():
    class Options:
        kv_bits = None
        kv_group_size = 64
        quantized_kv_start = None
        turbo_quant = None
        kv_config = ()

    check_kv_options(None)
    check_kv_options(Options())
    for field, value in (("kv_bits", 8), ("kv_config", ({"layerIdx": 0},))):
        options = Options()
        setattr(options, field, value)
        check_kv_options(options)  # affine KV quantization runs (spec_cache.rows.kv_quant)
    options = Options()
    options.turbo_quant = {"kBits": 8}
    with pytest.raises(NotImplementedError, match="no TurboQuant codec"):
        check_kv_options(options)


# -- draft groups ---------------------------------------------------------------------------------------------
def _prefilled(tiny, name, prompts):
    """Target rows and a draft group prefilled over ``prompt[:-1]`` of each prompt (tail split)."""
    provider = tiny.provider(name)
    rows = TargetRows.from_row_caches(tiny.target, [None] * len(prompts))
    group = provider.open(rows, [None] * len(prompts))
    heads = [p[:-1] for p in prompts]
    group.prefill(heads, rows.prefill(heads, tap_layers=group.tap_layers))
    group.materialize()
    return provider, rows, group


def _state(group):
    return (group.row_count, group.processed, [_digest(group.capture(i)) for i in range(group.row_count)])


def _digest(checkpoint):
    tensors = [np.array(t).tobytes() for t in checkpoint.attachment.tensors]
    return checkpoint.processed_tokens, dict(checkpoint.attachment.metadata), tensors


@pytest.mark.parametrize("name", GROUPS)
def test_group_capture_validates_and_round_trips(tiny, name):
    provider, rows, group = _prefilled(tiny, name, [[5, 6, 7, 8], [9, 10]])
    assert isinstance(provider, DraftProvider) and isinstance(group, DraftGroup)
    assert group.processed == (3, 1) and group.namespace == provider.namespace
    captures = [group.capture(i) for i in range(2)]
    for capture, covered in zip(captures, (3, 1)):
        assert capture.processed_tokens == covered and capture.attachment.schema == provider.schema
        validate_checkpoint(capture, expect_schema=provider.schema)
    again = provider.open(rows, captures)
    assert _state(again) == _state(group)


@pytest.mark.parametrize("name", GROUPS)
def test_depth_zero_gives_no_proposals(tiny, name):
    _, _, group = _prefilled(tiny, name, [[5, 6, 7, 8], [9, 10]])
    assert group.draft([8, 10], 0) == [[], []]
    proposals = group.draft([8, 10], 3)
    assert len(proposals) == 2 and all(len(p) <= 3 for p in proposals)


@pytest.mark.parametrize("name", GROUPS)
def test_filter_rows_empty_disposes_and_group_stays_usable(tiny, name):
    provider, rows, group = _prefilled(tiny, name, [[5, 6, 7, 8], [9, 10], [11, 12, 13]])
    keep_state = _digest(group.capture(2))
    group.filter_rows([2, 0])
    assert group.row_count == 2 and _digest(group.capture(0)) == keep_state
    group.filter_rows([])
    assert group.row_count == 0 and group.processed == ()
    group.append([None])
    assert group.row_count == 1 and group.processed == (0,)


@pytest.mark.parametrize("name", GROUPS)
def test_bad_checkpoints_are_refused_before_any_change(tiny, name):
    provider, rows, group = _prefilled(tiny, name, [[5, 6, 7, 8], [9, 10]])
    good = group.capture(0)
    before = _state(group)
    unknown = DraftRowCheckpoint(good.processed_tokens, CheckpointAttachment("made-up-v1", {}, ()))
    other_schema = "ngram-history-v1" if provider.schema != "ngram-history-v1" else "gemma-assistant-v1"
    wrong_schema = DraftRowCheckpoint(
        1, CheckpointAttachment(other_schema, {"processedTokens": 1, "max": 3, "min": 1},
                                (np.zeros((1,) if other_schema.startswith("ngram") else (1, 1, 128), np.float32),))
    )
    misaligned = DraftRowCheckpoint(good.processed_tokens + 1, good.attachment)
    for bad, error in ((unknown, SchemaError), (wrong_schema, SchemaError), (misaligned, SchemaError)):
        with pytest.raises(error):
            group.append([None, bad])
        with pytest.raises(error):
            provider.open(rows, [bad])
    assert _state(group) == before


def test_provider_specific_alignment_checks(tiny):
    ngram = tiny.provider("ngram")
    history = mx.array([1, 2, 3], dtype=mx.int32)
    other_policy = DraftRowCheckpoint(3, CheckpointAttachment("ngram-history-v1", {"max": 4, "min": 1}, (history,)))
    with pytest.raises(SchemaError, match="lookup policy"):
        ngram.validate_checkpoint(other_policy)
    assistant = tiny.provider("assistant")
    small = DraftRowCheckpoint(2, CheckpointAttachment("gemma-assistant-v1", {"processedTokens": 2},
                                                       (mx.zeros((1, 1, 64)),)))
    with pytest.raises(SchemaError, match="hidden size"):
        assistant.validate_checkpoint(small)
    _, _, group = _prefilled(tiny, "draft-model", [[5, 6, 7, 8]])
    good = group.capture(0)
    metadata = dict(good.attachment.metadata, pendingLast=8)  # claims one token less in the KV than it holds
    with pytest.raises(SchemaError, match="alignment"):
        tiny.provider("draft-model").validate_checkpoint(
            DraftRowCheckpoint(3, CheckpointAttachment(good.attachment.schema, metadata, good.attachment.tensors))
        )


@pytest.mark.parametrize("name", GROUPS)
def test_failed_draft_append_leaves_target_and_draft_rows_unchanged(tiny, name):
    provider, rows, group = _prefilled(tiny, name, [[5, 6, 7, 8], [9, 10]])
    joining = TargetRows.from_row_caches(tiny.target, [None])
    joining.prefill([[1, 2, 3]])
    before_rows, before_group = rows.offsets, _state(group)
    disposed = []

    def injected_failure():
        raise RuntimeError("injected draft-side failure")

    def draft_side():
        change = group.prepare_append([None])
        return PreparedStateChange(change.commit, lambda: (disposed.append(True), change.dispose()))

    with pytest.raises(RuntimeError, match="injected"):
        apply_state_changes([lambda: rows.prepare_append(joining), draft_side, injected_failure])
    assert rows.offsets == before_rows and _state(group) == before_group and disposed == [True]
    apply_state_changes([lambda: rows.prepare_append(joining), lambda: group.prepare_append([None])])
    assert rows.row_count == group.row_count == 3


def test_assistant_cold_rows_get_zero_hidden_of_the_target_dtype(tiny):
    provider, rows, group = _prefilled(tiny, "assistant", [[5, 6, 7, 8]])
    warm = group.capture(0)
    mixed = provider.open(rows, [None, warm, None])
    hidden = [mixed.capture(i).attachment.tensors[0] for i in range(3)]
    assert all(h.dtype == tiny.target.dtype and h.shape == (1, 1, tiny.target.hidden_size) for h in hidden)
    assert not mx.any(hidden[0]).item() and not mx.any(hidden[2]).item()
    assert mx.array_equal(hidden[1], warm.attachment.tensors[0])
    assert mixed.processed == (0, 3, 0)


def test_assistant_commit_takes_the_hidden_of_the_last_kept_position(tiny):
    provider, rows, group = _prefilled(tiny, "assistant", [[5, 6, 7, 8], [9, 10]])
    window = [[8, 1, 2], [10, 3, 4]]
    out = rows.verify(window)
    group.commit([2, 0], RoundContext(window, out.hidden))
    assert group.processed == (6, 2)
    assert mx.array_equal(group.capture(0).attachment.tensors[0][0, 0], out.hidden[0, 2])
    assert mx.array_equal(group.capture(1).attachment.tensors[0][0, 0], out.hidden[1, 0])


def test_draft_model_keeps_pending_last_when_every_draft_is_kept(tiny):
    provider, rows, group = _prefilled(tiny, "draft-model-full", [[5, 6, 7, 8], [9, 10]])
    proposals = group.draft([8, 10], 2)
    window = [[8, *proposals[0]], [10, *proposals[1]]]
    out = rows.verify(window)
    group.commit([2, 1], RoundContext(window, out.hidden))
    first, second = group.capture(0), group.capture(1)
    assert first.processed_tokens == 6 and first.attachment.metadata["pendingLast"] == proposals[0][1]
    assert second.processed_tokens == 3 and second.attachment.metadata["pendingLast"] is False
    validate_checkpoint(first)
    restored = provider.open(rows, [first, second])
    assert restored.draft([1, 2], 1) == group.draft([1, 2], 1)


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 1, 2) == [9, 1]
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 1, 0) == []
    assert lookup([4, 5, 6], 3, 1, 2) == []
    assert lookup([7, 1, 8, 2, 1], 3, 1, 3) == [8, 2, 1]  # longest suffix "1" -> latest earlier occurrence
    assert lookup([1, 5, 1, 6, 1], 2, 1, 1) == [6]  # the most recent earlier occurrence wins
    assert lookup([1, 5, 1, 6, 1], 2, 2, 1) == []  # no earlier bigram "6 1"


def test_float_and_quantized_target_rows_implement_the_declared_protocol():
    """Both target row kinds speak ``TargetRowGroup`` with compatible signatures (what the engine relies on)."""
    import inspect

    from spec_cache.rows.protocol import TargetRowGroup
    from spec_cache.rows.quantized_rows import QuantizedTargetRows
    from spec_cache.rows.target import TargetRows

    members = [name for name in vars(TargetRowGroup) if not name.startswith("_")]
    assert {"prefill", "verify", "rollback", "extract", "prepare_append", "filter_rows"} <= set(members)
    for cls in (TargetRows, QuantizedTargetRows):
        for name in members:
            declared, implemented = getattr(TargetRowGroup, name), getattr(cls, name, None)
            assert implemented is not None, f"{cls.__name__} lacks {name}"
            assert isinstance(declared, property) == isinstance(implemented, property), (cls.__name__, name)
            if callable(declared) and not isinstance(declared, property):
                wanted = [p for p in inspect.signature(declared).parameters.values()
                          if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
                given = inspect.signature(implemented).parameters
                assert all(p.name in given for p in wanted), (cls.__name__, name)


def test_extract_reads_each_row_where_the_device_left_padding_says(tiny):
    """``extract`` finds a full-attention row's keys from host-side counts (``_idx - length``), never waiting on the
    device for ``left_padding``: after a ragged prefill, a rollback of different lengths, a join and a filter,
    every row's extracted keys are the ones ``left_padding`` (read from the device here) delimits."""
    target = tiny.target
    rows = TargetRows.from_row_caches(target, [None] * 3)
    rows.prefill([[5, 6, 7, 8, 9, 10], [20], [30, 31, 32]], step=4)
    rows.verify([[11, 12, 13], [21, 22, 23], [33, 34, 35]])
    rows.rollback([0, 2, 3])
    joining = TargetRows.from_row_caches(target, [None])
    joining.prefill([[7, 8, 9, 10, 11]])
    apply_state_changes([lambda: rows.prepare_append(joining)])
    rows.filter_rows([3, 0, 1])
    for row in range(rows.row_count):
        for layer, got in enumerate(rows.extract(row)):
            cache = rows._caches[layer]
            left = int(cache.left_padding[row].item())
            want = cache.keys[row:row + 1, :, left:cache._idx]
            assert got.offset == rows.offsets[row] == want.shape[2]
            values = cache.values[row:row + 1, :, left:cache._idx]
            assert mx.array_equal(got.keys, want) and mx.array_equal(got.values, values)
