"""The automatic width (SPEC 5.4; the rule on one page: docs/cost-model.md#automatic-width).

`choose` is the rule, a pure function: each cycle, the width W (plain, W = 1, included) that
maximises a batch's expected committed tokens per second, from what a cycle of each width
costs here (`CostTable`) and each row's acceptance estimate with its uncertainty; W > 1 only
where, with every acceptance taken one standard deviation low, it still beats plain decoding
(the floor). Where plain wins, a speculative cycle is made now and then to look (a probe),
paid from a bank that plain steps fill with `PROBE_SHARE` of their time: what looking can
lose is bounded by that share. `AutoPolicy` holds what the rule reads (the cost table, the
pair's pooled acceptance, each request's `Ticket`, the bank) and changes it only in `learn`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .costs import CostCurves, CostTable, Shape
from .port import Ask, Plan, Record, Ticket

# The share of plain decoding time probes may lose where speculation does not pay.
PROBE_SHARE = 0.02
# Acceptance before any evidence: 1/2, worth two drafted tokens (a uniform prior).
PRIOR, PRIOR_STRENGTH = 0.5, 2.0
# Evidence from other texts (the pair's pooled acceptance) counts in a row's estimate as at
# most this many cycles of its own: it says what the draft does, not what this text does.
POOLED_CYCLES = 4.0
# Per cycle, evidence fades by this factor (a text's predictability drifts within a reply).
DECAY = 0.95
# Draft context a dormant row keeps before a probe (the window the probe's draft reads).
WINDOW = 32


@dataclass(frozen=True)
class Estimate:
    """A row's acceptance: alpha_j = P(draft j accepted | drafts before it were), j = 1..,
    one standard deviation of each, and the tokens it has left."""

    alphas: tuple[float, ...]
    sds: tuple[float, ...]
    left: int
    seen: bool = True  # resting on cycles seen (this text's or the pair's), not the prior alone

    def tokens(self, width: int, low: bool = False) -> float:
        """E[accepted + 1] of a cycle of `width` (`low`: each alpha one sd lower)."""
        total = reach = 1.0
        for j in range(min(width, self.left) - 1):
            reach *= max(self.alphas[j] - self.sds[j], 0.0) if low else self.alphas[j]
            total += reach
        return total


@dataclass(frozen=True)
class Choice:
    width: int
    probe: bool = False
    wait: float = math.inf  # plain steps until a probe can be paid for (0: now)


def choose(
    costs: list[float],
    rows: list[Estimate],
    catch: float,
    bank: float,
    looked: bool,
    wake: float | None = None,
) -> Choice:
    """The rule. `costs[w - 1]`: seconds of a cycle of width w over all `rows` (w = 1: a plain
    step); `catch`: seconds to catch the rows' draft contexts up first (0 if current);
    `bank`: seconds probes may still lose; `looked`: a speculative cycle was timed here;
    `wake`: what a probe's catch-up costs (default `catch`)."""
    n, plain = len(rows), costs[0]
    step = plain / n  # plain seconds per token
    left = min(r.left for r in rows)
    best, rate, hopeful = 1, n / plain, []
    for w in range(2, len(costs) + 1):
        mean = sum(r.tokens(w) for r in rows)
        low = sum(r.tokens(w, low=True) for r in rows)
        # Seconds this cycle saves against plain (acceptance as estimated, or taken low: the
        # floor), less catching up spread over the cycles left (it is paid once).
        spread = catch / max(left / max(mean / n, 1.0), 1.0)
        if mean * step - costs[w - 1] - spread > 0:
            if all(r.seen for r in rows):  # a hope on the prior alone is paid in full
                hopeful.append(w)
            if low * step - costs[w - 1] - spread > 0 and mean / costs[w - 1] > rate:
                best, rate = w, mean / costs[w - 1]
    if best > 1:
        return Choice(best)
    # A probe looks at a width that could pay were its drafts right (each row's whole width
    # accepted), and over the tokens left could win back what it loses were they all wrong;
    # until a speculative cycle was timed here, the cheapest width looks (the calibration may
    # be stale). The best by the estimate among those the bank can pay for: where the
    # estimate says a width pays but the floor does not trust it yet, as soon as the bank
    # is not in debt (what it really loses is taken after); else what it could lose.
    wake = catch if wake is None else wake
    loss = {w: costs[w - 1] - plain + wake for w in range(2, len(costs) + 1)}
    full = {w: sum(min(w, r.left) for r in rows) for w in loss}
    useful = [
        w
        for w in loss
        if loss[w] < max(left - w, 0) * n / full[w] * (full[w] * step - costs[w - 1])
    ]
    if not looked and not useful and left > 2:
        useful = [min(loss, key=loss.get)]
    if not useful:
        return Choice(1)
    need = {w: 0.0 if w in hopeful else loss[w] for w in useful}
    ready = [w for w in useful if bank >= need[w]]
    if ready:
        w = max(ready, key=lambda w: sum(r.tokens(w) for r in rows) / costs[w - 1])
        return Choice(w, probe=True, wait=0.0)
    # The first step any of them could be paid for (fewer tokens left only removes some).
    return Choice(1, wait=(min(need.values()) - bank) / (PROBE_SHARE * plain))


class AutoPolicy:
    """The automatic width of a pair's requests (`port.Policy`): one per pair and draft block,
    carried across requests (costs are the device's; acceptance, pooled, the draft's)."""

    def __init__(self, curves: CostCurves, block: int, *, draft_block: int | None = None):
        if len(curves.verify) < block:
            raise ValueError(f"cost curves cover {len(curves.verify)} widths, need {block}")
        if draft_block is not None and not 2 <= draft_block <= block:
            raise ValueError(f"draft_block {draft_block} must be in 2..{block}")
        self.block, self.draft_block, self.window = block, draft_block, WINDOW
        self.table = CostTable(curves)
        self.pool = Ticket([0.0] * block, [0.0] * block)
        self.bank = 0.0
        self.probes = 0

    # -- reading (nothing changes) ---------------------------------------------------------

    def estimate(self, ask: Ask) -> Estimate:
        """A row's alphas: its own evidence over the pooled (as a prior of at most
        `POOLED_CYCLES` cycles) over the position before it (a position little tried reads
        as its neighbour), over `PRIOR`."""
        own, pool = ask.ticket, self.pool
        alphas, sds, prev = [], [], PRIOR
        for j in range(1, self.block):
            s = PRIOR_STRENGTH
            prior = (pool.hits[j] + s * prev) / (pool.trials[j] + s)
            weight = min(pool.trials[j], POOLED_CYCLES) + s
            n = own.trials[j] + weight
            a = (own.hits[j] + weight * prior) / n
            alphas.append(a)
            sds.append(math.sqrt(a * (1.0 - a) / (n + 1.0)))
            prev = a
        seen = own.trials[1] + pool.trials[1] > 0
        return Estimate(tuple(alphas), tuple(sds), max(ask.left, 1), seen)

    def block_for(self, width: int, depth: int) -> int:
        """The draft block L a width drafts: fixed, else the cheapest block covering it."""
        if self.draft_block:
            return self.draft_block
        draft = self.table.curves.at(depth)[1]
        return min(range(width, self.block + 1), key=lambda n: draft[n - 1])

    def costs(self, rows: int, depth: int) -> list[float]:
        top = self.draft_block or self.block
        return [
            self.table.cost(Shape(rows, w, self.block_for(w, depth), depth))
            for w in range(1, top + 1)
        ]

    def plan(self, asks: list[Ask], rows: int = 0) -> Plan:
        depth = max(a.depth for a in asks)
        costs = self.costs(max(rows, len(asks)), depth)
        lazy = sum(a.lazy for a in asks)
        catch = self.table.catch_up(sum(a.behind for a in asks), lazy, depth)
        # A probe wakes a dormant draft on a window of context, captured just before it: priced
        # so, the bank is not outrun by the rows captured while it fills.
        wake = self.table.catch_up(len(asks) * self.window, lazy, depth)
        est = [self.estimate(a) for a in asks]
        c = choose(costs, est, catch, self.bank, self.table.looked, wake)
        if c.probe and not all(a.ticket.capture for a in asks):
            # A dormant draft is woken a window before its probe, which then reads fresh
            # context (the window's rows), not a gap.
            return Plan((1,) * len(asks), (1,) * len(asks), True, False, self.window - 1)
        widths = tuple(max(1, min(c.width, a.left)) for a in asks)
        blocks = (self.block_for(c.width, depth) if c.width > 1 else 1,) * len(asks)
        # Plain steps keep the draft's context current only within a window before a probe;
        # the plan stands for as long as nothing it rests on moves but the bank.
        wait = c.wait if c.width == 1 else 0.0
        capture = c.width > 1 or wait <= self.window
        stands = (
            0
            if c.width > 1
            else int(min(wait - self.window - 1 if not capture else wait - 1, 1 << 20))
        )
        return Plan(widths, blocks, capture, c.probe, max(stands, 0))

    # -- learning --------------------------------------------------------------------------

    def begin(self, tokens: int | None) -> Ticket:
        return Ticket([0.0] * self.block, [0.0] * self.block, tokens)

    def learn(self, record: Record) -> None:
        rows = record.rows or len(record.asks)
        width = max(record.widths, default=1)
        shape = Shape(rows, width, record.block or 1, record.depth)
        if record.caught and record.costs:
            self.table.learn_catch_up(
                record.caught, record.lazy, record.depth, record.caught_seconds
            )
        if record.seconds is not None and record.costs:
            self.table.learn(shape, record.seconds, record.times)
        plain = self.table.cost(Shape(rows, 1, 1, record.depth))
        if width == 1:
            top = self.costs(rows, record.depth)
            # What one probe of the widest width can lose: more is not saved up.
            self.bank = min(
                self.bank + PROBE_SHARE * plain * record.times,
                top[-1] - plain + self.table.catch_up(self.window, 0, record.depth),
            )
            return
        spent = record.seconds if record.seconds is not None else self.table.cost(shape)
        committed = sum(n + 1 for n in record.accepted) / rows
        lost = spent + record.caught_seconds - committed * plain
        if record.probe:
            self.probes += 1
            for a in record.asks:
                a.ticket.probes += 1
        if record.probe or lost > 0:
            self.bank -= max(lost, 0.0)  # what speculation really lost is looking's
        for a, w, n in zip(record.asks, record.widths, record.accepted):
            if w > 1:
                for t in (a.ticket, self.pool):
                    teach(t, w, min(n, w - 1))

    def forget(self) -> None:
        self.pool = Ticket([0.0] * self.block, [0.0] * self.block)
        self.bank, self.table = 0.0, CostTable(self.table.curves)


def teach(t: Ticket, width: int, accepted: int) -> None:
    """A cycle verified `width` tokens of which `accepted` drafts were right."""
    t.trials[:] = [x * DECAY for x in t.trials]
    t.hits[:] = [x * DECAY for x in t.hits]
    for j in range(1, min(accepted + 1, width - 1) + 1):
        t.trials[j] += 1.0
        t.hits[j] += j <= accepted
