"""Device cost profiles and a simulated clock (docs/cost-model.md#device-profiles).

A `Profile` says what a pass costs on a device: a target pass over T tokens at context depth
d, a draft pass of R rows of an L-row block. `SimClock` is a `BatchDecoder.clock` that charges
each pass the engine launches what the profile says, while tokens, acceptance and decisions
stay real: the automatic width can be checked against every fixed width on devices this
machine is not. Profiles:
- `stock`, `openblas`: this CPU's two regimes as measured (a pair's calibration curves);
- `m5`: a 27B 4-bit target on an Apple M5 Max with MLX's matmuls (TensorFold's Qwen3.8-27B
  recipe: a forward over 1 / 2 / 4 / 8 / 16 rows takes 32.9 / 35.2 / 49.2 / 86.8 / 112.6
  ms), a draft pass costing a tenth of a target pass over its rows (5 draft layers against
  64, the shared LM head; a context row a quarter of that), depth read at the bandwidth the
  1-row pass implies (about 15 GB of weights in 32.9 ms: ~450 GB/s) over a hybrid stack's
  KV cache (16 attention layers x 4 KV heads x 256 dims x K and V in fp16: 64 KiB a
  token): 0.14 us per token of context;
- `m5-fewrows`: the same with a kernel built for few rows (TensorFold's: 16 rows cost 1.15x
  one), MLX's slope beyond 16.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..engine.trace import Event
from ..speed.costs import CostCurves

M5_ROWS = (1, 2, 4, 8, 16)
M5_MS = (32.9, 35.2, 49.2, 86.8, 112.6)
M5_DEPTH_US = 0.14  # per token of context, per target pass
M5_DRAFT_SHARE = 0.1
# A context row the draft takes costs a quarter of a drafted row: its features projected and
# each draft layer's K and V, not the attention, MLP or LM head (about 13 of 60 h^2 a layer).
CONTEXT_SHARE = 0.25


@dataclass(frozen=True)
class Profile:
    """Seconds per pass: `points` (tokens, ms) at depth 0, linear between and beyond the last
    along its last segment; `depth_us` more per token of context; a draft pass a
    `draft_share` of the target's over as many rows; or, from measured `curves`, theirs."""

    name: str
    points: tuple[tuple[int, float], ...] = ()
    depth_us: float = 0.0
    draft_share: float = 0.0
    curves: CostCurves | None = None

    def target(self, tokens: int, depth: int) -> float:
        if self.curves is not None:
            return self.curves.target(max(tokens, 1), depth)
        xs = [p[0] for p in self.points]
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        ms = y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return max(ms, self.points[0][1]) / 1e3 + depth * self.depth_us / 1e6

    def draft(self, rows: int, block: int, depth: int) -> float:
        if self.curves is not None:
            return self.curves.drafting(rows, block, depth)
        return self.draft_share * self.target(block, 0) * rows

    def lazy(self, depth: int) -> float:
        """Seconds per position a dormant prefill deferred (a quarter of a wide verify's)."""
        return self.target(16, depth) / 16 / 4

    def charge(self, event: Event) -> float:
        """Seconds `event` costs on this device (0 for what launches no pass)."""
        k, d = event.kind, event.depth
        if k == "plain":
            return self.target(event.rows, d)
        if k == "verify" or k == "prefill":
            return self.target(event.tokens, d)
        if k == "draft":
            return self.draft(event.rows, event.block, d) if event.rows else 0.0
        if k == "catch-up":  # context rows projected in one pass, lazy rows' captured layers
            if self.curves is not None:
                return self.curves.catch_up(event.tokens, event.block, d)
            return (
                CONTEXT_SHARE * self.draft_share * self.target(event.tokens, d)
                + self.lazy(d) * event.block
            )
        return 0.0

    def as_curves(self, block: int, depths: tuple[int, ...] = (128, 2048, 8192)) -> CostCurves:
        """What calibrating on this device would measure."""
        if self.curves is not None:
            return self.curves

        def at(d: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
            verify = tuple(self.target(w, d) for w in range(1, block + 1))
            return verify, (0.0,) + tuple(self.draft(1, n, d) for n in range(2, block + 1))

        (v, dr), *deeper = [at(d) for d in depths]
        row = CONTEXT_SHARE * self.draft_share * self.target(16, 0) / 16  # one context row
        return CostCurves(v, dr, depths, tuple(deeper), context=row, lazy=self.lazy(0))


def m5(few_rows: bool = False) -> Profile:
    if not few_rows:
        return Profile("m5", tuple(zip(M5_ROWS, M5_MS)), M5_DEPTH_US, M5_DRAFT_SHARE)
    one, slope = M5_MS[0], (M5_MS[-1] - M5_MS[-2]) / (M5_ROWS[-1] - M5_ROWS[-2])
    pts = ((1, one), (16, 1.15 * one), (32, 1.15 * one + 16 * slope))
    return Profile("m5-fewrows", pts, M5_DEPTH_US, M5_DRAFT_SHARE)


class SimClock:
    """A `BatchDecoder.clock`: time advances by what each pass costs on `profile`."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.t = 0.0
        self.prefill = 0.0  # of which prompts' prefill

    def now(self) -> float:
        return self.t

    def charge(self, event: Event) -> None:
        spent = self.profile.charge(event)
        self.t += spent
        if event.kind == "prefill":
            self.prefill += spent


class SimCalibration:
    """A `Pair.calibration` that reads a profile's curves, as if calibrated on its device."""

    def __init__(self, curves: CostCurves):
        self.latest = curves

    def curves(self, **_) -> CostCurves:
        return self.latest

    def cached(self) -> CostCurves:
        return self.latest
