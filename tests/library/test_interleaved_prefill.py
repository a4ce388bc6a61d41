"""Rows joining a decoding batch are prefilled chunk by chunk between its rounds
(``SpeculativeEngine(interleave_prefill=True)``, ``spec_cache.rows.joining``).

The contract: nobody's tokens change (the joining rows' and the decoding rows' equal the target's own greedy
tokens and the unsplit session's), the boundary checkpoints are bit-identical, the decoding rows keep emitting
tokens while a long prompt prefills, and a row that leaves while it prefills goes cleanly."""

from __future__ import annotations

import mlx.core as mx
import pytest

from spec_cache.decode.depth import DepthController
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.errors import InvalidRequest
from tests.runtime_fixtures import _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

STEP = 4  # prefill_step_size: a 30-token prompt takes 8 chunks
LONG = [(7 * i + 3) % 60 + 2 for i in range(30)]
OTHER = [(5 * i + 1) % 50 + 3 for i in range(23)]


def _owned(caches) -> list:
    return [(mx.array(c.keys[..., : c.offset, :]), mx.array(c.values[..., : c.offset, :]), int(c.offset))
            for c in caches]


def _engine(target, provider=None, *, interleave=True, pipeline=True, max_rows=None):
    engine = SpeculativeEngine(target, provider, draft_depth=3, prefill_step_size=STEP, max_rows=max_rows,
                               pipeline=pipeline, interleave_prefill=interleave)
    if engine.depth is not None:  # the wall clock must not choose depths (they decide a drafter's checkpoints)
        engine.depth = DepthController(3, prior_acceptance=0.0, probe_acceptance=0.0)
    return engine


def _session_run(engine, *, cancel_joiner_after: int | None = None) -> dict:
    """Row A decodes; after its third step B (long) and C (shorter) are submitted together; later D joins alone.
    Records each row's tokens, the step of each row's first token, and the boundary checkpoints."""
    streamed, first_step, checkpoints, results = {}, {}, [], {}
    step_no = 0

    def on_tokens(row, tokens):
        streamed.setdefault(row, []).extend(tokens)
        first_step.setdefault(row, step_no)

    def on_finish(row, result):
        results[row] = result

    def on_checkpoint(row, tokens, caches, draft):
        checkpoints.append((row, list(tokens), _owned(caches)))

    session = engine.session(on_checkpoint=on_checkpoint)

    def submit(prompt, n):
        return session.submit(RowRequest(prompt, max_tokens=n, stop_at_eos=False), on_tokens=on_tokens,
                              on_finish=on_finish)

    rows = {"a": submit([11, 12, 13], 40)}
    submitted_at = {}
    while step_no < 80:
        step_no += 1
        if not session.step():
            break
        if step_no == 3:
            rows["b"], rows["c"] = submit(LONG, 10), submit(OTHER, 8)
            submitted_at["b"] = step_no
        if step_no == 5 and cancel_joiner_after is not None:
            assert session.cancel(rows["c"])  # C leaves while it prefills
        if step_no == 6:
            rows["d"] = submit(LONG[:17], 6)
    session.close()
    return {"rows": rows, "streamed": streamed, "first_step": first_step, "checkpoints": checkpoints,
            "results": results, "submitted_at": submitted_at}


@pytest.mark.parametrize("pipeline", [True, False])
def test_joining_rows_prefill_between_rounds_and_change_no_tokens(tiny, pipeline):
    split = _session_run(_engine(tiny.target, pipeline=pipeline))
    whole = _session_run(_engine(tiny.target, pipeline=pipeline, interleave=False))
    rows = split["rows"]
    for name, prompt, n in [("a", [11, 12, 13], 40), ("b", LONG, 10), ("c", OTHER, 8), ("d", LONG[:17], 6)]:
        assert split["streamed"][rows[name]] == plain_greedy(tiny.target, prompt, n), name
        assert whole["streamed"][rows[name]] == split["streamed"][rows[name]], name
    # the cohort B+C needs 8 chunks of 4 positions (29 tokens for B): A decodes through them
    a, b = rows["a"], rows["b"]
    during = [s for s in range(split["submitted_at"]["b"] + 1, split["first_step"][b])]
    assert len(during) >= 7
    a_tokens_split = sum(1 for s in during if split["first_step"][a] <= s)
    assert a_tokens_split == len(during)  # every step of B's prefill ran A's round too
    # unsplit, B's whole prefill happens in the step after it was submitted: its first token comes then
    assert whole["first_step"][b] == whole["submitted_at"]["b"] + 1
    assert split["first_step"][b] > whole["first_step"][b]
    # boundary (and finish) checkpoints: same rows, same tokens, bit-identical K/V
    key = lambda calls: sorted(calls, key=lambda c: (c[0], len(c[1])))  # noqa: E731
    got, want = key(split["checkpoints"]), key(whole["checkpoints"])
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    for (_, _, layers_a), (_, _, layers_b) in zip(got, want):
        for (ka, va, oa), (kb, vb, ob) in zip(layers_a, layers_b, strict=True):
            assert oa == ob and mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()


@pytest.mark.parametrize("provider_name", ["ngram", "draft-model", "assistant"])
def test_drafters_over_interleaved_joins_keep_the_tokens(tiny, provider_name):
    split = _session_run(_engine(tiny.target, tiny.provider(provider_name)))
    whole = _session_run(_engine(tiny.target, tiny.provider(provider_name), interleave=False))
    rows = split["rows"]
    for name, prompt, n in [("a", [11, 12, 13], 40), ("b", LONG, 10), ("c", OTHER, 8), ("d", LONG[:17], 6)]:
        assert split["streamed"][rows[name]] == plain_greedy(tiny.target, prompt, n), (provider_name, name)
    assert split["first_step"][rows["b"]] > whole["first_step"][rows["b"]]


def test_projected_drafter_needing_taps_is_prefilled_whole(tiny):
    """A drafter that reads the target's taps at every prefilled token gets them from one prefill call: the
    cohort is not split, and the tokens stay the target's."""
    split = _session_run(_engine(tiny.target, tiny.provider("deepspec")))
    rows = split["rows"]
    assert split["first_step"][rows["b"]] == split["submitted_at"]["b"] + 1
    assert split["streamed"][rows["b"]] == plain_greedy(tiny.target, LONG, 10)


def test_a_row_cancelled_while_it_prefills_leaves_and_the_others_go_on(tiny):
    run = _session_run(_engine(tiny.target), cancel_joiner_after=5)
    rows, results = run["rows"], run["results"]
    c = rows["c"]
    assert results[c].cancelled and results[c].reason == "cancelled" and results[c].tokens == []
    assert c not in run["streamed"]
    assert not any(row == c for row, _, _ in run["checkpoints"])  # it never reached its boundary
    for name, prompt, n in [("a", [11, 12, 13], 40), ("b", LONG, 10), ("d", LONG[:17], 6)]:
        assert run["streamed"][rows[name]] == plain_greedy(tiny.target, prompt, n), name


def test_the_whole_cohort_cancelled_while_it_prefills(tiny):
    engine = _engine(tiny.target)
    results = {}
    session = engine.session()
    a = session.submit(RowRequest([11, 12, 13], max_tokens=12, stop_at_eos=False),
                       on_finish=lambda r, res: results.setdefault(r, res))
    session.step()
    b = session.submit(RowRequest(LONG, max_tokens=4, stop_at_eos=False),
                       on_finish=lambda r, res: results.setdefault(r, res))
    session.step()  # B's first chunk
    assert session.waiting_count == 1 and session.active_count == 1  # B prefills: counted as not decoding yet
    assert session.cancel(b) and results[b].cancelled
    assert session.waiting_count == 0
    while session.step():
        pass
    session.close()
    assert results[a].tokens == plain_greedy(tiny.target, [11, 12, 13], 12)


def test_restored_rows_join_by_chunks_too(tiny):
    """A row restored from a boundary checkpoint forwards only its new tokens, split the same way."""
    prompt = LONG + OTHER
    saved = {}

    def keep(row, tokens, caches, draft):
        saved.setdefault("tokens", list(tokens))
        saved.setdefault("caches", caches)

    SpeculativeEngine(tiny.target, prefill_step_size=STEP).run([RowRequest(LONG, max_tokens=1)], on_checkpoint=keep)
    assert saved["tokens"] == LONG[:-1]
    engine = _engine(tiny.target)
    session = engine.session()
    out = {}
    session.submit(RowRequest([11, 12, 13], max_tokens=30, stop_at_eos=False),
                   on_tokens=lambda r, t: out.setdefault(r, []).extend(t))
    session.step()
    joiner = session.submit(RowRequest(prompt, restored_caches=saved["caches"], restored_tokens=len(LONG) - 1,
                                       max_tokens=6, stop_at_eos=False),
                            on_tokens=lambda r, t: out.setdefault(r, []).extend(t))
    steps_to_first = 0
    while joiner not in out:
        session.step()
        steps_to_first += 1
    while session.step():
        pass
    session.close()
    assert steps_to_first == -(-(len(prompt) - 1 - (len(LONG) - 1)) // STEP)  # one chunk per step
    assert out[joiner] == plain_greedy(tiny.target, prompt, 6)


def test_interleave_option_is_checked(tiny):
    with pytest.raises(InvalidRequest, match="interleave_prefill"):
        SpeculativeEngine(tiny.target, interleave_prefill="yes")


def test_prefill_without_a_reader_of_the_hidden_leaves_the_same_caches(tiny):
    """``need_hidden=False``: no last hidden (None), the very same K/V bit for bit."""
    from spec_cache.rows.target import TargetRows

    tokens = [LONG, OTHER]
    with_hidden, without = (TargetRows.from_row_caches(tiny.target, [None, None]) for _ in range(2))
    got = with_hidden.prefill(tokens, step=STEP)
    none = without.prefill(tokens, step=STEP, need_hidden=False)
    assert got.last_hidden is not None and none.last_hidden is None and none.lengths == got.lengths
    for i in range(2):
        for a, b in zip(with_hidden.extract(i), without.extract(i), strict=True):
            assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]).item()
            assert mx.array_equal(a.values[..., : a.offset, :], b.values[..., : b.offset, :]).item()


@pytest.mark.parametrize("provider_name", [None, "ngram"])
def test_the_engine_asks_for_the_hidden_only_for_a_drafter(tiny, provider_name, monkeypatch):
    from spec_cache.rows.batch_rows import BatchRows

    asked = []
    original = BatchRows.prefill

    def spy(self, tokens_per_row, step=512, **options):
        asked.append(options.get("need_hidden", True))
        return original(self, tokens_per_row, step, **options)

    monkeypatch.setattr(BatchRows, "prefill", spy)
    run = _session_run(_engine(tiny.target, tiny.provider(provider_name)))
    assert asked and set(asked) == {provider_name is not None}
    rows = run["rows"]
    assert run["streamed"][rows["b"]] == plain_greedy(tiny.target, LONG, 10)


def test_a_row_without_boundary_checkpoint_is_not_extracted_at_its_boundary(tiny):
    calls = []
    engine = _engine(tiny.target)
    session = engine.session(on_checkpoint=lambda row, tokens, caches, draft: calls.append((row, len(tokens))))
    out = {}
    keep = session.submit(RowRequest(OTHER, max_tokens=3, stop_at_eos=False),
                          on_tokens=lambda r, t: out.setdefault(r, []).extend(t))
    skip = session.submit(RowRequest(LONG, max_tokens=3, stop_at_eos=False, boundary_checkpoint=False),
                          on_tokens=lambda r, t: out.setdefault(r, []).extend(t))
    while session.step():
        pass
    session.close()
    assert (keep, len(OTHER) - 1) in calls and not any(row == skip and n == len(LONG) - 1 for row, n in calls)
    assert (skip, len(LONG) + 2) in calls  # its finish checkpoint as usual
    assert out[skip] == plain_greedy(tiny.target, LONG, 3) and out[keep] == plain_greedy(tiny.target, OTHER, 3)


@pytest.mark.parametrize("together", [False, True])
def test_a_short_row_never_waits_behind_a_long_cohort(tiny, together):
    """A row of one chunk submitted while a long cohort prefills (or beside it) joins in the next step; every
    row's tokens stay the target's own."""
    engine = _engine(tiny.target)
    session = engine.session()
    first, out, step_no = {}, {}, 0

    def on_tokens(row, tokens):
        out.setdefault(row, []).extend(tokens)
        first.setdefault(row, step_no)

    def submit(prompt, n):
        return session.submit(RowRequest(prompt, max_tokens=n, stop_at_eos=False), on_tokens=on_tokens)

    a = submit([11, 12, 13], 30)
    step_no += 1
    session.step()
    long = submit(LONG, 5)
    if not together:
        step_no += 1
        session.step()  # the long cohort's first chunk
        assert session.waiting_count == 1
    short = submit([7, 8, 9], 5)
    step_no += 1
    session.step()
    short_at = step_no
    while session.step():
        step_no += 1
    session.close()
    assert first[short] == short_at < first[long]
    for row, prompt, n in ((a, [11, 12, 13], 30), (long, LONG, 5), (short, [7, 8, 9], 5)):
        assert out[row] == plain_greedy(tiny.target, prompt, n)


@pytest.mark.parametrize("whole_batch", [True, False], ids=["alone", "beside-a-decoding-row"])
def test_checkpoints_from_the_prefill_chunks_are_the_cold_state_at_each_offset(tiny, whole_batch):
    """``RowRequest.checkpoint_at``: the state handed to ``on_checkpoint`` at each offset, taken as the prefill
    passes it (chunks end there), is bit-identical to a cold prefill of exactly that prefix (its boundary
    checkpoint), and the row's tokens are the target's own greedy ones; offsets outside (restored, boundary) and
    a drafter session (no ``prefill_checkpoints``) take none."""
    engine = _engine(tiny.target, pipeline=False)
    assert engine.prefill_checkpoints
    offsets = (1, 6, 9, 21, 29, 30, 31)  # 1..29 inside; 29 is the boundary (len - 1): left to the boundary rule
    got, streamed = [], {}
    session = engine.session(on_checkpoint=lambda row, tokens, caches, draft: got.append(
        (row, list(tokens), _owned(caches), draft)))
    if not whole_batch:
        session.submit(RowRequest([11, 12, 13], max_tokens=30, stop_at_eos=False))
        session.step()
    row = session.submit(RowRequest(LONG, max_tokens=3, stop_at_eos=False, checkpoint_at=offsets),
                         on_tokens=lambda r, t: streamed.setdefault(r, []).extend(t))
    while session.step():
        pass
    session.close()
    assert streamed[row] == plain_greedy(tiny.target, LONG, 3)
    mine = [(tokens, state) for r, tokens, state, draft in got if r == row and len(tokens) < len(LONG) - 1]
    assert [len(tokens) for tokens, _ in mine] == [1, 6, 9, 21]
    for tokens, state in mine:
        assert tokens == LONG[: len(tokens)]
        cold = []
        reference = _engine(tiny.target, pipeline=False).session(
            on_checkpoint=lambda r, t, caches, d: cold.append(_owned(caches)))
        reference.submit(RowRequest(LONG[: len(tokens) + 1], max_tokens=1, stop_at_eos=False))
        while reference.step():
            pass
        reference.close()
        for (k, v, n), (ck, cv, cn) in zip(state, cold[0]):
            assert n == cn == len(tokens)
            assert mx.array_equal(k, ck).item() and mx.array_equal(v, cv).item()
    drafting = _engine(tiny.target, tiny.provider("draft-model"))
    assert not drafting.prefill_checkpoints


def test_a_short_row_joining_whole_stops_at_each_offset_and_joins_in_the_same_step(tiny):
    """A row short enough to join in the step it is admitted (beside a decoding row) forwards up to each offset,
    checkpoints there and goes on within that step: it joins, and its tokens are the target's greedy ones."""
    engine = SpeculativeEngine(tiny.target, None, prefill_step_size=64, pipeline=False)
    got, streamed = [], {}
    session = engine.session(on_checkpoint=lambda row, tokens, caches, draft: got.append((row, len(tokens))))
    session.submit(RowRequest([11, 12, 13], max_tokens=30, stop_at_eos=False))
    session.step()
    row = session.submit(RowRequest(LONG, max_tokens=3, stop_at_eos=False, checkpoint_at=(6, 21)),
                         on_tokens=lambda r, t: streamed.setdefault(r, []).extend(t))
    session.step()
    assert streamed.get(row) == plain_greedy(tiny.target, LONG, 3)[:1]  # joined and emitted in that same step
    while session.step():
        pass
    session.close()
    assert streamed[row] == plain_greedy(tiny.target, LONG, 3)
    assert [n for r, n in got if r == row][:2] == [6, 21]


def test_checkpoint_at_must_hold_ints(tiny):
    session = _engine(tiny.target).session()
    with pytest.raises(InvalidRequest, match="checkpoint_at"):
        session.submit(RowRequest(LONG, max_tokens=2, checkpoint_at=(3.5,)))


@pytest.mark.parametrize("budget", [0, 9, 64])
def test_short_rows_join_a_decoding_batch_within_a_steps_token_budget(tiny, budget):
    """Short rows (one chunk each) waiting beside a decoding row join within ``join_budget`` new tokens a step,
    the first always (the CPU's default, 0: one a step; a GPU's, a chunk: as many as fit it), each with the
    target's own greedy tokens."""
    engine = SpeculativeEngine(tiny.target, None, prefill_step_size=64, pipeline=True)
    assert engine.join_budget == 0 or mx.default_device().type == mx.DeviceType.gpu
    engine.join_budget = budget
    streamed, joined = {}, []
    session = engine.session()

    def submit(prompt, n):
        return session.submit(RowRequest(prompt, max_tokens=n, stop_at_eos=False),
                              on_tokens=lambda row, tokens: streamed.setdefault(row, []).extend(tokens))

    submit([11, 12, 13], 30)
    for _ in range(3):
        session.step()
    shorts = {submit(prompt, 5): prompt for prompt in ([20, 21, 22, 23, 24], [30, 31, 32, 33], [40, 41, 42, 43, 44])}
    while session.step():
        joined.append(sum(1 for row in shorts if row in streamed))
    session.close()
    # 5 + 4 + 5 new tokens: 0 -> one a step; 9 -> the first two (5 + 4), then the third; 64 -> all three at once
    want = {0: [1, 2, 3], 9: [2, 3], 64: [3]}[budget]
    assert sorted(set(joined))[: len(want)] == want and joined[0] == want[0]
    for row, prompt in shorts.items():
        assert streamed[row] == plain_greedy(tiny.target, prompt, 5)


def test_first_tokens_due_names_rows_one_step_from_their_first_token(tiny):
    """``DecodeSession.first_tokens_due``: a cohort whose next chunk finishes its prefill (its stops included: a
    checkpoint offset ends a chunk early), or a decoding row without a token yet. The server lets such a step run
    before a restore that reads records (``Scheduler._first_tokens_wait``)."""
    engine = _engine(tiny.target, pipeline=False)
    session = engine.session(on_checkpoint=lambda *a: None)
    session.submit(RowRequest([11, 12, 13], max_tokens=30, stop_at_eos=False))
    assert session.first_tokens_due == 0  # waiting, not yet admitted
    session.step()
    assert session.first_tokens_due == 0  # it joined and has its first token
    streamed = {}
    row = session.submit(RowRequest(LONG[:7], max_tokens=3, stop_at_eos=False, checkpoint_at=(3,)),
                         on_tokens=lambda r, t: streamed.setdefault(r, []).extend(t))
    dues = []
    while row not in streamed:
        session.step()
        dues.append(session.first_tokens_due)
    # 6 tokens to forward (the 7th is pending), chunks of 4 ending early at the offset 3: 3, then 3 (due), then joined
    assert dues == [1, 0]
    while session.step():
        pass
    session.close()
    assert streamed[row] == plain_greedy(tiny.target, LONG[:7], 3)


def test_a_cohorts_checkpoint_stops_keep_the_decoding_rows_pipelined(tiny):
    """While a cohort's last chunk is cut into pieces by its checkpoint offsets it does not join at the next step:
    the decoding row's next round stays queued ahead (``_batch_changes`` asks ``joins_next``, which counts the
    stops; counting chunks alone dropped the pipelining for every stop there). Tokens stay the greedy ones."""
    engine = _engine(tiny.target, pipeline=True)
    session = engine.session(on_checkpoint=lambda *a: None)
    streamed: dict = {}

    def on_tokens(row, tokens):
        streamed.setdefault(row, []).extend(tokens)

    first = session.submit(RowRequest([11, 12, 13], max_tokens=30, stop_at_eos=False), on_tokens=on_tokens)
    for _ in range(3):
        session.step()
    prompt = LONG[:9]  # 8 tokens to forward: one chunk of 4, then the stops at 5 and 6 end two short ones
    joiner = session.submit(RowRequest(prompt, max_tokens=3, stop_at_eos=False, checkpoint_at=(5, 6)),
                            on_tokens=on_tokens)
    pipelined = []
    while joiner not in streamed:
        before = session.pipelined_rounds
        session.step()
        pipelined.append(session.pipelined_rounds - before)
    # the step after each chunk that leaves a stop ahead runs the round queued during the one before
    assert pipelined[1:3] == [1, 1], pipelined
    while session.step():
        pass
    session.close()
    assert streamed[first] == plain_greedy(tiny.target, [11, 12, 13], 30)
    assert streamed[joiner] == plain_greedy(tiny.target, prompt, 3)
