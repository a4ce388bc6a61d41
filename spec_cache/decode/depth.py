"""Adaptive draft depth: draft only as deep as it pays, so drafting never makes decoding slower.

Why: verifying ``depth + 1`` tokens costs up to ``depth + 1`` decode steps where decoding is compute-bound (MLX's
CPU backend), so a drafter whose proposals are rarely accepted loses to plain decoding (SmolLM2-135M on CPU: plain
5.3 tok/s, ngram at depth 4 1.8 tok/s). The depth only changes how many tokens each target forward may accept,
never which tokens come out, so the engine may pick it freely every round.

Why one file of ~430 lines: the acceptance model (``RowAcceptance``), the cost table (``CostTable``) and the
controller that weighs one against the other (``DepthController``) change together; each rule below (staleness,
probe pricing, per-position acceptance) touches two of them.

Model (one round, batch-wide: the target verifies one window width for every row):

* each row's drafts are accepted token by token with probability ``a`` (geometric), and the row offers a
  proposal at all with probability ``p`` (an ngram row finds no match): both are decayed counts
  (:class:`RowAcceptance`), starting from a prior;
* a round at depth ``D`` costs ``draft(D) + verify(D + 1)`` seconds (``verify(1)`` when no row offers a draft),
  running estimates per batch size and width measured on the rounds the engine actually runs
  (:class:`CostTable`; an unmeasured width is interpolated, or extrapolated from the measured slope);
* expected tokens of a row: ``1 + p * (a + a^2 + ... + a^min(D, cap))``;
* the depth is the ``D`` in ``0..max_depth`` with the most expected tokens per second over all rows (drafting
  must beat plain decoding by ``min_gain``, 5%: the cost estimates are noisy on a shared CPU). Rows do not
  get depths of their own: once the window width is paid, every row's drafts up to it are verified for free.
  When no request waits for a place, the rate is the batch's remaining tokens over the expected seconds until
  its *last* row finishes (rows leave as they finish): a fast row finishing early frees nothing, so drafting
  must pay on the rows that set the length of the run (measured: ngram on SmolLM2 float32, per-round rate
  +7% predicted, -4% real, the low-acceptance row setting the run's length).

Shadow acceptance: a drafter that proposes for free (prompt lookup) has its would-be drafts judged at depth-0
rounds by the tokens that come (:meth:`DepthController.observe_shadow`); those rows are never probed.

Probing: while plain decoding wins, rows' acceptance is not observed (unless shadowed). Every ``probe_every`` rounds
at depth 0 (doubling after each probe, up to ``probe_limit``; reset when drafting wins on its own and some row
accepted a draft in that stretch; a stretch that accepted nothing counts as a probe: ``_end_stretch``) one round drafts
at the depth that would win if every row's acceptance were ``probe_acceptance``; when even that cannot beat plain
decoding at the measured costs (a compute-bound CPU), it probes at depth 1 (_STALE: the width-2 estimate is only
ever re-measured by drafting; two unlucky width-2 rounds on a loaded CPU, against plain rounds timed while the next
one is queued, kept the copy workload at depth 0 for 93 of 95 rounds, 4 tokens drafted, while fixed depth ran
1.24-1.26x plain, with and without the two-measurement rule below). Its price where drafting never pays is one
width-2 round per probe interval (16, 32, 64, then every 128 plain rounds), and a probe waits longer when its extra
seconds over a plain round would exceed ``probe_budget`` (4%, less for rows that accepted little: see
``_probe_due``) of the plain rounds since the last one (on a compute-bound CPU a width-4 probe at B=8 costs ~1.5
extra plain rounds; the draft model also feeds its backlog). The two work together: the seed's per-position early
stop (``sts.thresholds``/``minConf``, DFlash/DSpark, ``spec_cache.drafters.projected``) cuts a drafted block where
the drafter's own confidence drops; this controller picks the depth for the whole batch from measured acceptance and
measured cost.

Depth-0 rounds cost what plain decoding costs: the engine runs them pipelined (``DecodeSession``: the next
round is queued before the host reads this one when :meth:`DepthController.predicts_plain`, and discarded if
the next step chooses to draft after all); a plain round's cost is what it takes the host while the next one
is in flight (building its forward, waiting for its tokens). The draft model defers its
depth-0 tokens to one batched feed when drafting resumes; drafters that need the target's taps at every token
(the projected ones, the MTP head) still grow their context each round, lazily, beside the next round.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from spec_cache.errors import InvalidRequest

__all__ = ["RowAcceptance", "CostTable", "DepthController"]


@dataclass
class RowAcceptance:
    """One row's drafting record as decayed counts: ``hits`` accepted draft tokens, ``trials`` draft positions the
    target judged (the accepted ones plus the first rejected), ``offered`` rounds it proposed something in,
    ``asked`` rounds it was asked to propose."""

    hits: float = 0.0
    trials: float = 0.0
    offered: float = 0.0
    asked: float = 0.0
    #: per draft position: decayed rounds that reached it (the target judged it) and that it passed (accepted)
    reached: list = field(default_factory=list)
    passed: list = field(default_factory=list)
    #: its drafter's would-be drafts are judged at depth-0 rounds (``DepthController.observe_shadow``): its
    #: acceptance is known without a probe
    shadowed: bool = False

    def observe(self, drafted: int, agreed: int, decay: float) -> None:
        """One round at depth > 0: ``drafted`` tokens proposed (after the engine's cap), ``agreed`` accepted."""
        if drafted < 0 or not 0 <= agreed <= drafted:
            raise ValueError(f"need 0 <= agreed <= drafted, got agreed={agreed}, drafted={drafted}")
        self.asked = decay * self.asked + 1.0
        self.offered = decay * self.offered + (1.0 if drafted else 0.0)
        if drafted:
            self.hits = decay * self.hits + agreed
            self.trials = decay * self.trials + agreed + (1 if agreed < drafted else 0)
            judged = min(agreed + 1, drafted)
            while len(self.reached) < judged:
                self.reached.append(0.0)
                self.passed.append(0.0)
            for i in range(len(self.reached)):
                self.reached[i] = decay * self.reached[i] + (1.0 if i < judged else 0.0)
                self.passed[i] = decay * self.passed[i] + (1.0 if i < agreed else 0.0)

    def acceptance(self, prior: float, weight: float) -> float:
        """Per-token acceptance probability (the geometric model's ``a``), shrunk towards ``prior``."""
        return (self.hits + prior * weight) / (self.trials + weight)

    def positions(self, depth: int, prior: float, weight: float) -> list[float]:
        """Acceptance at each draft position ``0..depth-1`` given the ones before it passed, each shrunk towards
        the row's geometric :meth:`acceptance`. Why: prompt lookup's acceptance is bimodal (a copied run passes
        every position, a one-token match fails at the first), so one geometric rate under-rates deep drafts
        where the first position is the hard one (the copy workload at B=4: adaptive settled at depths 1-2,
        0.89x of fixed depth 4)."""
        base = self.acceptance(prior, weight)
        return [(self.passed[i] + base * weight) / (self.reached[i] + weight) if i < len(self.reached) else base
                for i in range(depth)]

    def availability(self, weight: float = 1.0) -> float:
        """Probability that the row offers a draft at all (prior: it does)."""
        return (self.offered + weight) / (self.asked + weight)


class _WidthCosts:
    """Running seconds per key (window width, or draft depth) for one batch size.

    A key's first measurement is a warm-up (a new window shape compiles kernels and allocates buffers: on a GPU
    the first width-2 round costs many plain rounds): it is used only while no key has two measurements, and the
    second measurement replaces it when lower. Trusting it froze adaptive depth at 0 for good (issue 28: the
    controller extrapolated the spike to every deeper width, so not even a probe could pay). A spike can land on
    the second measurement too (on a loaded machine, most likely what kept a copy run at depth 0 for 92 of 95
    rounds while fixed depth ran 1.2x faster; the old rule then never drafted nor probed again, see
    tests/drafters/test_copy_drafting.py), so the estimate keeps the lower of the first two, and later
    measurements move it through the moving average at most ``smoothing`` times its value upwards (a measurement
    counts up to twice the estimate): one outlier can no longer stop drafting, while a real rise is still followed
    within a few rounds.

    Staleness (``stale_after`` observations of this batch size without one of the key): a key is only ever
    re-measured by choosing it, so an estimate that a few bad rounds pushed up would lock its depth out for good
    (drafting at depth 5 for the rest of a run because width 7 once cost 40x; or never re-measuring plain rounds
    while drafting). A stale key is left out of the estimates while fresh ones exist (it is interpolated or
    extrapolated from them, as an unmeasured key is), so the controller tries it again when the fresh costs say
    it pays; its next measurement counts as a second one (the lower of the old estimate and the new).

    From the third measurement on, the estimate is the median of the latest ``window`` (5, the trusted estimate
    among them while they are few). Why: pipelined plain rounds are timed unevenly (the round before a probe only
    waits for a forward already in flight: 29-40 ms against 120-146 ms; the round after a drafting round also
    builds its own: 190-280 ms), and a moving average let that pair swing the plain estimate by -23% and +30% right
    where the controller decides whether to draft."""

    def __init__(self, smoothing: float, prior_slope: float, stale_after: int = 64) -> None:
        self.seconds: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # key -> the observation (``ticks``) that last measured it
        self.recent: dict[int, list[float]] = {}  # key -> its estimate, then its latest measurements
        self.window = 5
        self.ticks = 0
        self.smoothing = smoothing
        self.prior_slope = prior_slope
        self.stale_after = stale_after

    def _stale(self, key: int) -> bool:
        return self.ticks - self.seen[key] > self.stale_after

    def observe(self, key: int, seconds: float) -> None:
        old, count = self.seconds.get(key), self.counts.get(key, 0)
        self.ticks += 1
        if count == 0:
            self.seconds[key] = seconds
        elif count == 1 or self._stale(key):
            self.seconds[key] = min(old, seconds)  # of a warm-up and one more, the lower (a spike is never low)
            self.recent[key] = [self.seconds[key]]
        else:
            window = self.recent.setdefault(key, [old])
            window.append(seconds)
            del window[:-self.window]
            if len(window) >= 3:  # the median of the latest: one odd round moves nothing (see the class doc)
                self.seconds[key] = statistics.median(window)
            else:
                self.seconds[key] = old + self.smoothing * (min(seconds, 2.0 * old) - old)
        self.counts[key] = count + 1
        self.seen[key] = self.ticks

    def _known(self) -> dict[int, float]:
        trusted = {k: v for k, v in self.seconds.items() if self.counts[k] >= 2}
        fresh = {k: v for k, v in trusted.items() if not self._stale(k)}
        return fresh or trusted or self.seconds

    def estimate(self, key: int) -> float:
        known = self._known()
        if key in known:
            return known[key]
        below = sorted(k for k in known if k < key)
        above = sorted(k for k in known if k > key)
        if below and above:
            k0, k1 = below[-1], above[0]
            c0, c1 = known[k0], known[k1]
            return c0 + (c1 - c0) * (key - k0) / (k1 - k0)
        if below:
            k1 = below[-1]
            if len(below) >= 2:
                k0 = below[-2]
                slope = max(0.0, (known[k1] - known[k0]) / (k1 - k0))
            else:
                slope = self.prior_slope * known[k1] / max(k1, 1)
            return known[k1] + slope * (key - k1)
        k1 = above[0]  # only larger keys measured: assume cost proportional to the key below them
        return known[k1] * max(key, 0) / k1


class CostTable:
    """Running estimates of seconds per key, kept per batch size (rows join and leave); a batch size not measured
    yet borrows the nearest measured one's table as it is (decoding a few rows is bound by reading the weights).

    ``smoothing``: weight of a new measurement (exponential moving average). ``prior_slope``: with one key measured,
    an unmeasured larger key costs ``cost * (1 + prior_slope * (key - k) / k)`` (verify: 0.25, between a GPU's
    flat cost and a compute-bound CPU's proportional one; draft: 0, i.e. optimistic, measured on first use)."""

    def __init__(self, smoothing: float = 0.3, prior_slope: float = 0.25) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise InvalidRequest(f"smoothing must be in (0, 1], got {smoothing}")
        if prior_slope < 0.0:
            raise InvalidRequest(f"prior_slope must be >= 0, got {prior_slope}")
        self.smoothing, self.prior_slope = smoothing, prior_slope
        self.by_rows: dict[int, _WidthCosts] = {}
        self._memo: dict[tuple[int, int], float | None] = {}  # estimates since the last observation

    def observe(self, rows: int, key: int, seconds: float) -> None:
        if rows < 1 or key < 0 or not seconds >= 0.0:
            raise ValueError(f"need rows >= 1, key >= 0, seconds >= 0; got {rows}, {key}, {seconds}")
        self.by_rows.setdefault(rows, _WidthCosts(self.smoothing, self.prior_slope)).observe(key, seconds)
        self._memo.clear()

    def estimate(self, rows: int, key: int) -> float | None:
        """Estimated seconds, or None when nothing at all was measured (memoized until the next observation: a
        choice asks for the same few keys dozens of times)."""
        memo = self._memo.get((rows, key), self)
        if memo is not self:
            return memo  # type: ignore[return-value]
        table = self.table(rows)
        value = None if table is None else table.estimate(key)
        self._memo[(rows, key)] = value
        return value

    def table(self, rows: int) -> "_WidthCosts | None":
        """The measurements an estimate for ``rows`` rows reads (this batch size's, else the nearest one's)."""
        if rows in self.by_rows or not self.by_rows:
            return self.by_rows.get(rows)
        return self.by_rows[min(self.by_rows, key=lambda measured: (abs(measured - rows), measured))]


def expected_accepted(acceptance, depth: int) -> float:
    """``a + a^2 + ... + a^depth``: expected accepted drafts of ``depth`` under per-token acceptance ``a``; or, for
    a sequence of per-position acceptances, ``a0 + a0*a1 + ...`` up to ``depth``."""
    total, term = 0.0, 1.0
    for i in range(max(depth, 0)):
        if isinstance(acceptance, (int, float)):
            term *= acceptance
        elif i < len(acceptance):
            term *= acceptance[i]
        else:
            break
        total += term
    return total


def _accepted_any(rows: Sequence[RowAcceptance]) -> bool:
    """Whether some row has a draft accepted on record (its first draft position passed at least once)."""
    return any(row.passed and row.passed[0] > 0.0 for row in rows)


class DepthController:
    """Chooses each round's draft depth (0..``max_depth``) from the rows' acceptance and the measured costs.

    The engine calls :meth:`choose` before drafting, then :meth:`observe_round` with what the round cost and,
    per row, :meth:`RowAcceptance.observe` via :meth:`observe_row`. Deterministic given its inputs (tests feed
    costs directly or through the engine's injectable clock). ``rounds_at_depth`` counts the chosen depths.
    """

    def __init__(self, max_depth: int, *, decay: float = 0.9, prior_acceptance: float = 0.5,
                 prior_weight: float = 2.0, prior_slope: float = 0.25, probe_every: int = 16,
                 probe_limit: int = 128, probe_acceptance: float = 0.8, min_gain: float = 0.05,
                 probe_budget: float | None = 0.04) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
            raise InvalidRequest(f"max_depth must be an int >= 0, got {max_depth!r}")
        for name, value in (("decay", decay), ("prior_acceptance", prior_acceptance),
                            ("probe_acceptance", probe_acceptance)):
            if not 0.0 <= value <= 1.0:
                raise InvalidRequest(f"{name} must be in [0, 1], got {value}")
        if probe_budget is not None and not 0.0 < probe_budget <= 1.0:
            raise InvalidRequest(f"probe_budget must be in (0, 1], got {probe_budget}")
        if not 0.0 <= min_gain < 1.0:
            raise InvalidRequest(f"min_gain must be in [0, 1), got {min_gain}")
        if prior_weight <= 0.0:
            raise InvalidRequest(f"prior_weight must be > 0, got {prior_weight}")
        if not 1 <= probe_every <= probe_limit:
            raise InvalidRequest(f"need 1 <= probe_every <= probe_limit, got {probe_every}, {probe_limit}")
        self.max_depth = max_depth
        self.min_gain = min_gain
        self.decay, self.prior_acceptance, self.prior_weight = decay, prior_acceptance, prior_weight
        self.probe_every, self.probe_limit, self.probe_acceptance = probe_every, probe_limit, probe_acceptance
        self.probe_budget = probe_budget
        self.verify_costs = CostTable(prior_slope=prior_slope)  # key: window width
        self.draft_costs = CostTable(prior_slope=0.0)  # key: requested depth
        self.rounds_at_depth: Counter = Counter()
        self.probes = 0
        self._plain_rounds = 0  # rounds at depth 0 since the last drafting round
        self._probe_interval = probe_every
        self._probe_at = probe_every  # plain rounds after which the next probe runs (interval, or its cost's due)
        self.last_depth: int | None = None  # what :meth:`choose` returned last
        self._shadowed = False  # the last plain choice's rows were all shadowed (no probe is ever due for them)
        self._warm_up: tuple | None = None  # (rows, depth, width) of the last round if it measured a new width
        self._stretch = False  # the rounds since the last plain one drafted because drafting was expected to pay
        self._stretch_hits = False  # a row of that stretch has a draft accepted on record (``_end_stretch``)
        #: per batch size: seconds per plain round that a drafter's next draft call pays for them (its draft call
        #: after n plain rounds over n + 1: an upper bound, the call's own draft included; 0 for prompt lookup)
        self._upkeep: dict[int, float] = {}
        self._after_plain: int | None = None  # plain rounds before the round just chosen, if it is the first to draft

    # -- the decision --------------------------------------------------------------------------------------
    def _row_model(self, row: RowAcceptance, acceptance: float | None) -> tuple:
        """``(acceptance, offers)``: per-position acceptances (or one rate: a probe's), and availability."""
        if acceptance is not None:
            return acceptance, 1.0
        return row.positions(self.max_depth, self.prior_acceptance, self.prior_weight), row.availability()

    def _round_seconds(self, models: Sequence[tuple[float, float]], caps: Sequence[int], depth: int) -> float:
        """Expected seconds of one round at ``depth`` for these rows (width 1 when none of them offers a draft)."""
        batch = len(models)
        plain = self.verify_costs.estimate(batch, 1)
        none_offers = 1.0
        for (_, offers), cap in zip(models, caps):
            if min(depth, cap) > 0:
                none_offers *= 1.0 - offers
        verify = plain if depth == 0 else (
            (1.0 - none_offers) * self.verify_costs.estimate(batch, depth + 1) + none_offers * plain)
        return max(verify + (self.draft_costs.estimate(batch, depth) or 0.0), 1e-12)

    def expected_rate(self, rows: Sequence[RowAcceptance], caps: Sequence[int], depth: int,
                      acceptance: float | None = None, remaining: Sequence[int] | None = None) -> float | None:
        """Expected tokens per second at ``depth`` (None: no cost measured yet).

        ``remaining`` (tokens each row still has to generate, when no other request waits for a place): the
        batch's tokens over the seconds until its last row is done, rows leaving as they finish (a row that
        finishes early shortens nothing when the slowest row sets the length of the run). None: tokens per
        second of one round. ``acceptance`` overrides every row's (every row offers a draft): a probe's
        optimistic case."""
        if self.verify_costs.estimate(len(rows), 1) is None:
            return None
        models = [self._row_model(row, acceptance) for row in rows]
        gains = [1.0 + (offers * expected_accepted(a, min(depth, cap)) if min(depth, cap) > 0 else 0.0)
                 for (a, offers), cap in zip(models, caps)]
        if remaining is None:
            return sum(gains) / self._round_seconds(models, caps, depth)
        left = [max(int(n), 1) for n in remaining]
        rounds = [n / gain for n, gain in zip(left, gains)]
        order = sorted(range(len(rows)), key=rounds.__getitem__)
        seconds, done = 0.0, 0.0
        for k, i in enumerate(order):
            live = order[k:]
            seconds += (rounds[i] - done) * self._round_seconds([models[j] for j in live], [caps[j] for j in live],
                                                                depth)
            done = rounds[i]
        return sum(left) / max(seconds, 1e-12)

    def best_depth(self, rows: Sequence[RowAcceptance], caps: Sequence[int], acceptance: float | None = None,
                   remaining: Sequence[int] | None = None) -> int:
        """The depth with the most expected tokens per second (ties: the shallower); drafting must beat plain
        decoding by ``min_gain`` (a predicted gain within the noise of the measured costs is a likely loss)."""
        limit = min(self.max_depth, max(caps, default=0))
        plain = self.expected_rate(rows, caps, 0, acceptance, remaining)
        if plain is None:
            return limit  # nothing measured yet: the engine's first rounds are plain anyway
        best, best_rate = 0, plain * (1.0 + self.min_gain)
        for depth in range(1, limit + 1):
            rate = self.expected_rate(rows, caps, depth, acceptance, remaining)
            if rate > best_rate * (1.0 + 1e-9):
                best, best_rate = depth, rate
        if best > 0 and acceptance is None and self._re_measure(len(rows), best):
            # the last round measured a new width dearer than its estimate (which leaves that warm-up out): run
            # its depth once more before exploring another new width on the same optimistic extrapolation (else:
            # d1, d2, d1 before learning that width 2 does not pay; one round more than needed)
            best = max(1, min(self._warm_up[1], limit))
        return best

    def choose(self, rows: Sequence[RowAcceptance], caps: Sequence[int],
               remaining: Sequence[int] | None = None) -> int:
        """This round's batch draft depth (a probe now and then while plain decoding wins); ``remaining``: see
        :meth:`expected_rate`."""
        if len(rows) != len(caps) or (remaining is not None and len(remaining) != len(rows)):
            raise ValueError(f"{len(rows)} rows but {len(caps)} caps / remaining counts")
        table = self.verify_costs.by_rows.get(len(rows))
        # this batch size's plain cost was measured once, by the round just run: a warm-up (at B=4 the first-token
        # round, the first forward after admission, read 193 ms against 120 ms steady, and every width looked
        # nearly free against it: four exploring rounds before the second plain one corrected it). Measure plain
        # once more first (no probe either).
        warm_up = table is not None and table.counts.get(1, 0) == 1 and table.seen[1] == table.ticks
        plain_before = self._plain_rounds
        depth = 0 if warm_up else self.best_depth(rows, caps, remaining=remaining)
        if depth > 0:
            self._stretch_hits = self._stretch and self._stretch_hits or _accepted_any(rows)
            self._stretch = True  # drafting wins on its own (or a stretch of such rounds goes on)
            self._plain_rounds = 0
        else:
            if self._stretch:  # the stretch ended: was it drafting that paid, or an exploration that found nothing?
                self._end_stretch(rows)
            self._plain_rounds += 1
            self._shadowed = bool(rows) and all(row.shadowed for row in rows)
            if not warm_up and self._plain_rounds >= self._probe_at and not self._shadowed:
                deepest = self.best_depth(rows, caps, acceptance=self.probe_acceptance, remaining=remaining)
                if deepest == 0 and max(caps, default=0) > 0 and self.max_depth > 0:
                    deepest = 1  # re-measure the narrowest window: its estimate may be stale (see _STALE)
                depth, due = 0, 0
                for option in range(deepest, 0, -1):  # as deep as its cost allows by now (_probe_due)
                    due = self._probe_due(rows, caps, option)
                    if self._plain_rounds >= due:
                        depth = option
                        break
                if deepest and not depth:
                    self._probe_at = due  # not yet: even a depth-1 probe would cost more than its share
                else:
                    self._plain_rounds = 0
                    self._probe_interval = min(2 * self._probe_interval, self.probe_limit)
                    self._probe_at = self._probe_interval
                    self.probes += 1 if depth > 0 else 0
        # the first drafting round after plain ones: its draft call's seconds price the upkeep (``_upkeep``)
        self._after_plain = plain_before if depth > 0 and self.last_depth in (0, None) else None
        self.rounds_at_depth[depth] += 1
        self.last_depth = depth
        return depth

    def _end_stretch(self, rows: Sequence[RowAcceptance]) -> None:
        """A stretch of drafting rounds (chosen because drafting was expected to pay) ended. Where some row of the
        stretch or of this batch has a draft accepted on record (its first draft position ever passed: a decayed
        count above 0), probing starts over (every ``probe_every`` plain rounds: acceptance may come back); where
        none has, the stretch was an exploration that found nothing (a drafter without a record tried at the prior
        acceptance) and counts as a probe: the interval doubles. Why (issue 39): the schedule started over after
        such an exploration, so a draft model that accepts nothing (SmolLM2's first 4 layers) was probed again after
        16 and 32 plain rounds, each probe a width-2 verify plus a draft call that feeds the rows' backlog (1.5-2.4
        plain rounds on the CPU): 2-4% of a 96-token run, most of the draft model's loss."""
        self._stretch = False
        if self._stretch_hits or _accepted_any(rows):
            self._probe_interval = self.probe_every
        else:
            self._probe_interval = min(2 * self._probe_interval, self.probe_limit)
        self._probe_at = self._probe_interval

    def _re_measure(self, rows: int, depth: int) -> bool:
        """Whether the last round's new width (``_warm_up``) must be measured again before ``depth`` is tried:
        ``depth``'s width is not trusted either, and the warm-up read dearer than the estimate (a warm-up reading
        cheap bounds the cost from above: nothing to re-measure)."""
        warm = self._warm_up
        if warm is None or warm[0] != rows:
            return False
        table = self.verify_costs.by_rows[rows]
        width = warm[2]
        if table.counts.get(depth + 1, 0) >= 2 or table.counts.get(width, 0) != 1:
            return False
        return table.seconds[width] > (self.verify_costs.estimate(rows, width) or 0.0)

    def _probe_due(self, rows: Sequence[RowAcceptance], caps: Sequence[int], depth: int) -> int:
        """Plain rounds after which a probe at ``depth`` costs at most its share of the time spent: its extra
        seconds over a plain round (every row drafting) over the share of a plain round, ``probe_budget`` scaled
        by ``0.25 + `` the rows' mean expected acceptance (up to 1): a probe is worth more where the rows accepted
        well and only the costs are in doubt (a copy run frozen at depth 0) than where they rejected (a drafter
        that accepts nothing). On a compute-bound CPU a width-4 probe at B=8 costs ~1.5 extra plain rounds, the
        draft model's a width-2 one ~2 with its backlog feed: measured, such probes and the first exploring rounds
        were the whole 6-10% loss of adaptive drafting on chat at B=8, which stayed at depth 0 otherwise. On a
        GPU, where a window costs about one step, the interval decides."""
        if depth == 0 or self.probe_budget is None:  # None: the interval alone decides
            return 0
        models = [self._row_model(row, None) for row in rows]
        plain = self._round_seconds(models, caps, 0)
        probe = self._round_seconds([(self.probe_acceptance, 1.0)] * len(rows), caps, depth)
        # its draft call costs at least the dearest one measured (the draft model feeds its whole backlog then;
        # a single measurement counts here, though the estimates leave it out as a warm-up)
        drafts = self.draft_costs.table(len(rows))
        if drafts is not None and drafts.seconds:
            probe += max(0.0, max(drafts.seconds.values()) - (self.draft_costs.estimate(len(rows), depth) or 0.0))
        # its window was seen to cost more than the estimate once (a warm-up, left out of the estimates): where that
        # reading is within what a compute-bound verify costs (width x a plain round; more is a spike, a kernel
        # compile), the probe costs at least that (issue 39: the draft model's width-2 exploration read 1.95-2.4x
        # plain at B=8 on the CPU, priced at 1.25x from the prior slope, so the next probe came twice as soon)
        probe += self._warm_up_excess(len(rows), depth + 1)
        first = [expected_accepted(a, 1) * offers for a, offers in models]  # first-position acceptance
        worth = min(1.0, 0.25 + sum(first) / max(len(first), 1))
        due = math.ceil(max(probe - plain, 0.0) / (self.probe_budget * worth * plain))
        upkeep = self._upkeep.get(len(rows), 0.0)
        if upkeep <= 0.0:
            return due
        # the drafter's upkeep: its draft call after n plain rounds also feeds what those rounds deferred (the draft
        # model's backlog), ~``upkeep`` seconds per plain round, so a probe after n rounds costs n * upkeep more and
        # its share must cover that too; where the upkeep alone exceeds the share, the probe waits until
        # ``4 * probe_limit`` plain rounds (a bound: acceptance may still turn)
        share = self.probe_budget * worth * plain - upkeep
        ceiling = 4 * self.probe_limit
        return max(due, ceiling if share <= 0.0 else min(math.ceil(max(probe - plain, 0.0) / share), ceiling))

    def _warm_up_excess(self, rows: int, width: int) -> float:
        """Seconds by which ``width``'s single measurement (a warm-up) exceeds its estimate, where that measurement
        is at most ``width`` plain rounds (a plausible verify, not a spike); else 0."""
        table = self.verify_costs.by_rows.get(rows)
        if table is None or table.counts.get(width, 0) != 1 or table.counts.get(1, 0) < 2:
            return 0.0
        seen, estimate = table.seconds[width], self.verify_costs.estimate(rows, width) or 0.0
        if seen > width * (self.verify_costs.estimate(rows, 1) or 0.0):
            return 0.0
        return max(0.0, seen - estimate)

    def predicts_plain(self, rows: int) -> bool:
        """Whether the next round of ``rows`` rows will most likely choose depth 0 too (the engine then queues it
        before reading this round; a wrong guess costs one discarded forward, never a token): the last choice
        was 0, no probe is due, and plain rounds of this batch size (or the nearest measured) are past their
        warm-up (the second measurement replaces the first and may change the answer). O(1), unlike
        :meth:`choose`."""
        table = self.verify_costs.table(rows)
        return (self.last_depth == 0 and (self._shadowed or self._plain_rounds + 1 < self._probe_at)
                and table is not None and table.counts.get(1, 0) >= 2)

    # -- what a round cost and accepted ---------------------------------------------------------------------
    def observe_round(self, rows: int, depth: int, draft_seconds: float, width: int, verify_seconds: float) -> None:
        """Record a round of ``rows`` rows: the draft call at ``depth`` and the verify (+ commit) at ``width``."""
        self.draft_costs.observe(rows, depth, draft_seconds)
        self.verify_costs.observe(rows, width, verify_seconds)
        if depth > 0 and self._after_plain is not None:  # upper bound of the upkeep per plain round (_probe_due)
            self._upkeep[rows] = draft_seconds / (self._after_plain + 1)
        self._after_plain = None
        first = width > 1 and self.verify_costs.by_rows[rows].counts[width] == 1
        self._warm_up = (rows, depth, width) if first else None

    def observe_row(self, row: RowAcceptance, drafted: int, agreed: int) -> None:
        row.observe(drafted, agreed, self.decay)

    def observe_shadow(self, group, rows: Sequence[RowAcceptance]) -> None:
        """After a round at depth 0: score what a free drafter would have drafted (``group.shadow(max_depth)``:
        per row, ``(drafted, agreed)`` of its would-be drafts judged since the last call) as if it had drafted.
        Why: prompt lookup proposes in microseconds, so its acceptance need not wait for a probe (16-128 plain
        rounds, each a verify of ``depth + 1`` tokens for every row): a turn to copying is seen at once, and a
        drafter that would be rejected is known to be without paying for a probe. Shadowed rows get no probes
        (:meth:`choose`): their acceptance is observed, and a width whose cost estimate went stale is estimated
        from the fresh ones again (``_WidthCosts``), so drafting resumes on its own where it pays (probes were
        most of adaptive ngram's 5-6% loss on chat at B=8). Drafters without ``shadow`` (a draft model:
        proposing costs its forwards) are left alone."""
        shadow = getattr(group, "shadow", None)
        if shadow is None or self.max_depth == 0:
            return
        for row, seen in zip(rows, shadow(self.max_depth)):
            row.shadowed = True
            for drafted, agreed in seen:
                row.observe(drafted, agreed, self.decay)
