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

The acceptance statistics (`acceptance.py`) and the probes with their budgets (`probes.py`)
are mixins of `WidthChooser`, each in its own module.
"""

from __future__ import annotations

import math

from ..engine.tree import ShapeChooser
from .acceptance import Acceptance
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
from .probes import Probes

__all__ = ["CostCurves", "Curve", "WidthChooser", "depth_bucket"]

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


class WidthChooser(Acceptance, Probes):
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
        self._memos: dict[str, tuple] = {}  # by depth key, for a version (`_memo`)
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

    # -- costs -----------------------------------------------------------------------------

    def _memo(self, name: str, version) -> dict:
        """Memo `name` by depth key for `version` of what it rests on (emptied when that moved):
        a decision asks for several depths (one entry a memo: 72 us a decision, 49 now)."""
        held = self._memos.get(name)
        if held is None or held[0] != version:
            held = self._memos[name] = (version, {})
        return held[1]

    def _draft_block(self, w: int, depth: int | None = None) -> int:
        return self._calibration(self.depth if depth is None else depth)[1][w - 1]

    def _calibration(self, depth: int) -> tuple[list[float], list[int]]:
        """Calibrated seconds per cycle of each width at `depth` and the cheapest draft
        block for it (index w - 1)."""
        memo, key = self._memo("calibration", None), _depth_key(depth)  # never moves
        if (got := memo.get(key)) is not None:
            return got
        verify, draft = self.costs.at(depth)
        cost, blocks = [verify[0]], [0]
        for w in range(2, self.block + 1):
            n = self.draft_block or min(range(w, self.block + 1), key=lambda n: draft[n - 1])
            cost.append(verify[w - 1] + draft[n - 1])
            blocks.append(n)
        memo[key] = (cost, blocks)
        return cost, blocks

    def calibrated(self, depth: int) -> list[float]:
        """Calibrated seconds per cycle of each width at `depth` (index w - 1)."""
        return self._calibration(depth)[0]

    def curve(self, depth: int | None = None, optimistic: bool = True) -> list[float]:
        """Expected seconds per cycle of each width at `depth` (index w - 1): measured where
        measured, else the measured widths' shape over the calibrated curve. Not
        `optimistic`: widths beyond the only measured one follow the calibrated shape
        (what a probe is priced at: its loss is paid from a budget)."""
        depth = self.depth if depth is None else depth
        memo, key = self._memo("curve", self._version), (_depth_key(depth), optimistic)
        if (got := memo.get(key)) is not None:
            return got
        kin = self.kin if not self._spec_seen else 0.0
        cal = self.calibrated(depth)
        out = measured_curve(cal, self._buckets, depth_bucket(depth), optimistic, kin)
        memo[key] = out
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

    def saving(self, tokens: int | None, perfect: bool = False, depth: int | None = None) -> float:
        """Seconds speculating could save against plain decoding over the next `tokens`
        tokens (None: unbounded), at the best width as the acceptance stands (`perfect`:
        were every draft accepted, the most any speculation could save), at `depth`
        (default: the latest)."""
        if tokens is None:
            return math.inf
        if tokens <= 1:
            return 0.0
        curve, plain = self.curve(depth, optimistic=not perfect), self.plain_cost(depth)
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
        return nearest(self._buckets, depth_bucket(self.depth), lambda k: k.seen[1]) is not None

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
        versions = (self._version, self._acc_version)
        memo, key = self._memo("rates", versions), (_depth_key(depth), optimistic)
        if (got := memo.get(key)) is not None:
            return got
        exp = self.expected_tokens()
        curve = self.curve(depth, optimistic)
        blocks = self._calibration(depth)[1]
        out = {1: (1.0 / curve[0], 0)}
        for w in range(2, (self.draft_block or self.block) + 1):
            out[w] = (exp[w - 1] / curve[w - 1], blocks[w - 1])
        memo[key] = out
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
            rp = nearest(self._buckets, depth_bucket(depth), lambda k: k.seen[1])
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
        again. Plain steps count because where the calibration says speculation cannot pay,
        no speculative cycle ever runs to contradict it (on curves taken with another BLAS,
        not one probe in 40 short requests: 0.23x the best fixed width); a plain step twice
        as fast or slow as calibrated says the conditions changed, and what it says of
        speculation is not to be trusted either."""
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
        if best > 1 and self.req_done and self.extrapolated(self.depth):
            # Speculation is expected only on costs extrapolated past the calibration (at
            # 8k tokens on curves taken at 128 and 2048, such a first cycle, a catch-up
            # priced at half what it took and one W=2 cycle, cost a 64-token request 5%),
            # and a probe to test them does not fit this request's budget: plain.
            best = 1
        self.probing = False
        if best > 1 and self.carried and limit is not None:
            # Nothing of this request's text seen yet, only earlier texts': were every draft
            # of its first cycle wrong, it loses no more than half the request's probe
            # budget (of the request decoded plainly), catching the draft's context up
            # first included (a dormant prefill's window: at 1k tokens on the unwindowed
            # demo draft, a W=6 first cycle within that half lost 3.4 ms more catching up,
            # 2.8% of its 128-token request); the probes keep theirs, so that a good
            # stretch later in the request is still found. With nothing to catch up, W=2
            # is always safe enough to look.
            curve = self.curve()
            room = 0.5 * self.request_budget * limit * curve[0]
            catch = self.context_cost(*context)  # 0.0 with nothing to catch up
            safe = [
                w
                for w in widths
                if (w == 2 and not catch) or (1 < w and curve[w - 1] - curve[0] + catch <= room)
            ]
            best = max(safe, key=lambda w: rates[w][0]) if safe else 1
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
