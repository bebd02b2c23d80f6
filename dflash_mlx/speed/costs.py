"""What a pass costs (SPEC 5.4, docs/cost-model.md#automatic-width): the calibration's curves,
kept current by every pass the engine runs.

`CostCurves` is what calibration measures once per pair, device and conditions: seconds per
target pass of W tokens and per draft pass of an L-row block, at a few context depths.
`CostTable` prices any cycle from them (rows x width tokens through the target, a draft pass
per row) and keeps a measured / calibrated ratio per pass shape (plain or speculative, tokens,
depth bucket), so a stale calibration (another BLAS, a busy machine, Low Power Mode) is
unlearnt by the passes themselves: nothing is re-measured while anyone waits. Pure Python.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

BUCKET_BASE = 512  # depth buckets: [0, 512), [512, 1k), [1k, 2k), [2k, 4k), ...
# Weight of a new measurement in its shape's ratio: a few passes make a new truth, one stall
# (GC, another process) only a nudge; a measurement counts at most `SPREAD` x off the estimate.
SMOOTHING = 0.2
SPREAD = 3.0

Curve = tuple[float, ...]


def depth_bucket(depth: int) -> int:
    """The bucket costs measured at context `depth` are kept in."""
    return 0 if depth < BUCKET_BASE else (depth // BUCKET_BASE).bit_length()


@dataclass(frozen=True)
class CostCurves:
    """Seconds per pass, measured on the device (the calibration's file format).

    `verify[w - 1]`: the target on `w` tokens (w = 1: a plain step, chained as the engine runs
    them). `draft[l - 1]`: the draft on a block of `l` rows. Both at `depths[0]`; `deeper[i]`
    holds `(verify, draft)` at `depths[i + 1]` (interpolated between, extrapolated beyond).
    `context`: seconds the draft projects one context row; `lazy`: seconds per position the
    target's captured layers take when a dormant prefill deferred them (None: estimated).
    """

    verify: Curve
    draft: Curve
    depths: tuple[int, ...] = (0,)
    deeper: tuple[tuple[Curve, Curve], ...] = ()
    context: float | None = None
    lazy: float | None = None

    def __post_init__(self) -> None:
        if len(self.deeper) != len(self.depths) - 1:
            raise ValueError(
                f"cost curves at {len(self.depths)} depths need {len(self.depths) - 1} deeper "
                f"pairs, got {len(self.deeper)}"
            )
        if any(b <= a for a, b in zip(self.depths, self.depths[1:])) or self.depths[0] < 0:
            raise ValueError(f"depths {self.depths} must be increasing and >= 0")
        for verify, draft in ((self.verify, self.draft), *self.deeper):
            if not verify or len(verify) != len(draft) or len(verify) != len(self.verify):
                raise ValueError(
                    f"cost curves need equal, non-empty verify ({len(verify)}) and draft "
                    f"({len(draft)}) lengths"
                )
            if any(t <= 0 for t in verify) or any(t < 0 for t in draft):
                raise ValueError("cost curves must hold positive times")
        for name in ("context", "lazy"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} cost {value} must be >= 0 seconds per row")

    def at(self, depth: int) -> tuple[Curve, Curve]:
        """`(verify, draft)` at context `depth` (never falling with depth beyond the last)."""
        tables = ((self.verify, self.draft), *self.deeper)
        if len(tables) == 1 or depth <= self.depths[0]:
            return tables[0]
        i = min(bisect.bisect_right(self.depths, depth), len(self.depths) - 1)
        d0, d1 = self.depths[i - 1], self.depths[i]
        f = (depth - d0) / (d1 - d0)

        def mix(a: Curve, b: Curve) -> Curve:
            return tuple(
                max(x + f * (y - x), x) if f > 1 else x + f * (y - x) for x, y in zip(a, b)
            )

        return mix(*(t[0] for t in tables[i - 1 : i + 1])), mix(
            *(t[1] for t in tables[i - 1 : i + 1])
        )

    def target(self, tokens: int, depth: int) -> float:
        """One target pass over `tokens` tokens (a batch's rows x width), beyond the curve
        along its last segment."""
        curve = self.at(depth)[0]
        if tokens <= len(curve):
            return curve[tokens - 1]
        slope = curve[-1] - curve[-2] if len(curve) > 1 else curve[-1]
        return curve[-1] + max(slope, 0.0) * (tokens - len(curve))

    def drafting(self, rows: int, block: int, depth: int) -> float:
        """One draft pass of `rows` rows, an L = `block` block each."""
        return rows * self.at(depth)[1][block - 1]

    def catch_up(self, rows: int, lazy: int, depth: int) -> float:
        """Feeding a dormant draft `rows` context rows, `lazy` of them not yet computed by the
        target's captured layers (estimated, when not measured, from a draft pass per row and a
        quarter of a wide verify per position)."""
        row = self.context if self.context is not None else self.draft[-1] / len(self.draft)
        wide = self.at(depth)[0][-1]
        per = (
            self.lazy * wide / self.verify[-1]
            if self.lazy is not None
            else wide / len(self.verify) / 4
        )
        return rows * row + lazy * per


@dataclass(frozen=True)
class Shape:
    """A cycle's passes: `rows` rows verifying `width` tokens each at context `depth`, each
    drafting an L = `block` block (width 1: a plain step, no draft pass)."""

    rows: int
    width: int
    block: int
    depth: int


def _update(table: dict, key, old: float, seen: float, times: int = 1) -> None:
    """A measured ratio into `table[key]`: at most `SPREAD` x off `old`, a decayed mean."""
    new = min(max(seen, old / SPREAD), old * SPREAD)
    table[key] = new if key not in table else old + (1 - (1 - SMOOTHING) ** times) * (new - old)


def _nearest(table: dict, rows: int, tokens: int, bucket: int) -> float | None:
    """The entry of the shape nearest (depth first, then tokens, a wider one dearer)."""

    def distance(k: tuple[int, int, int]) -> tuple[int, float]:
        up = math.log2(k[1] / tokens)
        return abs(k[2] - bucket), abs(up) + (0.5 if up > 0 else 0.0) + abs(math.log2(k[0] / rows))

    return table[min(table, key=distance)] if table else None


class CostTable:
    """Seconds a cycle costs here now. Plain steps: the calibration times what plain steps of
    as many rows (or the nearest measured) took against it: how fast the device runs now
    (a busy machine, another BLAS). Speculative cycles: that, times how much dearer than the
    calibration says, relative to plain steps then, their shape (or the nearest, narrower
    first: a wider width is found out by trying it) was measured: so what load does to
    every pass is learnt from the plain steps alone."""

    def __init__(self, curves: CostCurves):
        self.curves = curves
        self.plain: dict[tuple[int, int, int], float] = {}  # (rows, rows, bucket) -> ratio
        self.relative: dict[tuple[int, int, int], float] = {}  # (rows, tokens, bucket)
        self.catch_ratio: float | None = None

    def calibrated(self, shape: Shape) -> float:
        c, d = self.curves, shape.depth
        spent = c.target(shape.rows * shape.width, d)
        return spent + (c.drafting(shape.rows, shape.block, d) if shape.width > 1 else 0.0)

    def speed(self, rows: int, depth: int) -> float:
        """Measured / calibrated seconds of plain steps of `rows` rows near `depth` (1.0
        before any is measured)."""
        got = _nearest(self.plain, rows, rows, depth_bucket(depth))
        return 1.0 if got is None else got

    def scale(self, shape: Shape) -> float:
        plain = self.speed(shape.rows, shape.depth)
        if shape.width == 1:
            return plain
        tokens, bucket = shape.rows * shape.width, depth_bucket(shape.depth)
        rel = _nearest(self.relative, shape.rows, tokens, bucket)
        return plain * (1.0 if rel is None else rel)

    def cost(self, shape: Shape) -> float:
        """What `shape` costs. Beyond the widest width measured at its rows and depth, no
        dearer than the measured widths' line carried on (never falling), or, one alone
        measured, than that one up to twice its width: a calibration too steep for the
        device now is found out a cycle at a time (borrowed along the calibration's slope, a
        wider width would never look worth trying)."""
        got = self.scale(shape) * self.calibrated(shape)
        bucket = depth_bucket(shape.depth)
        known = sorted(k[1] // k[0] for k in self.relative if k[0] == shape.rows and k[2] == bucket)
        if shape.width == 1 or not known or shape.width <= known[-1]:
            return got

        def at(w: int) -> float:
            return self.cost(Shape(shape.rows, w, shape.block, shape.depth))

        if len(known) == 1:
            return min(got, at(known[0])) if shape.width <= 2 * known[0] else got
        (lo, hi), top = known[-2:], at(known[-1])
        slope = max((top - at(lo)) / (hi - lo), 0.0)
        return min(got, top + slope * (shape.width - hi))

    def catch_up(self, rows: int, lazy: int, depth: int) -> float:
        if rows <= 0 and lazy <= 0:
            return 0.0
        ratio = self.catch_ratio if self.catch_ratio is not None else 1.0
        return ratio * self.speed(1, depth) * self.curves.catch_up(rows, lazy, depth)

    def learn(self, shape: Shape, seconds: float, times: int = 1) -> None:
        """`times` cycles of `shape` took `seconds` each (sync to sync)."""
        if not seconds > 0 or times < 1:
            return
        seen, bucket = seconds / self.calibrated(shape), depth_bucket(shape.depth)
        if shape.width == 1:
            key = (shape.rows, shape.rows, bucket)
            _update(self.plain, key, self.speed(shape.rows, shape.depth), seen, times)
        else:
            key = (shape.rows, shape.rows * shape.width, bucket)
            plain = self.speed(shape.rows, shape.depth)
            _update(self.relative, key, self.scale(shape) / plain, seen / plain, times)

    def learn_catch_up(self, rows: int, lazy: int, depth: int, seconds: float) -> None:
        predicted = self.speed(1, depth) * self.curves.catch_up(rows, lazy, depth)
        if seconds > 0 and predicted > 0:
            old = self.catch_ratio if self.catch_ratio is not None else 1.0
            new = min(max(seconds / predicted, old / SPREAD), old * SPREAD)
            self.catch_ratio = new if self.catch_ratio is None else old + SMOOTHING * (new - old)

    @property
    def looked(self) -> bool:
        """Whether a speculative cycle has been timed (else its price is the calibration's)."""
        return bool(self.relative)
