"""Choosing the verify width W and draft block L each cycle (SPEC 5.4).

The expected speed of a cycle is `E[accepted + 1 | W] / (t_draft(L) + t_verify(W))`, with
`W = 1` (plain decoding, no draft pass) always a candidate, so speculation is only used when
it is expected to pay. Costs come from measured curves (`calibrate.py`), corrected by the
wall time of cycles as the engine really runs them as soon as it has seen some; acceptance
comes from running, exponentially decayed per-position statistics. When plain decoding
wins, a speculative cycle is re-tried now and then: the interval doubles after each probe
that confirms the loss, up to the point where probes cost at most `probe_budget` of the
decoding time. Meanwhile plain steps stop capturing features for the draft until a window
before the next probe. Pure Python on a few floats per cycle: no device work and no host
syncs. Knows nothing about models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostCurves:
    """Seconds per pass, measured on the running device.

    `verify[w - 1]`: the target on `w` tokens (w = 1 is a plain decoding step).
    `draft[l - 1]`: the draft on a block of `l` rows (l = 1 unused).
    """

    verify: tuple[float, ...]
    draft: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.verify or len(self.verify) != len(self.draft):
            raise ValueError(
                f"cost curves need equal, non-empty verify ({len(self.verify)}) and draft "
                f"({len(self.draft)}) lengths"
            )
        if any(t <= 0 for t in self.verify) or any(t < 0 for t in self.draft):
            raise ValueError("cost curves must hold positive times")


class WidthChooser:
    """Picks `(W, L)` for the next cycle and learns from each cycle's acceptance."""

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
        window: int = 32,
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
        self.since_probe = 0
        self.probing = False
        # Whether the next cycle must capture target features for the draft. Plain steps
        # far from the next probe skip it (the draft's context then restarts from the
        # last `window` positions before that probe): a draft that is not used costs nothing.
        self.window = window
        self.capture = True
        # Costs never change: the cheapest draft block for each width is fixed.
        self._blocks = {w: self._draft_block(w) for w in range(2, block + 1)}
        self._rates: dict[int, tuple[float, int]] | None = None  # until the next update
        # Wall time of cycles as the engine really runs them, sync to sync (host syncs,
        # Python work, feature capture), which isolated calibration passes cannot see:
        # plain steps are measured as such; speculative cycles set one offset added to the
        # calibrated curve (`offset`), so every width's cost follows all observations.
        self.plain: float | None = None  # seconds per plain step, once measured
        self.offset = 0.0  # seconds a speculative cycle costs beyond its calibrated passes
        self._offset_seen = False

    # -- model -----------------------------------------------------------------------------

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

    def _draft_block(self, w: int) -> int:
        if self.draft_block is not None:
            return self.draft_block
        return min(range(w, self.block + 1), key=lambda n: self.costs.draft[n - 1])

    def rates(self) -> dict[int, tuple[float, int]]:
        """Expected tokens per second and draft block for every width."""
        if self._rates is not None:
            return self._rates
        exp = self.expected_tokens()
        out = {1: (1.0 / self.plain_cost(), 0)}
        for w in range(2, (self.draft_block or self.block) + 1):
            out[w] = (exp[w - 1] / self.cycle_cost(w), self._blocks[w])
        self._rates = out
        return out

    def plain_cost(self) -> float:
        """Seconds per plain decoding step: as measured, else as calibrated."""
        return self.costs.verify[0] if self.plain is None else self.plain

    def cycle_cost(self, w: int) -> float:
        """Seconds per cycle of width `w`: plain steps as measured; speculative cycles as
        calibrated, plus what such cycles measured beyond their calibration."""
        if w == 1:
            return self.plain_cost()
        n = self._blocks[w]
        return max(self.costs.verify[w - 1] + self.costs.draft[n - 1] + self.offset, 1e-9)

    def observe(self, width: int, seconds: float, smoothing: float = 0.2) -> None:
        """Record how long a cycle of `width` really took, sync to sync (W = 1: a plain
        step chained after another plain step).

        The first observation replaces the calibrated figure, within a factor of three of
        it; later ones count at most a factor of two from the estimate, so a stalled cycle
        (GC, a busy machine) is a small nudge, not a new truth.
        """
        if seconds <= 0:
            return
        if width <= 1:
            prev = self.plain
            if prev is None:
                prior = self.plain_cost()
                self.plain = min(max(seconds, prior / 3.0), 3.0 * prior)
            else:
                seconds = min(max(seconds, 0.5 * prev), 2.0 * prev)
                self.plain = prev + smoothing * (seconds - prev)
            if self._rates is not None:  # only the plain rate moved
                self._rates[1] = (1.0 / self.plain, 0)
            return
        # Speculative cycles share one offset on the calibrated curve (what a cycle costs
        # beyond its passes: host syncs, Python work): each observation refines the cost
        # of every width, and no width looks cheap by the luck of a single draw.
        cal = self.costs.verify[width - 1] + self.costs.draft[self._blocks[width] - 1]
        prev = self.cycle_cost(width)
        if not self._offset_seen:
            seconds, self._offset_seen = min(max(seconds, prev / 3.0), 3.0 * prev), True
            self.offset = seconds - cal
        else:
            seconds = min(max(seconds, 0.5 * prev), 2.0 * prev)
            self.offset += smoothing * (seconds - cal - self.offset)
        self._rates = None

    # -- decisions -------------------------------------------------------------------------

    def choose(self, limit: int | None = None) -> tuple[int, int]:
        """`(W, L)` for the next cycle; `limit` caps W (tokens left in the budget)."""
        rates = self.rates()
        widths = [w for w in rates if limit is None or w <= limit]
        best = max(widths, key=lambda w: rates[w][0])
        self.probing = False
        if best == 1 and len(widths) > 1:
            self.since_probe += 1
            if self.since_probe >= self.probe_interval:
                self.probing = True
                self.since_probe = 0
                best = max((w for w in widths if w > 1), key=lambda w: rates[w][0])
        self.capture = best > 1 or self.probe_interval - self.since_probe <= self.window
        return best, rates[best][1]

    def update(self, width: int, accepted: int) -> None:
        """Learn from a cycle that verified `width` tokens and accepted `accepted` drafts."""
        if width <= 1:
            return
        self._rates = None
        d = self.decay
        self.trials = [t * d for t in self.trials]
        self.hits = [h * d for h in self.hits]
        for j in range(1, min(accepted + 1, width - 1) + 1):
            self.trials[j] += 1.0
            if j <= accepted:
                self.hits[j] += 1.0
        if self.probing:
            rates = self.rates()
            if max(rates, key=lambda w: rates[w][0]) == 1:
                self.probe_interval = min(2 * self.probe_interval, self.probe_cap(width))
            else:
                self.probe_interval = self.base_probe

    def probe_cap(self, width: int) -> int:
        """The longest interval between probes of `width`: just long enough that what a
        probe loses against plain decoding is at most `probe_budget` of the time between."""
        t1 = self.plain_cost()
        loss = max(self.cycle_cost(width) - self.expected_tokens()[width - 1] * t1, 0.0)
        steps = math.ceil(loss / (self.probe_budget * t1))
        return max(self.base_probe, min(steps, self.max_probe_interval))
