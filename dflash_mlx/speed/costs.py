"""Cost curves (SPEC 5.4) and the pieces the width chooser prices cycles with.

`CostCurves` are what calibration measures on the device: seconds per verify pass of W
tokens and per draft pass of L rows, at a few context depths (interpolated between them,
extrapolated beyond). The chooser keeps what it measures online in depth buckets
(`_Bucket`), and prices widths it has not measured along the calibrated curve's shape
(`_between`). Pure Python on a few floats.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

BUCKET_BASE = 512  # depth buckets: [0, 512), [512, 1k), [1k, 2k), [2k, 4k), ...


def depth_bucket(depth: int) -> int:
    """The bucket online costs at context `depth` are kept in."""
    return 0 if depth < BUCKET_BASE else (depth // BUCKET_BASE).bit_length()


Curve = tuple[float, ...]


@dataclass(frozen=True)
class CostCurves:
    """Seconds per pass, measured on the running device.

    `verify[w - 1]`: the target on `w` tokens (w = 1 is a plain decoding step).
    `draft[l - 1]`: the draft on a block of `l` rows (l = 1 unused).
    Both at context depth `depths[0]`; `deeper[i]` holds `(verify, draft)` at `depths[i + 1]`
    (costs between are interpolated, beyond the last extrapolated along the last segment).
    """

    verify: Curve
    draft: Curve
    depths: tuple[int, ...] = (0,)
    deeper: tuple[tuple[Curve, Curve], ...] = ()
    # Seconds the draft takes to project one row of context (target features of a position
    # into its K/V cache); None: not measured (curves from before it was), estimated.
    context: float | None = None
    # Seconds per position the target's captured layers take when their features were left
    # unevaluated after its caches were (a dormant prefill's deferred window), at depths[0];
    # None: not measured, estimated.
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

    def context_row(self) -> float:
        """Seconds per context row the draft projects (as measured, else a draft pass's cost
        per row of its widest block: an overestimate)."""
        if self.context is not None:
            return self.context
        return self.draft[-1] / len(self.draft)

    def lazy_row(self, depth: int) -> float:
        """Seconds per deferred position at `depth`: as measured at the shallowest depth,
        scaled as a full verify's cost grows with depth (else a quarter of a wide verify's
        cost per token: the layers a draft reads that the caches did not need)."""
        wide = self.at(depth)[0][-1]
        if self.lazy is None:
            return wide / len(self.verify) / 4
        return self.lazy * wide / self.at(self.depths[0])[0][-1]

    def at(self, depth: int) -> tuple[Curve, Curve]:
        """`(verify, draft)` at context `depth`."""
        tables = ((self.verify, self.draft), *self.deeper)
        if len(tables) == 1 or depth <= self.depths[0]:
            return tables[0]
        i = min(bisect.bisect_right(self.depths, depth), len(self.depths) - 1)
        (d0, (v0, r0)), (d1, (v1, r1)) = (
            (self.depths[i - 1], tables[i - 1]),
            (self.depths[i], tables[i]),
        )
        f = (depth - d0) / (d1 - d0)  # > 1 beyond the last depth: extrapolated

        def mix(a: Curve, b: Curve) -> Curve:
            # Costs never fall with depth: a noisy deeper point does not extrapolate down.
            return tuple(
                max(x + f * (y - x), x) if f > 1 else x + f * (y - x) for x, y in zip(a, b)
            )

        return mix(v0, v1), mix(r0, r1)


class CatchUp:
    """What catching a draft's context up costs before a speculative cycle (after plain
    steps, or a dormant prefill): `rows` rows to project, `lazy` positions of which still
    need the target's captured layers (a dormant prefill's deferred window). Predicted from
    the calibration (the projection per row, the deferred layers per position, both
    measured) and scaled by what catch-ups measured against that (decayed; a stalled one
    moves it by at most a factor of two)."""

    def __init__(self, costs: CostCurves, block: int):
        self.costs = costs
        self.block = block
        self.ratio = 1.0  # measured / predicted
        self.seen = 0

    def predicted(self, rows: int, lazy: int, depth: int) -> float:
        return rows * self.costs.context_row() + lazy * self.costs.lazy_row(depth)

    def cost(self, rows: int, lazy: int, depth: int) -> float:
        return self.ratio * self.predicted(rows, lazy, depth) if rows > 0 or lazy > 0 else 0.0

    def observe(self, rows: int, lazy: int, seconds: float, depth: int) -> None:
        predicted = self.predicted(rows, lazy, depth)
        if seconds <= 0 or predicted <= 0:
            return
        r, spread = self.ratio, 3.0 if not self.seen else 2.0
        self.seen += 1
        self.ratio += (min(max(seconds / predicted, r / spread), r * spread) - r) / min(
            self.seen + 1, 4
        )


class _Bucket:
    """Online costs in one depth bucket: per width, measured / calibrated seconds (`ratio`,
    an exponentially decayed mean of the cycles seen), and how many cycles were seen."""

    __slots__ = ("ratio", "count", "seen")

    def __init__(self, block: int):
        self.ratio = [0.0] * (block + 1)  # index w
        self.count = [0] * (block + 1)
        self.seen = [False] * (block + 1)

    def widths(self) -> list[int]:
        return [w for w in range(2, len(self.seen)) if self.seen[w]]


def _between(cal: list[float], lo: int, hi: int, y_lo: float, y_hi: float, w: int) -> float:
    """The cost of width `w` on the line through the measured costs of widths `lo` < `hi`,
    spaced as the calibration spaces them (in widths where it is flat); never falling with
    `w` beyond `hi`."""
    x_lo, x_hi, x = cal[lo - 1], cal[hi - 1], cal[w - 1]
    if x_hi - x_lo > 1e-12:
        f = (x - x_lo) / (x_hi - x_lo)
    else:
        f = (w - lo) / (hi - lo)
    y = y_lo + f * (y_hi - y_lo)
    return max(y, y_hi) if w > hi else y


def _depth_key(depth: int) -> int:
    """Depths within ~6% of each other share cached costs (recomputed as the context grows:
    a decision's price at one depth holds for the next few dozen tokens; recomputed every
    few tokens it cost a dormant step ~50 us of host time)."""
    return int(math.log(depth + 64) * 16)


def nearest(buckets: dict[int, _Bucket], b: int, test: Callable[[_Bucket], bool]) -> _Bucket | None:
    """The bucket nearest to `b` (itself first, then the shallower side) passing `test`."""
    for k in sorted(buckets, key=lambda k: (abs(k - b), k)):
        if test(buckets[k]):
            return buckets[k]
    return None


def measured_curve(
    cal: list[float], buckets: dict[int, _Bucket], b: int, optimistic: bool, kin: float = 0.0
) -> list[float]:
    """Seconds per cycle of each width (index w - 1) in depth bucket `b`, `cal` the calibrated
    ones there: see `WidthChooser.curve`. `kin`: before any speculative width is measured,
    how far (log ratio) other choosers of the pair found speculative cycles from their
    calibration (`WidthChooser.kin`)."""
    src = nearest(buckets, b, lambda k: k.seen[1])
    # Speculative widths measured in this bucket; with fewer than two, those of the
    # nearest bucket that has two (its own win): the shape is what carries over.
    own = buckets.get(b)
    ratio: dict[int, float] = {}
    if own is None or len(own.widths()) < 2:
        other = nearest(buckets, b, lambda k: len(k.widths()) >= 2)
        if other is not None:
            ratio = {w: other.ratio[w] for w in other.widths()}
    if own is not None:
        ratio |= {w: own.ratio[w] for w in own.widths()}
    known = sorted(ratio)
    # Plain steps as measured; never measured yet: as calibrated, but no dearer than
    # a speculative cycle measured (which runs at least the same pass).
    rp = src.ratio[1] if src is not None else 1.0
    plain = rp * cal[0]
    if src is None and known:
        plain = min(plain, min(ratio[w] * cal[w - 1] for w in known))
    out = [plain]
    for w in range(2, len(cal) + 1):
        x = cal[w - 1]
        if not known:
            # Nothing measured: the calibration, scaled as plain steps are and as other
            # sizes of the batch found speculative cycles.
            c = rp * x * math.exp(kin)
        elif w in ratio:
            c = ratio[w] * x
        else:
            i = bisect.bisect(known, w)
            if i == 0:  # below every measured width: the calibrated shape, rescaled
                c = ratio[known[0]] * x
            elif i < len(known):  # between two: along the calibrated shape
                lo, hi = known[i - 1], known[i]
                c = _between(cal, lo, hi, ratio[lo] * cal[lo - 1], ratio[hi] * cal[hi - 1], w)
            elif len(known) == 1:
                # Only one width measured yet: one up to twice as wide is priced no dearer
                # than it, so a calibration that is too steep is found out by trying one, a
                # doubling at a time (beyond, the calibrated shape: a batch of 4 rows that
                # jumped from W=4 to W=16 on a compute-bound device lost 80 steps' time in
                # one cycle).
                c = ratio[known[0]] * x
                if optimistic and w <= 2 * known[0]:
                    c = min(c, ratio[known[0]] * cal[known[0] - 1])
            else:  # beyond the widest: along the last measured segment
                lo, hi = known[-2], known[-1]
                c = _between(cal, lo, hi, ratio[lo] * cal[lo - 1], ratio[hi] * cal[hi - 1], w)
        out.append(max(c, plain))  # a cycle costs at least a plain step
    return out


class Floor:
    """What speculation has really given on this device lately, against plain decoding as
    measured on it now: the floor under the width chooser (SPEC 5.4).

    Each speculative cycle (chain or tree), timed sync to sync, is settled against what
    plain decoding would have taken for the tokens it committed (the measured plain step
    at that depth, times its tokens), and each catch-up of the draft's context is charged as
    time that committed nothing. `net` is the decayed mean of seconds saved per speculative
    cycle (negative: lost). While it is negative with enough evidence (`losing`), the
    chooser speculates only as probes it budgets at what cycles really lost (not what its
    cost model predicted), and the interval between probes keeps growing across requests:
    a machine where speculation cannot pay loses at most the probe budget to finding out.
    Whatever the cost model's error (a stale calibration, trees it does not price, host
    work it does not see), the realized figures decide."""

    def __init__(self, decay: float = 0.9, evidence: float = 4.0):
        self.decay = decay  # per speculative cycle
        self.evidence = evidence  # decayed cycles needed before `losing` can hold
        self.saved = 0.0  # decayed seconds saved against plain decoding
        self.weight = 0.0  # decayed speculative cycles
        self.plain = 0.0  # decayed seconds plain decoding would have taken for their tokens
        self.last = 0.0  # seconds the latest speculative cycle saved (negative: lost)

    def settle(self, tokens: int, seconds: float, plain_step: float) -> float:
        """A speculative cycle committed `tokens` in `seconds`; a plain step costs
        `plain_step` seconds here now. Returns the seconds it saved (negative: lost)."""
        gain = tokens * plain_step - seconds
        self.last = gain
        d = self.decay
        self.saved = d * self.saved + gain
        self.plain = d * self.plain + tokens * plain_step
        self.weight = d * self.weight + 1.0
        return gain

    def charge(self, seconds: float) -> None:
        """A catch-up of the draft's context took `seconds` (nothing committed)."""
        self.saved -= seconds

    @property
    def net(self) -> float:
        """Decayed mean seconds saved per speculative cycle (0.0 before any)."""
        return self.saved / self.weight if self.weight > 0 else 0.0

    @property
    def losing(self) -> bool:
        """Whether speculation has recently lost against plain decoding, on evidence, by
        more than 2% of what plain decoding would have taken (a tie is not a loss: it keeps
        speculating where that costs the same)."""
        return self.weight >= self.evidence and self.saved < -0.02 * self.plain

    def cycle_loss(self) -> float:
        """Seconds a speculative cycle has lately lost against plain decoding (0.0 while
        speculation pays)."""
        return max(-self.net, 0.0) if self.losing else 0.0
