"""Pipelined plain rounds (``SpeculativeEngine(pipeline=True)``): the next round is queued on the device before the
host reads this one. The contract is exactness: the same tokens and bit-identical checkpoints as the synchronous
session (``pipeline=False``) and the target's own greedy tokens, with rows that finish at different rounds (EOS,
``max_tokens``), join mid-decode, leave (``finish``, ``cancel``), are checkpointed mid-decode, or sample."""

from __future__ import annotations

import mlx.core as mx
import pytest

from spec_cache.decode.depth import DepthController
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.rows.sampling import RowSampling
from spec_cache.rows.target import TargetModel, TargetRows
from spec_cache.testing.tiny import write_tiny_target
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

EOS_AT = 7  # row A's EOS: its greedy token at this index


def _owned(caches) -> list:
    return [(mx.array(c.keys[..., : c.offset, :]), mx.array(c.values[..., : c.offset, :]), int(c.offset))
            for c in caches]


def _draft_arrays(draft) -> list:
    if draft is None:
        return []
    attachment = draft.attachment
    return [draft.processed_tokens, attachment.schema, dict(attachment.metadata)] + [
        ("tensor", mx.array(tensor)) for tensor in attachment.tensors]


def scripted(target: TargetModel, provider, pipeline: bool, max_rows=None) -> dict:
    """One session with everything that changes a batch: EOS, max_tokens, a late join, a checkpoint and a finish
    from callbacks, a cancel between steps, a sampled row. Returns what the owner saw."""
    eos = plain_greedy(target, PROMPTS[0], 20)[EOS_AT]
    engine = SpeculativeEngine(target, provider, draft_depth=3, max_rows=max_rows, pipeline=pipeline)
    if engine.depth is not None:
        # a controller that expects no acceptance (and probes with none) keeps every round at depth 0 whatever
        # the clock says: the wall clock would make the two sessions choose different depths, which decide a
        # drafter's checkpoint (the draft model's ``pendingLast``) and how many tokens a round emits
        engine.depth = DepthController(3, prior_acceptance=0.0, probe_acceptance=0.0)
    checkpoints, streamed, results, events = [], {}, {}, []

    def on_checkpoint(row, tokens, caches, draft):
        checkpoints.append((row, list(tokens), _owned(caches), _draft_arrays(draft)))

    session = engine.session(eos_token_ids=[eos], on_checkpoint=on_checkpoint)

    def on_tokens(row, tokens):
        streamed.setdefault(row, []).extend(tokens)
        events.append(("tokens", row))
        if row == sampled and len(streamed[row]) == 6:
            assert session.checkpoint(row)  # taken at the end of this step; the row goes on
        if row == stopped and len(streamed[row]) == 9:
            assert session.finish(row)

    def on_finish(row, result):
        results[row] = result

    def submit(prompt, **options):
        return session.submit(RowRequest(prompt, **options), on_tokens=on_tokens, on_finish=on_finish)

    rows = {"eos": submit(PROMPTS[0], max_tokens=20), "short": submit(PROMPTS[1], max_tokens=5)}
    sampled = submit(PROMPTS[2], max_tokens=16, sampling=RowSampling(0.8, 0.9, 7), stop_at_eos=False)
    stopped = submit([40, 41, 42, 43, 44], max_tokens=30, stop_at_eos=False)
    doomed = submit([50, 51, 52], max_tokens=30, stop_at_eos=False)
    rows.update(sampled=sampled, stopped=stopped, doomed=doomed)
    for step in range(1, 40):
        if not session.step():
            break
        if step == 3:
            rows["late"] = submit([9, 10, 11], max_tokens=12, stop_at_eos=False)
        if step == 8:
            assert session.cancel(doomed)  # between steps: gone at once
    session.close()
    return {"rows": rows, "eos": eos, "checkpoints": checkpoints, "streamed": streamed, "events": events,
            "results": {row: (r.tokens, r.reason, r.cancelled, r.cached_tokens) for row, r in results.items()}}


def _assert_same_checkpoints(a: list, b: list) -> None:
    assert [(row, tokens) for row, tokens, _, _ in a] == [(row, tokens) for row, tokens, _, _ in b]
    for (_, _, layers_a, draft_a), (_, _, layers_b, draft_b) in zip(a, b):
        for (ka, va, oa), (kb, vb, ob) in zip(layers_a, layers_b, strict=True):
            assert oa == ob and ka.dtype == kb.dtype
            assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()  # bit for bit
        assert len(draft_a) == len(draft_b)
        for xa, xb in zip(draft_a, draft_b):
            if isinstance(xa, tuple):
                assert xa[0] == xb[0] and mx.array_equal(xa[1], xb[1]).item()
            else:
                assert xa == xb


@pytest.mark.parametrize("provider_name,max_rows", [(None, None), (None, 3), ("draft-model", None), ("ngram", 3)])
def test_pipelined_session_equals_synchronous_session(tiny, provider_name, max_rows):
    piped = scripted(tiny.target, tiny.provider(provider_name), True, max_rows)
    plain = scripted(tiny.target, tiny.provider(provider_name), False, max_rows)
    assert piped["results"] == plain["results"] and piped["streamed"] == plain["streamed"]
    _assert_same_checkpoints(piped["checkpoints"], plain["checkpoints"])
    rows, results = piped["rows"], piped["results"]
    reference = plain_greedy(tiny.target, PROMPTS[0], 20)
    assert results[rows["eos"]][:2] == (reference[: EOS_AT + 1], "eos")  # EOS first met at EOS_AT
    assert results[rows["short"]][:2] == (plain_greedy(tiny.target, PROMPTS[1], 5), "length")
    assert results[rows["late"]][:2] == (plain_greedy(tiny.target, [9, 10, 11], 12), "length")
    stop = results[rows["stopped"]]
    assert stop[1] == "stop" and stop[0] == plain_greedy(tiny.target, [40, 41, 42, 43, 44], 30)[:9]
    assert results[rows["doomed"]][2] and results[rows["sampled"]][1] == "length"
    by_row = {}
    for row, tokens, _, _ in piped["checkpoints"]:
        by_row.setdefault(row, []).append(tokens)
    for name, prompt in [("eos", PROMPTS[0]), ("short", PROMPTS[1]), ("stopped", [40, 41, 42, 43, 44])]:
        generated = results[rows[name]][0]
        assert by_row[rows[name]] == [prompt[:-1], prompt + generated[:-1]]  # boundary, finish
    assert len(by_row[rows["sampled"]]) == 3 and len(by_row[rows["sampled"]][1]) == len(PROMPTS[2]) + 5
    # cancelled: its boundary only (none when max_rows kept it waiting until then)
    assert by_row.get(rows["doomed"], []) == ([] if max_rows else [[50, 51]])


def test_plain_rounds_are_queued_before_the_host_reads_the_last_one(tiny, monkeypatch):
    """The order of forwards and token deliveries: pipelined, round k+1's forward is built before round k's tokens
    reach the owner, except after the first token, which reaches the owner first (round 2 is built right after
    it); the round after the last is never built when ``max_tokens`` ends the row."""
    target = tiny.target

    def run(pipeline):
        order = []
        forward = TargetModel.forward

        def counted(self, ids, caches, **kwargs):
            order.append("F")
            return forward(self, ids, caches, **kwargs)

        monkeypatch.setattr(TargetModel, "forward", counted)
        session = SpeculativeEngine(target, None, pipeline=pipeline).session()
        session.submit(RowRequest(PROMPTS[0], max_tokens=4), on_tokens=lambda row, tokens: order.append("T"))
        while session.step():
            pass
        session.close()
        monkeypatch.setattr(TargetModel, "forward", forward)
        return "".join(order)

    assert run(False) == "F" + "FT" * 4  # prefill, then one forward per token, each read before the next
    # the first token is delivered before round 2 is built; from then on the next round is in flight while the
    # host reads (the first-token-first order fails on a session that queues round 2 before that read)
    assert run(True) == "F" + "FT" + "F" + "FT" * 2 + "T"


def test_nothing_is_queued_after_a_first_token_that_ends_the_row(tiny, monkeypatch):
    """The round queued after a first token (``_queue_after_first``) is built only when the row goes on: not when
    ``max_tokens`` is 1 nor when the first token is EOS; with ``max_tokens`` 2 it is the row's last forward."""
    target = tiny.target
    first = plain_greedy(target, PROMPTS[1], 1)[0]

    def run(max_tokens, eos=()):
        order = []
        forward = TargetModel.forward

        def counted(self, ids, caches, **kwargs):
            order.append("F")
            return forward(self, ids, caches, **kwargs)

        monkeypatch.setattr(TargetModel, "forward", counted)
        session = SpeculativeEngine(target, None, pipeline=True).session(eos_token_ids=list(eos))
        session.submit(RowRequest(PROMPTS[1], max_tokens=max_tokens), on_tokens=lambda row, t: order.append("T"))
        while session.step():
            pass
        session.close()
        monkeypatch.setattr(TargetModel, "forward", forward)
        return "".join(order)

    assert run(1) == "FFT"
    assert run(8, eos=[first]) == "FFT"
    assert run(2) == "FFTFT"


def test_a_row_finishing_at_eos_discards_the_queued_round(tiny):
    """B=1 with EOS: the queued round after the EOS token is discarded (the finish checkpoint covers exactly
    ``prompt + generated[:-1]``) and a later row in the same session decodes as if it had never been computed."""
    target = tiny.target
    reference = plain_greedy(target, PROMPTS[2], 16)
    eos = reference[4]
    for pipeline in (True, False):
        calls = []
        session = SpeculativeEngine(target, None, pipeline=pipeline).session(
            eos_token_ids=[eos], on_checkpoint=lambda row, tokens, caches, draft: calls.append((tokens, caches)))
        session.submit(RowRequest(PROMPTS[2], max_tokens=16))
        while session.step():
            pass
        session.submit(RowRequest(PROMPTS[0], max_tokens=10, stop_at_eos=False))
        while session.step():
            pass
        session.close()
        tokens, caches = calls[1]
        assert tokens == PROMPTS[2] + reference[: reference.index(eos)]
        assert all(c.offset == len(tokens) for c in caches)
        if pipeline:
            piped = calls
        else:
            _assert_same_checkpoints([(0, t, _owned(c), []) for t, c in piped],
                                     [(0, t, _owned(c), []) for t, c in calls])
    assert piped[3][0] == PROMPTS[0] + plain_greedy(target, PROMPTS[0], 10)[:-1]


def test_discard_last_restores_the_exact_layout(tiny):
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    rows.prefill([PROMPTS[0], PROMPTS[1]])
    before = [(c.keys[..., : c._idx, :], c.values[..., : c._idx, :], c.offset, c.left_padding, c._idx)
              for c in rows._caches]
    mx.eval([a for layer in before for a in layer[:4]])
    reference = rows.append_ids(mx.array([[3], [4]])).logits
    rows.discard_last(1)
    assert rows.offsets == (len(PROMPTS[0]), len(PROMPTS[1]))
    for cache, (keys, values, offset, left, idx) in zip(rows._caches, before):
        assert cache._idx == idx and mx.array_equal(cache.offset, offset).item()
        assert mx.array_equal(cache.left_padding, left).item()
        assert mx.array_equal(cache.keys[..., :idx, :], keys).item()
    again = rows.append_ids(mx.array([[3], [4]])).logits
    assert mx.array_equal(again, reference).item()
    with pytest.raises(ValueError):
        rows.discard_last(100)
    with pytest.raises(ValueError):
        rows.append_ids(mx.array([[1]]))


def test_sliding_window_target_pipelined_equals_synchronous(tmp_path):
    target = TargetModel.load(write_tiny_target(tmp_path / "gemma", "gemma3_text", tokenizer=False))
    prompts = [list(range(3, 20)), [5, 6, 7]]
    outs = []
    for pipeline in (True, False):
        calls = []
        engine = SpeculativeEngine(target, None, pipeline=pipeline)
        results = engine.run([RowRequest(p, max_tokens=m) for p, m in zip(prompts, (14, 6))],
                             on_checkpoint=lambda row, tokens, caches, draft: calls.append(
                                 (row, tokens, _owned(caches), [])))
        outs.append(([r.tokens for r in results], calls))
    assert outs[0][0] == outs[1][0] == [plain_greedy(target, p, m) for p, m in zip(prompts, (14, 6))]
    _assert_same_checkpoints(outs[0][1], outs[1][1])


def test_pipeline_option_is_checked(tiny):
    with pytest.raises(ValueError, match="pipeline"):
        SpeculativeEngine(tiny.target, None, pipeline="yes")


def _assert_unpadded_forward_matches_masked(target, caches, ids) -> None:
    """Forward ``ids`` with the batch cache's array mask, trim it back, forward again as unpadded (no mask for one
    token, ``"causal"`` for more): bit-identical logits on the CPU (on a GPU another attention kernel runs)."""
    masked = target.forward(ids, caches).logits
    mx.eval(masked)
    for cache in caches:
        cache.trim(ids.shape[1])
    unpadded = target.forward(ids, caches, unpadded=True).logits
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(masked, unpadded).item()
    else:
        assert mx.allclose(masked, unpadded, atol=1e-2).item()


def test_one_token_step_without_left_padding_needs_no_mask(tiny):
    """Rows with no left padding take a one-token step unmasked (as mlx-lm's own decode step, and faster on the
    GPU): on the CPU the logits are bit-identical to the masked step (on a GPU the masked step runs another
    attention kernel, the unmasked one mlx-lm's); with left padding the mask stays."""
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    rows.prefill([PROMPTS[0], PROMPTS[0][::-1]])
    assert rows._unpadded()
    _assert_unpadded_forward_matches_masked(tiny.target, rows._caches, mx.array([[3], [4]], dtype=mx.uint32))
    uneven = TargetRows.from_row_caches(tiny.target, [None, None])
    uneven.prefill([PROMPTS[0], PROMPTS[1]])
    assert not uneven._unpadded()  # the shorter row is left-padded: it must not see the padding


def test_a_chunk_over_rows_without_left_padding_is_causal_not_an_array_mask(tiny, monkeypatch):
    """A multi-token forward over rows without left padding passes mlx-lm's ``"causal"`` mode, not the batch
    cache's array (which MLX's CUDA backend widens to a [B, heads, chunk, keys] bias every layer): on the CPU
    the logits are bit-identical to the array-masked forward, and a prefill of rows of different lengths (right
    padding only) gives each row the state a prefill of that row alone gives."""
    import spec_cache.rows.ports as ports

    modes = []
    real = ports.DecoderPort._masks

    def spy(self, h, caches, unpadded):
        masks = real(self, h, caches, unpadded)
        modes.append(masks[0] if isinstance(masks[0], str) or masks[0] is None else "array")
        return masks

    monkeypatch.setattr(ports.DecoderPort, "_masks", spy)
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    rows.prefill([PROMPTS[0], PROMPTS[0][::-1]], step=4)
    assert set(modes) == {"causal"}
    _assert_unpadded_forward_matches_masked(tiny.target, rows._caches,
                                            mx.array([[3, 5, 7], [4, 6, 8]], dtype=mx.uint32))

    modes.clear()
    ragged = TargetRows.from_row_caches(tiny.target, [None, None])
    ragged.prefill([PROMPTS[0], PROMPTS[1]], step=4)  # right padding of the shorter row's chunks: still causal
    assert set(modes) == {"causal"}
    assert not ragged._unpadded()  # after finalize the shorter row is left-padded
    modes.clear()
    ragged.prefill([[9, 10, 11], [12, 13, 14]])
    assert modes == ["array"]  # left padding: the array mask hides it
    for row, prompt in enumerate((PROMPTS[0], PROMPTS[1])):
        alone = TargetRows.from_row_caches(tiny.target, [None])
        alone.prefill([prompt + [[9, 10, 11], [12, 13, 14]][row]], step=4)
        theirs = alone.split_row(0)
        ours = ragged.split_row(row)
        for a, b in zip(ours, theirs):
            assert a.offset == b.offset
            assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]).item()
            assert mx.array_equal(a.values[..., : a.offset, :], b.values[..., : b.offset, :]).item()
