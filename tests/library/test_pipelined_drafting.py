"""Pipelined depth-0 rounds of a drafting session (issue 28 item 4): when the depth controller chooses plain
decoding, the next round is queued on the device before the host reads this one, as without a drafter. The
contract is exactness against the synchronous session (``pipeline=False``): the same tokens (the target's own
greedy tokens), the same depths chosen round by round, the same drafts and acceptance, bit-identical checkpoints
(target and drafter part), for every drafter kind, with rows joining, waiting for a place, finishing at EOS or
``max_tokens``, leaving (``finish``, ``cancel``) and checkpointed mid-decode."""

from __future__ import annotations

import pytest

from spec_cache.decode.depth import DepthController
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.rows.sampling import RowSampling
from spec_cache.rows.target import TargetRows
from tests.library.test_pipelined_decode import _assert_same_checkpoints, _draft_arrays, _owned
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401  (fixtures)

DRAFTERS = ["ngram", "draft-model", "draft-model-full", "assistant", "deepspec", "dflash", "qwen-mtp", "dflash2"]


class Switching(DepthController):
    """Depths that depend only on what the engine asks with (no clock): depth 2 when the largest draft cap is a
    multiple of 6, plain decoding otherwise, and the base class's probes (after 4 plain rounds, at depth 1).
    Its choices switch between plain decoding and drafting within a run, the same way in both sessions."""

    def __init__(self) -> None:
        super().__init__(3, probe_every=4, probe_limit=8, probe_budget=None)  # probes by count, not by cost

    def best_depth(self, rows, caps, acceptance=None, remaining=None) -> int:
        limit = min(self.max_depth, max(caps, default=0))
        if acceptance is not None:
            return min(1, limit)  # a probe
        return min(2, limit) if max(caps) % 6 == 0 else 0

    def observe_shadow(self, group, rows) -> None:
        super().observe_shadow(group, rows)
        for row in rows:
            row.shadowed = False  # probes by count for every drafter (shadowed rows get none: spec_cache.decode.depth)


def never_drafts() -> DepthController:
    """A real controller that expects no acceptance and probes with none: every round at depth 0."""
    return DepthController(3, prior_acceptance=0.0, probe_acceptance=0.0)


def session_run(target, provider, pipeline: bool, controller, max_rows=3) -> dict:
    """A session with rows joining, waiting, finishing (EOS, max_tokens), leaving (finish, cancel), checkpointed
    from a callback, and one sampled row. Returns what the owner saw and what the controller chose."""
    eos = plain_greedy(target, PROMPTS[0], 24)[9]
    engine = SpeculativeEngine(target, provider, draft_depth=3, max_rows=max_rows, pipeline=pipeline)
    engine.depth = controller
    engine.join_budget = engine.prefill_step_size  # short rows join as they come, as on a GPU (the CPU: one a step)
    checkpoints, streamed, results = [], {}, {}
    session = engine.session(eos_token_ids=[eos], on_checkpoint=lambda row, tokens, caches, draft: checkpoints.append(
        (row, list(tokens), _owned(caches), _draft_arrays(draft))))
    marks = {}

    def on_tokens(row, tokens):
        before = len(streamed.get(row, []))
        streamed.setdefault(row, []).extend(tokens)
        if row == marks.get("snap") and before < 5 <= len(streamed[row]):
            assert session.checkpoint(row)
        if row == marks.get("stop") and before < 8 <= len(streamed[row]):
            assert session.finish(row)

    def submit(prompt, **options):
        return session.submit(RowRequest(prompt, **options), on_tokens=on_tokens,
                              on_finish=lambda row, result: results.__setitem__(row, result))

    rows = {"eos": submit(PROMPTS[0], max_tokens=24), "short": submit(PROMPTS[1], max_tokens=6)}
    rows["snap"] = marks["snap"] = submit(PROMPTS[2], max_tokens=18, stop_at_eos=False)
    rows["stop"] = marks["stop"] = submit([40, 41, 42, 43, 44], max_tokens=30, stop_at_eos=False)  # waits first
    for step in range(1, 80):
        if not session.step():
            break
        if step == 4:
            rows["late"] = submit([9, 10, 11, 12], max_tokens=14, stop_at_eos=False)
            rows["doomed"] = submit([50, 51, 52], max_tokens=30, stop_at_eos=False)
            rows["sampled"] = submit(PROMPTS[2][:5], max_tokens=10, sampling=RowSampling(0.8, 0.9, 3),
                                     stop_at_eos=False)
        if step == 12 and rows["doomed"] in {r for r in rows.values()}:
            session.cancel(rows["doomed"])
    assert not session.busy
    session.close()
    return {"rows": rows, "eos": eos, "checkpoints": checkpoints, "streamed": streamed,
            "results": {row: (r.tokens, r.reason, r.cancelled, r.drafted, r.accepted) for row, r in results.items()},
            "depths": dict(controller.rounds_at_depth), "probes": controller.probes,
            "pipelined": session.pipelined_rounds}


@pytest.mark.parametrize("name", DRAFTERS)
def test_switching_drafting_session_equals_the_synchronous_session(tiny, name):
    piped = session_run(tiny.target, tiny.provider(name), True, Switching())
    synced = session_run(tiny.target, tiny.provider(name), False, Switching())
    assert piped["results"] == synced["results"] and piped["streamed"] == synced["streamed"]
    assert piped["depths"] == synced["depths"] and piped["probes"] == synced["probes"] > 0
    assert piped["depths"].get(0, 0) > 5 and piped["depths"].get(2, 0) > 0  # it switched both ways
    _assert_same_checkpoints(piped["checkpoints"], synced["checkpoints"])
    assert piped["pipelined"] > 0 and synced["pipelined"] == 0
    rows, results = piped["rows"], piped["results"]
    assert results[rows["eos"]][:2] == (plain_greedy(tiny.target, PROMPTS[0], 24)[:10], "eos")
    assert results[rows["short"]][:2] == (plain_greedy(tiny.target, PROMPTS[1], 6), "length")
    assert results[rows["late"]][:2] == (plain_greedy(tiny.target, [9, 10, 11, 12], 14), "length")
    assert results[rows["snap"]][:2] == (plain_greedy(tiny.target, PROMPTS[2], 18), "length")
    stop = results[rows["stop"]]
    assert stop[1] == "stop" and stop[0] == plain_greedy(tiny.target, [40, 41, 42, 43, 44], 30)[: len(stop[0])]
    assert results[rows["doomed"]][2]  # cancelled
    snapped = [tokens for row, tokens, _, _ in piped["checkpoints"] if row == rows["snap"]]
    assert len(snapped) == 3  # boundary, the mid-decode checkpoint, finish


@pytest.mark.parametrize("name", ["ngram", "draft-model", "assistant", "qwen-mtp"])
def test_plain_rounds_with_a_drafter_equal_the_synchronous_session(tiny, name):
    """Every round at depth 0 (the longest pipelined stretches; the drafter's depth-0 bookkeeping happens only
    as rounds are consumed): same tokens, checkpoints bit for bit, nothing drafted."""
    piped = session_run(tiny.target, tiny.provider(name), True, never_drafts(), max_rows=None)
    synced = session_run(tiny.target, tiny.provider(name), False, never_drafts(), max_rows=None)
    assert piped["results"] == synced["results"] and piped["streamed"] == synced["streamed"]
    _assert_same_checkpoints(piped["checkpoints"], synced["checkpoints"])
    assert set(piped["depths"]) == {0} and all(r[3] == 0 for r in piped["results"].values())
    assert piped["pipelined"] > 5


@pytest.mark.parametrize("name", ["draft-model", "ngram", "deepspec"])
def test_depth_zero_rounds_are_queued_before_the_host_reads_the_last_one(tiny, monkeypatch, name):
    """The order of target forwards (F) and token deliveries (T): with a drafter whose rounds are at depth 0, the
    next round's forward is built before this round's tokens reach the owner, as without a drafter (before
    this change a drafting session ran every round synchronously: F T F T ...)."""
    target = tiny.target

    def run(pipeline):
        order = []
        forward = target.forward

        def counted(ids, caches, **kwargs):
            order.append("F")
            return forward(ids, caches, **kwargs)

        monkeypatch.setattr(target, "forward", counted)
        engine = SpeculativeEngine(target, tiny.provider(name), draft_depth=3, pipeline=pipeline)
        engine.depth = never_drafts()
        session = engine.session()
        session.submit(RowRequest(PROMPTS[0], max_tokens=8), on_tokens=lambda row, tokens: order.append("T"))
        while session.step():
            pass
        session.close()
        monkeypatch.undo()
        return "".join(order), session.pipelined_rounds

    assert run(False) == ("F" + "FT" * 8, 0)
    # rounds 1 and 2 run alone: the controller's plain-round cost is not past its warm-up (two measurements);
    # from round 3 each round's successor is queued while the host reads it; round 8 is the last (max_tokens)
    assert run(True) == ("F" + "FT" * 2 + "FFT" + "FT" * 4 + "T", 5)


def test_a_queued_round_is_discarded_when_the_step_drafts_after_all(tiny, monkeypatch):
    """Asked ahead (before this round's cost is observed) the controller says 0; at the step (after) it says 2:
    the queued round is discarded exactly and the drafting round runs on the KV the synchronous session has."""

    class Flips(DepthController):
        """Drafts at depth 2 after every 5th observed round: the question asked ahead comes one observation
        early, so it answers 0 where the step answers 2."""

        def __init__(self) -> None:
            super().__init__(3, probe_every=100, probe_limit=100)
            self.observed = 0

        def observe_round(self, *args) -> None:
            self.observed += 1
            super().observe_round(*args)

        def best_depth(self, rows, caps, acceptance=None, remaining=None) -> int:
            return min(2, max(caps)) if acceptance is None and self.observed % 5 == 0 else 0

    discarded = []
    discard = TargetRows.discard_last
    monkeypatch.setattr(TargetRows, "discard_last", lambda self, count: (discarded.append(count), discard(self, count)))
    out = {}
    for pipeline in (True, False):
        discarded.clear()
        engine = SpeculativeEngine(tiny.target, tiny.provider("draft-model"), draft_depth=3, pipeline=pipeline)
        engine.depth = Flips()
        calls = []
        results = engine.run([RowRequest(PROMPTS[0], max_tokens=24), RowRequest(PROMPTS[2], max_tokens=20)],
                             on_checkpoint=lambda row, tokens, caches, draft: calls.append(
                                 (row, list(tokens), _owned(caches), _draft_arrays(draft))))
        out[pipeline] = ([(r.tokens, r.drafted, r.accepted) for r in results], calls, len(discarded))
    assert out[True][0] == out[False][0]
    assert [tokens for tokens, _, _ in out[True][0]] == [plain_greedy(tiny.target, PROMPTS[0], 24),
                                                         plain_greedy(tiny.target, PROMPTS[2], 20)]
    assert all(drafted > 0 for _, drafted, _ in out[True][0])
    _assert_same_checkpoints(out[True][1], out[False][1])
    assert out[True][2] >= 2 and out[False][2] == 0  # queued rounds the steps then discarded to draft
