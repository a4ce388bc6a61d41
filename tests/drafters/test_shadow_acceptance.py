"""Shadow acceptance of prompt lookup, and the draft model's bounded backlog (issue 28 item 4).

Shadow: at a round at depth 0 the n-gram rows still propose (microseconds) and the tokens the target then emits
judge each would-be draft as a drafting round would have; the depth controller reads that as the rows' acceptance,
so a turn to copying is seen without a probe. Bounded backlog: the draft model feeds a row's backlog of depth-0
tokens once it reaches ``backlog_cap``, so no draft call (a probe) feeds the whole run since the last one.
Costs are injected (a clock advanced per target forward); tokens must equal plain greedy decoding's.
"""

from __future__ import annotations

import random

import pytest

from spec_cache.decode.depth import DepthController, RowAcceptance
from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.drafters.ngram import MatchIndex, NgramProvider
from spec_cache.rows.protocol import RoundContext
from tests.drafters.test_copy_drafting import billed_engine, copy_prompts
from tests.drafters.test_draft_model_deferred import drive, open_rows, same_checkpoint
from tests.runtime_fixtures import PROMPTS, _identity_memo, plain_greedy, tiny  # noqa: F401

MAX = 24
LOOPS = 48  # the tiny model's greedy answers to these prompts repeat their own lines from their 13th-31st token


def drafting_rounds(prompt, stream, depth):
    """What drafting rounds at ``depth`` would judge over ``stream`` (the tokens the target emits after the
    prompt's last token): per round ``(drafted, agreed)``, for every round whose draft the stream judges whole."""
    index, judged, i = MatchIndex(3, 1, prompt[:-1]), [], 0
    pending = prompt[-1]
    while True:
        proposal = index.propose(pending, depth)
        if i + len(proposal) >= len(stream):
            return judged
        agreed = 0
        while agreed < len(proposal) and proposal[agreed] == stream[i + agreed]:
            agreed += 1
        judged.append((len(proposal), agreed))
        index.extend([pending] + stream[i:i + agreed])  # the round emits its agreed drafts and the target's token
        pending, i = stream[i + agreed], i + agreed + 1


def shadowed(prompt, stream, depth):
    """The same stream decoded plainly (``draft(pending, 0)`` each round) with the rows' shadow collected."""
    rows = NgramProvider().open(None, [None])
    rows.prefill([prompt[:-1]], None)
    rows.shadow(depth)
    judged, pending = [], prompt[-1]
    for token in stream:
        assert rows.draft([pending], 0) == [[]]  # nothing proposed to the engine
        rows.commit([0], RoundContext([[pending]], None, {}))
        judged += rows.shadow(depth)[0]
        pending = token
    return judged


@pytest.mark.parametrize("seed", range(6))
def test_shadow_judges_would_be_drafts_as_drafting_rounds_would(seed):
    rng = random.Random(seed)
    passage = [rng.randrange(2, 9) for _ in range(30)]
    prompt = passage + [1] + passage[:5]
    stream = passage[5:17] + [rng.randrange(2, 9) for _ in range(6)] + passage[3:20]  # copies, a change, copies
    expected = drafting_rounds(prompt, stream, 4)
    assert shadowed(prompt, stream, 4) == expected
    assert sum(agreed for _, agreed in expected) > 10  # a copied run passes whole drafts


def test_the_shadow_forgets_a_would_be_draft_when_drafting_resumes():
    rows = NgramProvider().open(None, [None, None])
    rows.prefill([[5, 6, 7, 8, 5, 6], [1, 2, 3]], None)
    rows.shadow(4)
    rows.draft([7, 4], 0)  # row 0 would draft [8, 5, 6, 7]
    rows.commit([0, 0], RoundContext([[7], [4]], None, {}))
    assert rows.draft([8, 1], 2) == [[5, 6], [2, 3]]  # drafting for real: its own rounds are observed
    rows.commit([2, 0], RoundContext([[8, 5, 6], [1, 2, 3]], None, {}))
    assert rows.shadow(4) == [[], [(0, 0)]]  # row 1 had no match before; row 0's would-be draft is forgotten
    rows.filter_rows([1])
    assert rows.shadow(4) == [[]]


def cost(width: int) -> float:
    """A window of ``width`` tokens costs ``1 + 0.05 (width - 1)`` steps (a GPU's): drafting pays when accepted."""
    return 1.0 + 0.05 * (width - 1)


class NeverDrafts(DepthController):
    """Plain decoding unless acceptance was observed: no prior acceptance, no probes (what is left is the
    shadow), every width's cost known from the start (4 rows)."""

    def __init__(self) -> None:
        super().__init__(4, prior_acceptance=0.0, probe_every=10_000, probe_limit=10_000)
        self.shadowed = 0
        for width in range(1, 6):
            for _ in range(2):
                self.observe_round(4, width - 1, 0.0, width, cost(width))

    def observe_shadow(self, group, rows) -> None:
        before = [row.asked for row in rows]
        super().observe_shadow(group, rows)
        self.shadowed += sum(row.asked > b for row, b in zip(rows, before))


def run(tiny, monkeypatch, name, prompts, controller, pipeline=True):  # noqa: F811
    engine = billed_engine(tiny, monkeypatch, name, cost, draft_depth=4, pipeline=pipeline)
    engine.depth = controller
    results = engine.run([RowRequest(p, max_tokens=LOOPS, stop_at_eos=False) for p in prompts])
    monkeypatch.undo()
    for prompt, result in zip(prompts, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, LOOPS)
    return results


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_turn_to_copying_is_drafted_without_a_probe(tiny, monkeypatch, pipeline):  # noqa: F811
    prompts = copy_prompts(4)
    controller = NeverDrafts()
    results = run(tiny, monkeypatch, "ngram", prompts, controller, pipeline)
    # judged while plain, then drafted for real: before shadows the rows were never drafted (no prior, no probe)
    assert controller.shadowed > 0 and controller.probes == 0
    assert sum(r.accepted for r in results) > 0 and max(controller.rounds_at_depth) >= 2
    # a drafter that proposes through its own forwards is not shadowed: it stays plain here
    model = NeverDrafts()
    results = run(tiny, monkeypatch, "draft-model-full", prompts, model, pipeline)
    assert model.shadowed == 0 and sum(r.drafted for r in results) == 0


def test_a_bounded_backlog_feeds_at_its_cap_and_keeps_drafts_and_checkpoints(tiny):  # noqa: F811
    provider = tiny.provider("draft-model")
    capped, unbounded = open_rows(tiny, provider), open_rows(tiny, provider)
    capped.backlog_cap, unbounded.backlog_cap = 3, None
    schedule = [1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 1]
    longest = []
    for group in (capped, unbounded):
        drive(group, schedule[:8], eager=False)
        longest.append(max(map(len, group._backlog)))
    assert longest[0] < 3 <= longest[1]  # the capped rows fed their backlog at the cap, the others kept it
    pending = [p[-1] for p in PROMPTS]
    assert capped.draft(pending, 3) == unbounded.draft(pending, 3)  # the same draft KV: the same drafts
    for group in (capped, unbounded):
        group.commit([1, 0, 3], RoundContext([[p] + [0] * 3 for p in pending], None, {}))
        drive(group, schedule[8:], eager=False)
    assert capped.processed == unbounded.processed
    for row in range(len(PROMPTS)):
        same_checkpoint(capped.capture(row), unbounded.capture(row))


def test_the_engine_with_a_capped_backlog_keeps_plain_greedy_tokens(tiny, monkeypatch):  # noqa: F811
    from spec_cache.drafters.draft_model import DraftModelRows

    monkeypatch.setattr(DraftModelRows, "backlog_cap", 2)
    prompts = [list(p) for p in PROMPTS]
    controller = DepthController(4, probe_every=5, probe_limit=5, probe_budget=None)  # probes every 5 rounds
    engine = SpeculativeEngine(tiny.target, tiny.provider("draft-model"), draft_depth=4, max_rows=2)
    engine.depth = controller
    results = engine.run([RowRequest(p, max_tokens=MAX, stop_at_eos=False) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.tokens == plain_greedy(tiny.target, prompt, MAX)
    assert controller.rounds_at_depth[0] > 0 and sum(r.drafted for r in results) > 0


def test_shadowed_rows_are_never_probed(tiny, monkeypatch):  # noqa: F811
    def probes(shadowed: bool) -> int:
        controller = DepthController(4)
        for width in (1, 2):
            for _ in range(2):
                controller.observe_round(2, width - 1, 0.0, width, float(width))  # a CPU: drafting never pays
        rows = [RowAcceptance(shadowed=shadowed) for _ in range(2)]
        for _ in range(200):
            if controller.choose(rows, [50, 50]) == 0:
                controller.observe_round(2, 0, 0.0, 1, 1.0)
            for row in rows:
                controller.observe_row(row, 2, 0)  # rejected (as a shadow reports it, or a probe would)
        return controller.probes

    assert probes(False) > 0 and probes(True) == 0


def test_plain_rounds_of_shadowed_rows_stay_pipelined():
    """No probe is due for shadowed rows, so every plain round may queue the next one (before: from the 16th plain
    round on, a probe was 'due' forever and no round was pipelined: adaptive ngram at B=8 read 0.90x plain while
    never drafting)."""
    controller = DepthController(4)
    rows = [RowAcceptance(shadowed=True) for _ in range(2)]
    predicted = []
    for _ in range(100):
        depth = controller.choose(rows, [50, 50])
        controller.observe_round(2, depth, 0.0, depth + 1, float(depth + 1))  # a CPU: drafting never pays
        for row in rows:
            controller.observe_row(row, 2, 0)
        predicted.append(controller.predicts_plain(2))
    assert all(predicted[10:]), predicted.index(False, 10)
