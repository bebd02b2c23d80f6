"""Choosing the verify width W and draft block L each cycle (SPEC 5.4).

The expected speed of a cycle is `E[accepted + 1 | W] / (t_draft(L) + t_verify(W))`, with
`W = 1` (plain decoding, no draft pass) always a candidate, so speculation is only used when
it is expected to pay. Both costs depend on the width and on the context depth.

Costs: the calibration (`calibrate.py`, measured at a few depths and interpolated) is the
prior. The wall time of every cycle as the engine really runs it (sync to sync) is learnt
per width and per depth bucket (a decayed mean) and replaces the prior width by width;
widths not measured follow the *shape* of the measured ones (interpolated between them
along the calibrated curve, or along the last measured segment beyond them), not a stale
absolute, and while only one speculative width has been measured, wider ones are priced
optimistically (no dearer than it), so one cycle finds out. A stale calibration (another
BLAS, Low Power Mode) is thus unlearnt within a few dozen cycles; when the measured costs
keep disagreeing with it, `recalibrate` says so.

Acceptance comes from running, exponentially decayed per-position statistics. When plain
decoding wins, a speculative cycle is re-tried now and then (a probe, priced at the current
depth): the interval doubles after each probe that confirms the loss, up to the point where
probes cost at most `probe_budget` of the decoding time; within one request probes lose at
most `request_budget` of that request's time, so a short request at a long context is not
eaten by them. A probe is priced with everything it costs: its cycle's loss and catching the
draft's context up first (the rows decoded plainly since, a dormant prefill's window:
`CatchUp`, learnt from what catch-ups measure), both counted in that budget; and it is not
made at all when even a perfect draft could not win that back in what is left of the
request. Meanwhile plain steps stop capturing features for the draft until a window before
the next probe (none when no probe can come before the request ends). Pure Python on a
few floats per cycle: no device work and no host syncs. Knows nothing about models.
"""

from __future__ import annotations

import math

from ..engine.tree import ShapeChooser
from .costs import (
    CatchUp,
    CostCurves,
    Curve,
    Floor,
    _Bucket,
    _depth_key,
    depth_bucket,
    measured_curve,
    nearest,
)

__all__ = ["CostCurves", "Curve", "WidthChooser", "depth_bucket"]

# Cycles' worth of acceptance evidence a new request starts from (see `begin_request`).
REQUEST_MEMORY = 4.0
# Plain decisions that stand without being recomputed while dormant, far from a probe.
COAST = 16
# A request of this many tokens or more may lose `request_budget` of its time to probes; a
# shorter one proportionally less: what a probe can win back grows with what is left to
# decode (64-token requests on the stock wheel, where nothing paid, spent their 3% on a
# probe each: 0.97x plain).
FULL_BUDGET_TOKENS = 128
# Until a speculative cycle has been timed on this device, what one costs is the
# calibration's word, which may be stale (taken under other conditions: another BLAS, a
# busier machine): the first probe may spend this share of the request it falls in, once in
# the chooser's life, so that a calibration that wrongly prices speculation out is found out
# by one cycle (on stock-BLAS curves under OpenBLAS, where W=16 ran 3x plain, every
# 96-token request stayed plain: its 2% could not pay the probe the stale curves priced).
FIRST_LOOK = 0.1


class WidthChooser:
    """Picks `(W, L)` for the next cycle and learns from each cycle's cost and acceptance."""

    def __init__(
        self,
        costs: CostCurves,
        block: int,
        *,
        draft_block: int | None = None,
        decay: float = 0.95,
        prior: float = 0.5,
        prior_strength: float = 2.0,
        probe_interval: int = 8,
        max_probe_interval: int = 4096,
        probe_budget: float = 0.005,
        request_budget: float = 0.03,
        budget_tokens: int = FULL_BUDGET_TOKENS,
        first_look: float = FIRST_LOOK,
        window: int = 32,
        smoothing: float = 0.2,
        floor_evidence: float = 4.0,
    ):
        if len(costs.verify) < block:
            raise ValueError(f"cost curves cover {len(costs.verify)} widths, need {block}")
        if draft_block is not None and not 2 <= draft_block <= block:
            raise ValueError(f"draft_block {draft_block} must be in 2..{block}")
        self.costs = costs
        self.block = block
        self.draft_block = draft_block  # fixed L (DFlash 2 always drafts its whole block)
        self.decay = decay
        self.prior = prior
        self.prior_strength = prior_strength
        self.trials = [0.0] * block  # index j: drafted position j (1..block-1)
        self.hits = [0.0] * block
        self.base_probe = probe_interval
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_budget = probe_budget  # fraction of decoding time probes may lose
        self.request_budget = request_budget  # the same, within one request
        self.budget_tokens = budget_tokens  # ... of that many tokens (0: of any length)
        self.first_look = first_look  # ... until a speculative cycle is timed (`looked`)
        self.since_probe = 0
        self.probing = False
        self.probes = 0  # probes made, over the chooser's life
        # After a probe whose drafts were all accepted, the next cycle probes again at
        # twice the width (0: no such follow-up due): a few cycles tell a good stretch.
        self.follow_up = 0
        # Whether the next cycle must capture target features for the draft. Plain steps
        # far from the next probe skip it (the draft's context then restarts from the
        # last `window` positions before that probe): a draft that is not used costs nothing.
        self.window = window
        self.capture = True
        self.smoothing = smoothing  # weight of each new cycle in a width's measured cost
        self.depth = 0  # context depth of the latest decision
        # Chain or tree at the widths chosen here, for requests that leave it open.
        self.shapes = ShapeChooser()
        self._buckets: dict[int, _Bucket] = {}
        self._version = 0  # bumped when what the cost model sees changes
        self._curve_memo: tuple | None = None
        self._cal_memo: tuple | None = None
        self._rates: tuple | None = None  # ((depth key, version, acceptance version), rates)
        self._acc_version = 0
        self._plain_seen = 0  # plain observations since the curve was last recomputed
        self._plain_ratio = 0.0  # the plain steps' measured / calibrated cost then
        # How far measured costs sit from the calibration (log ratio, decayed): persistent
        # disagreement means the calibration was taken under other conditions.
        self.disagreement = 0.0
        self._spec_seen = 0
        # What other choosers of the pair (a batch's other sizes, the pair's own) found
        # speculative cycles to cost against their calibration (log ratio), while this one
        # has measured none: a calibration from elsewhere is found out once, not once a size.
        self.kin = 0.0
        self._kin_seen = False  # whether `kin` is what another chooser measured
        self.req_time = 0.0  # seconds the current request's cycles are expected to take
        self.req_lost = 0.0  # seconds its probes were expected to lose
        self.req_tokens: int | None = None  # tokens it may decode (None: not known yet)
        # The same over the chooser's life (requests before the current one): what early
        # looks at new texts may spend while speculation loses (`begin_request`).
        self.life_time = 0.0
        self.life_lost = 0.0
        # No speculation can pay back its cost in what is left of this request: no more
        # probes, and plain steps capture nothing for the draft.
        self.req_done = False
        self.carried = False  # acceptance evidence from earlier requests only, so far
        self.catch_up = CatchUp(costs, block)  # what waking the draft's context costs
        # What speculation really gave against plain, lately (`floor_evidence`: decayed
        # speculative cycles it takes to judge; a batch's cycle is every row's evidence).
        self.floor = Floor(evidence=floor_evidence)
        self._coast = 0  # plain decisions left that stand without being recomputed
        self._coast_cost = 0.0

    # -- acceptance ------------------------------------------------------------------------

    def read_acceptance(self, base: WidthChooser) -> None:
        """Take the acceptance `base` has learnt as this chooser's (a batch's chooser prices
        its own costs, but acceptance belongs to the draft and the texts, not to the batch
        size): pooled over several texts, so no row's first cycle drops it (`pooled`)."""
        self.trials, self.hits = list(base.trials), list(base.hits)
        self.pooled()
        self._acc_version += 1
        self._coast = 0

    def pooled(self) -> None:
        """What `update` is taught next comes from several texts at once (a batch's rows):
        one of them falling short of what earlier texts promised says that its text
        differs, not that the others' evidence is stale, so nothing carried is dropped."""
        self.carried = False

    def acceptance(self) -> list[float]:
        """alpha_j = P(position j accepted | positions < j accepted), j = 1..block-1.

        Each position is smoothed towards the estimate of the position before it, or the
        pooled estimate of all positions when that is higher: positions little tried
        borrow the evidence optimistically, so that one unlucky estimate does not keep the
        width below them forever (wider cycles then try them, and their own evidence wins).
        """
        s = self.prior_strength
        pooled = (sum(self.hits) + s * self.prior) / (sum(self.trials) + s)
        alphas, prev = [], self.prior
        for j in range(1, self.block):
            anchor = prev if j == 1 else max(prev, pooled)
            a = (self.hits[j] + s * anchor) / (self.trials[j] + s)
            alphas.append(a)
            prev = a
        return alphas

    def expected_tokens(self) -> list[float]:
        """`E[accepted + 1 | W]` for W = 1..block."""
        out, reach, total = [1.0], 1.0, 1.0
        for a in self.acceptance():
            reach *= a
            total += reach
            out.append(total)
        return out

    # -- costs -----------------------------------------------------------------------------

    def _draft_block(self, w: int, depth: int | None = None) -> int:
        return self._calibration(self.depth if depth is None else depth)[1][w - 1]

    def _calibration(self, depth: int) -> tuple[list[float], list[int]]:
        """Calibrated seconds per cycle of each width at `depth` and the cheapest draft
        block for it (index w - 1)."""
        key = _depth_key(depth)
        if self._cal_memo is not None and self._cal_memo[0] == key:
            return self._cal_memo[1]
        verify, draft = self.costs.at(depth)
        cost, blocks = [verify[0]], [0]
        for w in range(2, self.block + 1):
            n = self.draft_block or min(range(w, self.block + 1), key=lambda n: draft[n - 1])
            cost.append(verify[w - 1] + draft[n - 1])
            blocks.append(n)
        self._cal_memo = (key, (cost, blocks))
        return cost, blocks

    def calibrated(self, depth: int) -> list[float]:
        """Calibrated seconds per cycle of each width at `depth` (index w - 1)."""
        return self._calibration(depth)[0]

    def _nearest(self, b: int, test) -> _Bucket | None:
        return nearest(self._buckets, b, test)

    def curve(self, depth: int | None = None, optimistic: bool = True) -> list[float]:
        """Expected seconds per cycle of each width at `depth` (index w - 1): measured where
        measured, else the measured widths' shape over the calibrated curve. Not
        `optimistic`: widths beyond the only measured one follow the calibrated shape
        (what a probe is priced at: its loss is paid from a budget)."""
        depth = self.depth if depth is None else depth
        key = (_depth_key(depth), self._version, optimistic)
        if self._curve_memo is not None and self._curve_memo[0] == key:
            return self._curve_memo[1]
        kin = self.kin if not self._spec_seen else 0.0
        cal = self.calibrated(depth)
        out = measured_curve(cal, self._buckets, depth_bucket(depth), optimistic, kin)
        self._curve_memo = (key, out)
        return out

    def context_cost(self, rows: int, lazy: int = 0, depth: int | None = None) -> float:
        """Seconds to catch the draft's context up on `rows` rows (`CatchUp`) at `depth`."""
        return self.catch_up.cost(rows, lazy, self.depth if depth is None else depth)

    def observe_context(self, rows: int, lazy: int, seconds: float) -> None:
        """A catch-up of `rows` rows (`lazy` positions computed then) took `seconds`."""
        self.catch_up.observe(rows, lazy, seconds, self.depth)
        self.floor.charge(seconds)

    def settle(self, tokens: int, seconds: float, doubt: bool = False) -> float:
        """A speculative cycle (chain or tree) committed `tokens` in `seconds`, sync to
        sync: settled against plain decoding as measured here now (`Floor`; as calibrated
        before a plain step is measured). `doubt`: until one is, against twice the
        calibration's price of a plain step (a batch's: the calibration prices a request
        alone, so it does not make a batch's speculation look lost; a cycle that lost more
        than that did lose). Returns the seconds it saved (negative: lost)."""
        plain = self.plain_cost() * (2.0 if doubt and not self.plain_measured else 1.0)
        return self.floor.settle(tokens, seconds, plain)

    def saving(self, tokens: int | None, perfect: bool = False) -> float:
        """Seconds speculating could save against plain decoding over the next `tokens`
        tokens (None: unbounded), at the best width as the acceptance stands (`perfect`:
        were every draft accepted, the most any speculation could save)."""
        if tokens is None:
            return math.inf
        if tokens <= 1:
            return 0.0
        curve, plain = self.curve(optimistic=not perfect), self.plain_cost()
        exp = self.expected_tokens()
        top = min(tokens, self.draft_block or self.block)
        per_token = max(
            (plain - curve[w - 1] / (w if perfect else exp[w - 1]) for w in range(2, top + 1)),
            default=0.0,
        )
        return max(per_token, 0.0) * tokens

    @property
    def plain_measured(self) -> bool:
        """Whether a plain step has been timed near the latest depth (else `plain_cost` is
        the calibration's)."""
        return self._nearest(depth_bucket(self.depth), lambda k: k.seen[1]) is not None

    def plain_cost(self, depth: int | None = None) -> float:
        """Seconds per plain decoding step: as measured, else as calibrated."""
        return self.curve(depth)[0]

    def cycle_cost(self, w: int, depth: int | None = None) -> float:
        """Expected seconds per cycle of width `w` at `depth` (default: the latest)."""
        return self.curve(depth)[w - 1]

    def rates(
        self, depth: int | None = None, optimistic: bool = True
    ) -> dict[int, tuple[float, int]]:
        """Expected tokens per second and draft block for every width."""
        depth = self.depth if depth is None else depth
        key = (_depth_key(depth), self._version, self._acc_version, optimistic)
        if self._rates is not None and self._rates[0] == key:
            return self._rates[1]
        exp = self.expected_tokens()
        curve = self.curve(depth, optimistic)
        blocks = self._calibration(depth)[1]
        out = {1: (1.0 / curve[0], 0)}
        for w in range(2, (self.draft_block or self.block) + 1):
            out[w] = (exp[w - 1] / curve[w - 1], blocks[w - 1])
        self._rates = (key, out)
        return out

    def observe(self, width: int, seconds: float, depth: int | None = None, times: int = 1) -> None:
        """Record how long a cycle of `width` really took, sync to sync (W = 1: a plain
        step chained after another plain step), at context `depth` (default: the latest);
        `times`: so many cycles ran, `seconds` each on average (a plain stretch's steps,
        each of which counts as evidence: 64 plain steps off the curves ask for a new
        calibration, not 64 stretches).

        The first observation of a width in a depth bucket counts within a factor of three
        of what was expected; later ones at most a factor of two from its estimate, so a
        stalled cycle (GC, a busy machine) is a small nudge, not a new truth.
        """
        if seconds <= 0 or not 1 <= width <= self.block or times < 1:
            return
        depth = self.depth if depth is None else depth
        cal = self.calibrated(depth)[width - 1]
        expect = self.cycle_cost(width, depth)
        b = self._buckets.setdefault(depth_bucket(depth), _Bucket(self.block))
        if not b.seen[width]:
            b.ratio[width] = min(max(seconds, expect / 3.0), 3.0 * expect) / cal
            b.seen[width] = True
        else:
            est = b.ratio[width] * cal
            seconds = min(max(seconds, 0.5 * est), 2.0 * est)
            weight = 1.0 - (1.0 - self.smoothing) ** times  # `times` updates of the mean
            b.ratio[width] += weight * (seconds / cal - b.ratio[width])
        b.count[width] += times
        if width == 1:
            # Plain steps come every step while dormant: the curve is recomputed when their
            # cost moved by more than 1%, or every 16 steps.
            self._plain_seen += times
            moved = abs(b.ratio[1] / max(self._plain_ratio, 1e-12) - 1.0) > 0.01
            if moved:
                self._coast = 0  # a decision that stands is re-made on the new cost
            if self._plain_seen < 16 and not moved:
                return
            self._plain_seen, self._plain_ratio = 0, b.ratio[1]
        else:
            self._coast = 0
            rp = self._nearest(depth_bucket(depth), lambda k: k.seen[1])
            scale = rp.ratio[1] if rp is not None else 1.0
            gap = math.log(max(seconds, 1e-12) / (scale * cal))
            self._spec_seen += 1
            self.disagreement += (gap - self.disagreement) / min(self._spec_seen, 64)
        self._version += 1

    @property
    def recalibrate(self) -> bool:
        """Whether measured cycles have persistently disagreed with the calibration (by more
        than a factor of two, over at least 64 speculative cycles, or 64 plain steps at one
        depth; by more than a factor of three, over 8 speculative cycles): worth measuring
        again. Plain steps count because where the calibration says
        speculation cannot pay, no speculative cycle ever runs to contradict it (on curves
        taken with another BLAS, not one probe in 40 short requests: 0.23x the best fixed
        width); a plain step twice as fast or slow as calibrated says the conditions
        changed, and what it says of speculation is not to be trusted either."""
        if self._spec_seen >= 64 and abs(self.disagreement) > math.log(2.0):
            return True
        if self._spec_seen >= 8 and abs(self.disagreement) > math.log(3.0):
            # Far off, a few cycles tell: stock-BLAS curves under OpenBLAS, the first look
            # and its follow-ups ran at a sixth of their price, and the curves went on
            # pricing the widths not yet measured (until 64 speculative cycles, several
            # requests: 0.93x the best fixed width on 256-token replies).
            return True
        return any(
            b.count[1] >= 64 and abs(math.log(max(b.ratio[1], 1e-12))) > math.log(2.0)
            for b in self._buckets.values()
        )

    def carry(self, other: WidthChooser) -> None:
        """Go on from `other`'s request as its own: the batch this chooser now decodes
        is the one `other` did, a row fewer (its time, its probes' losses, the plain steps
        since its last probe)."""
        self.req_time, self.req_lost = other.req_time, other.req_lost
        self.req_tokens = other.req_tokens
        self.since_probe = max(self.since_probe, other.since_probe)
        self.req_done = False
        self._coast = 0

    def learn_from(self, others: list[WidthChooser]) -> None:
        """Take the widest disagreement with the calibration that `others` measured on
        speculative cycles as this chooser's prior for them (`kin`), until it measures its own."""
        seen = [o.disagreement for o in others if o is not self and o._spec_seen]
        kin = max(seen) if seen else 0.0
        self._kin_seen = bool(seen)
        if abs(kin - self.kin) > 0.01:
            self.kin = kin
            self._version += 1

    # -- decisions -------------------------------------------------------------------------

    def expects_plain(self, depth: int) -> bool:
        """Whether, as things stand, decoding at `depth` would start plainly (the draft
        dormant): then a prompt's draft context need not be built during prefill."""
        rates = self.rates(depth)
        return max(rates, key=lambda w: rates[w][0]) == 1

    def begin_request(self) -> None:
        """A new request starts: its own probe budget starts empty, and what earlier
        requests showed of the draft's acceptance stays only as a prior worth
        `REQUEST_MEMORY` cycles, with probes at the base interval again. Costs belong to
        the device and carry over whole; acceptance belongs to the text, and one prompt's
        useless drafts say little about the next prompt's (on the demo pair τ at W=16 runs
        from 1.1 to 14 across six stretches of standard-library code). So the request's
        first speculative cycle, on that prior alone, may lose no more than half its probe
        budget were every draft wrong, and when it falls well short of the prior, the
        prior goes (`update`)."""
        self.life_time += self.req_time
        self.life_lost += self.req_lost
        self.req_time = 0.0
        self.req_lost = 0.0
        self.req_tokens = None
        self.req_done = False
        self._coast = 0
        seen = self.trials[1] if self.block > 1 else 0.0
        if seen > REQUEST_MEMORY:
            keep = REQUEST_MEMORY / seen
            self.trials = [t * keep for t in self.trials]
            self.hits = [h * keep for h in self.hits]
            self._acc_version += 1
        self.carried = seen > 0  # until this request's first speculative cycle
        self.follow_up = 0  # what the last request's good probe promised was its text's
        if self.probe_interval > self.base_probe and not self.floor.losing:
            self.probe_interval = self.base_probe
            self.since_probe = 0
        elif self.probe_interval > self.base_probe and (
            self.life_lost <= 1.5 * self.probe_budget * self.life_time
        ):
            # While speculation keeps losing on this device (measured), the interval keeps
            # what probes grew it to, but a new text is looked at: its first probe comes
            # within the base interval (as the request's budget affords it, `_probe`), not
            # after the interval that earlier texts grew, which a short request never
            # reaches (a chat of 96-token replies then stayed plain on texts whose drafts
            # were right 13 times in 14, at 0.4x the speed it had before). Such looks spend
            # at most 1.5 times the probe budget over the chooser's life: one a request cost
            # short requests on a device where nothing pays 1.8% of their time.
            self.since_probe = max(self.since_probe, self.probe_interval - self.base_probe)

    def choose(
        self,
        limit: int | None = None,
        depth: int | None = None,
        context: tuple[int, int] = (0, 0),
    ) -> tuple[int, int]:
        """`(W, L)` for the next cycle; `limit` caps W (tokens left in the request), `depth`
        is the context depth the cycle runs at (default: the latest given), `context` the
        `(rows, lazy)` a speculative cycle must first catch the draft's context up on
        (see `context_cost`; (0, 0) when the draft is up to date)."""
        if depth is not None:
            self.depth = depth
        first = self.req_tokens is None and limit is not None
        if first:
            self.req_tokens = limit  # the request's first decision: all of it is left
        if self.coasting():
            return 1, 0
        rates = self.rates()
        widths = [w for w in rates if limit is None or w <= limit]
        if first and len(widths) > 1 and not self._affordable(widths, limit, context):
            self.req_done = True  # no probe fits its budget: nothing is built for one
        best = max(widths, key=lambda w: rates[w][0])
        self.probing = False
        if best > 1 and self.carried and limit is not None:
            # Nothing of this request's text seen yet, only earlier texts': were every draft
            # of its first cycle wrong, it loses no more than half the request's probe
            # budget (of the request decoded plainly); the probes keep theirs, so that a
            # good stretch later in the request is still found.
            curve = self.curve()
            room = 0.5 * self.request_budget * limit * curve[0]
            safe = [w for w in widths if w == 2 or 1 < w and curve[w - 1] - curve[0] <= room]
            best = max(safe, key=lambda w: rates[w][0])
        if best > 1 and self.floor.losing and not self.follow_up:
            # Speculation has lately lost against plain decoding as measured, whatever the
            # cost model expects: only probes (budgeted at what cycles really lost) until
            # one pays.
            best = 1
        # Priced only where it decides something (plain steps far from a probe are most).
        if best > 1 and any(context) and self.saving(limit) <= self.context_cost(*context):
            # Waking the draft costs more than it is expected to save in what is left of
            # the request (and ever less is left): plain to its end.
            best, self.req_done = 1, True
        elif best == 1 and len(widths) > 1 and not self.req_done:
            self.since_probe += 1
            if self.since_probe >= self.probe_interval:
                best = self._probe(widths, limit, context)
        # Plain steps capture features for the draft only within a window before a probe
        # that can still come in this request.
        due = self.probe_interval - self.since_probe
        self.capture = best > 1 or (
            not self.req_done and due <= self.window and (limit is None or due < limit)
        )
        self.req_time += self.cycle_cost(best)
        if best == 1:
            self._coast_cost = self.cycle_cost(1)
            if not self.capture:
                self._coast = COAST if self.req_done else max(0, min(COAST, due - self.window - 1))
            else:
                # Capturing for a probe `due` steps ahead: nothing a plain step teaches
                # brings it nearer, so the decision stands until then.
                self._coast = max(0, min(COAST, due - 1))
        return best, rates[best][1]

    def coasting(self) -> bool:
        """Plain until the next probe is due, or dormant and far from it, the last decision
        stands for a few steps (what plain steps teach meanwhile cannot make speculation
        win), capturing features or not as it said (`capture`), and a plain step pays
        nothing for it (the full decision cost it ~50 us of host time): takes one such step
        and says so, or says there is none left (`choose` decides anew)."""
        if not self._coast:
            return False
        self._coast -= 1
        self.since_probe += 1
        self.req_time += self._coast_cost
        return True

    def _affordable(self, widths: list[int], limit: int, context: tuple[int, int]) -> bool:
        """Whether a probe could fit the budget of a request of `limit` tokens by its
        middle (one made later has too little left to win its cost back: a 64-token request
        on the stock wheel captured features for it for 20 steps and probed with 15 tokens
        left), woken on a window of context (`context`: what the draft is behind now)."""
        safe = self.rates(optimistic=False)
        w = max((w for w in widths if w > 1), key=lambda w: safe[w][0])
        loss = max(self.probe_loss(w), self.floor.cycle_loss())
        loss += self.context_cost(min(context[0], self.window), context[1])
        return self.budget() * (0.5 * limit * self.plain_cost() + loss) >= loss

    def _probe(self, widths: list[int], limit: int | None, context: tuple[int, int]) -> int:
        """The width of a probe due now, or 1 when it is put off (or, when it can no longer
        pay back in what is left of the request, given up for the request); `context` the
        `(rows, lazy)` it would first catch the draft's context up on."""
        catch_up = self.context_cost(*context)
        safe = self.rates(optimistic=False)
        w = max((w for w in widths if w > 1), key=lambda w: safe[w][0])
        if self.follow_up:
            w = max(w, min(self.follow_up, max(widths)))
        # Everything it costs: the catch-up of the draft's context and the cycle's loss
        # (as predicted, or as speculative cycles have lately really lost, if more).
        loss = max(self.probe_loss(w), self.floor.cycle_loss()) + catch_up
        left = None if limit is None else limit - w
        if self._spec_seen and not self.follow_up and self.saving(left, perfect=True) <= loss:
            # Even were every draft accepted from here on, it would not pay back (by costs
            # measured: until one speculative cycle is, the calibration may be stale).
            self.req_done = True
            return 1
        t1 = self.plain_cost()
        b = self.budget()
        short = self.req_lost + loss - b * (self.req_time + loss)
        # A follow-up of a probe whose drafts were all accepted is not held back by the
        # budget: by the latest evidence it loses nothing.
        if short <= 0 or self.follow_up:
            self.probing = True
            self.probes += 1
            self.since_probe = 0
            self.req_lost += loss
            return w
        # This request cannot afford it yet: wait the steps that pay for it; none, when
        # half of what is left is decoded first (too little would be left to win its cost
        # back, `_affordable`). Capturing meanwhile, each step adds a row the probe must
        # first catch up on (at a cost that may outgrow what the step adds to the budget:
        # put off again and again, a 64-token request captured for 50 steps and never
        # probed); else dormant meanwhile, awake a window before, the catch-up a window's.
        wait = math.ceil(short / (b * t1))
        if context[0] and wait > 1:  # capturing: rows pile up
            base, row = loss - catch_up, self.context_cost(1)
            net = b * t1 - (1.0 - b) * row
            wait = math.ceil(short / net) if net > 0 else math.inf
            if wait > self.window:
                lw = base + self.context_cost(self.window, context[1])
                wait = max(
                    self.window + 1,
                    math.ceil((self.req_lost + lw - b * (self.req_time + lw)) / (b * t1)),
                )
        if left is not None and 2 * wait >= left:  # not before half of what is left
            self.req_done = True
        self.since_probe = self.probe_interval - min(wait, self.max_probe_interval)
        return 1

    @property
    def confirms(self) -> bool:
        """Whether the speculative cycles it timed agree with the calibration (their decayed
        log ratio to it, plain steps' scale applied, within a factor of 1.5)."""
        return self._spec_seen > 0 and abs(self.disagreement) <= math.log(1.5)

    @property
    def looked(self) -> bool:
        """Whether a speculative cycle's cost has been timed on this device, by this chooser
        or (`learn_from`) another of the pair's: until then it is the calibration's word."""
        return bool(self._spec_seen) or self._kin_seen

    def budget(self) -> float:
        """The share of the current request's time its probes may lose: `request_budget`,
        less for a request of fewer than `budget_tokens` tokens (in proportion); at least
        `first_look` until a speculative cycle has been timed (`looked`)."""
        b = self.request_budget
        if self.req_tokens is not None and self.budget_tokens > 0:
            b *= min(1.0, self.req_tokens / self.budget_tokens)
        return b if self.looked else max(b, self.first_look)

    def update(self, width: int, accepted: int) -> None:
        """Learn from a cycle that verified `width` tokens and accepted `accepted` drafts."""
        if width <= 1:
            return
        self._coast = 0  # new evidence of acceptance: decided anew
        if self.carried:
            # The request's first speculative cycle: when it falls well short of what
            # earlier requests' texts promised, this text is not theirs; what they taught
            # goes (the prior remains), instead of a cycle of loss at a time.
            self.carried = False
            if accepted < 0.5 * (self.expected_tokens()[width - 1] - 1.0):
                self.trials, self.hits = [0.0] * self.block, [0.0] * self.block
        self._acc_version += 1
        d = self.decay
        self.trials = [t * d for t in self.trials]
        self.hits = [h * d for h in self.hits]
        for j in range(1, min(accepted + 1, width - 1) + 1):
            self.trials[j] += 1.0
            if j <= accepted:
                self.hits[j] += 1.0
        if accepted < width - 1:
            self.follow_up = 0  # a rejected draft since: no follow-up promised
        if self.probing:
            self._probed(width, accepted == width - 1)

    def update_rows(self, cycles: list[tuple[int, int]], chose: bool = True) -> None:
        """Learn from one cycle of several rows, `(width, accepted)` each: every row's
        acceptance, and (when this chooser `chose` the cycle's width) the probe's outcome
        once, for the cycle: a follow-up only when every row's drafts were all accepted."""
        probing, self.probing = self.probing, False
        for width, accepted in cycles:
            self.update(width, accepted)
        self.probing = probing
        if probing and chose and cycles:
            self._probed(max(w for w, _ in cycles), all(n == w - 1 for w, n in cycles))

    def _probed(self, width: int, all_accepted: bool) -> None:
        """A probe of `width` ran: its interval grows while plain decoding wins, and a probe
        whose drafts were all accepted, and that did not lose against plain decoding (where
        a pass costs what its tokens do, all accepted still loses), is followed by one at
        twice the width."""
        rates = self.rates()
        if max(rates, key=lambda w: rates[w][0]) == 1 or self.floor.losing:
            self.probe_interval = min(2 * self.probe_interval, self.probe_cap(width))
        else:
            self.probe_interval = self.base_probe
        self.follow_up = 0
        if all_accepted and width < self.block and self.floor.last >= 0.0:
            self.follow_up = min(2 * width, self.block)
            self.since_probe = self.probe_interval  # the next plain choice probes

    def probe_loss(self, width: int) -> float:
        """Seconds a probe of `width` is expected to lose against plain decoding, at the
        current depth."""
        curve = self.curve(optimistic=False)
        return max(curve[width - 1] - self.expected_tokens()[width - 1] * curve[0], 0.0)

    def probe_cap(self, width: int) -> int:
        """The longest interval between probes of `width`: just long enough that what a
        probe loses against plain decoding is at most `probe_budget` of the time between."""
        loss = max(self.probe_loss(width), self.floor.cycle_loss()) + self.context_cost(self.window)
        steps = math.ceil(loss / (self.probe_budget * self.plain_cost()))
        return max(self.base_probe, min(steps, self.max_probe_interval))
