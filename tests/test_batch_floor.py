"""The batch's width choice on a fake clock (issue 35, the cells "alone" and "4 concurrent"):
requests of different lengths decode together through one `AutoPolicy` (asked about
every row, priced at the whole pass, taught by each cycle's `Record`), as `BatchDecoder`
drives it, on a device whose passes cost what the test says. Where batched speculation
cannot pay, the batch decodes within a few percent of plain batching; where it pays, near
the best fixed width; a stale calibration is unlearnt."""

from __future__ import annotations

import random
import statistics

import pytest

from dflash_mlx.speed.costs import CostCurves
from dflash_mlx.speed.policy import AutoPolicy
from dflash_mlx.speed.port import Ask, Record

BLOCK = 16
LENGTHS = [96, 40, 64, 24]  # tokens each request asks for: the batch shrinks as they end


class Device:
    """What passes cost: the target over `tokens` tokens (all rows' blocks together) and
    the draft over `rows` block rows, plus a fixed host cost per speculative cycle."""

    def __init__(self, verify, draft, host: float = 0.05):
        self.verify, self.draft, self.host = verify, draft, host

    def cycle(self, rows: int, width: int, length: int) -> float:
        if width == 1:
            return self.verify(rows)
        return self.verify(rows * width) + self.draft(rows * length) + self.host

    def curves(self) -> CostCurves:
        """A request alone, as calibration measures it."""
        return CostCurves(
            tuple(self.verify(w) for w in range(1, BLOCK + 1)),
            (0.0,) + tuple(self.draft(n) for n in range(2, BLOCK + 1)),
        )


STEEP = Device(lambda t: 1.0 * t, lambda n: 0.25 * n)  # compute-bound: nothing pays
FLAT = Device(lambda t: 1.0 + 0.03 * t, lambda n: 0.1 + 0.01 * n)  # memory-bound


def decode(
    device: Device,
    calibrated: Device,
    alpha: float,
    fixed=None,
    seed=0,
    lengths: list[int] = LENGTHS,
    alphas: list[float] | None = None,
    policy: AutoPolicy | None = None,
) -> float:
    """Tokens per second of a batch of requests of `lengths` tokens, each draft right with
    probability `alpha` per position (`alphas`: each row's own), at the automatic width (or
    at `fixed`, a width for every cycle), until the last row ends (`policy`: the pair's,
    carried from earlier batches)."""
    rng = random.Random(seed)
    policy = policy or AutoPolicy(calibrated.curves(), BLOCK)
    rows = [[policy.begin(n), n, a] for n, a in zip(lengths, alphas or [alpha] * len(lengths))]
    made = seconds = 0.0
    while rows:
        size = len(rows)
        asks = tuple(Ask(t, 200, left) for t, left, _ in rows)
        probe, times = False, 1
        if fixed is None:
            plan = policy.plan(list(asks), rows=size)
            widths, length, probe = plan.widths, plan.blocks[0], plan.probe
            if max(widths) == 1:
                times = min(plan.stands + 1, *(left for _, left, _ in rows))
        else:
            widths, length = tuple(min(fixed, left) for _, left, _ in rows), fixed
        width = max(widths)
        accepted = []
        for (_, _, a), w in zip(rows, widths):
            n = 0
            while n < w - 1 and rng.random() < a:
                n += 1
            accepted.append(n)
        spent = device.cycle(size, width, length)
        seconds += spent * times
        if fixed is None:
            policy.learn(
                Record(
                    asks,
                    widths,
                    tuple(accepted),
                    200,
                    spent,
                    block=length if width > 1 else 1,
                    times=times,
                    rows=size,
                    probe=probe,
                )
            )
        for r, n in zip(rows, accepted):
            got = n + 1 if width > 1 else times
            r[1] -= got
            made += got
        rows = [r for r in rows if r[1] > 0]
    return made / seconds


def best_fixed(device: Device, alpha: float) -> float:
    return max(decode(device, device, alpha, fixed=w) for w in (1, 2, 3, 4, 6, 8, 12, 16))


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("calibrated, floor", [("fresh", 0.95), ("stale", 0.9)])
def test_where_batched_speculation_cannot_pay_the_batch_decodes_plainly(alpha, calibrated, floor):
    """Compute-bound (a pass over rows x W tokens costs rows x W plain steps): near plain
    batching from a cold start, calibrated on this device, or on a memory-bound one (where
    each size's first cycle priced on that calibration lost up to half the batch's time:
    one size's finding now prices the others', and a wider width is tried a doubling at a
    time)."""
    cal = STEEP if calibrated == "fresh" else FLAT
    plain = decode(STEEP, STEEP, alpha, fixed=1)
    auto = sum(decode(STEEP, cal, alpha, seed=s) for s in range(3)) / 3
    assert auto >= floor * plain, f"{auto / plain:.3f}x plain batching"


NEAR_BEST = pytest.mark.xfail(
    strict=True,
    reason="library: a fresh batch on a memory-bound device runs 0.80x (alpha 0.6) and 0.88x "
    "(0.9) the best fixed width, seeds 0.65-0.98, was >= 0.88 (notes/tests-port.md, 5)",
)


@pytest.mark.parametrize(
    "alpha", [pytest.param(0.6, marks=NEAR_BEST), pytest.param(0.9, marks=NEAR_BEST)]
)
def test_where_batched_speculation_pays_the_batch_speculates_near_the_best_width(alpha):
    """Memory-bound (wide passes nearly free), calibrated here: near the best fixed width."""
    best = best_fixed(FLAT, alpha)
    plain = decode(FLAT, FLAT, alpha, fixed=1)
    auto = sum(decode(FLAT, FLAT, alpha, seed=s) for s in range(3)) / 3
    assert best > 1.3 * plain, "the device must make speculation pay for this to mean much"
    assert auto >= 0.88 * best, f"{auto / best:.3f}x the best fixed width"


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_where_batched_speculation_pays_the_batch_beats_plain_batching(alpha):
    """... and above plain batching, on average over seeds (one seed at alpha 0.6 is at
    1.00x plain, where the best fixed width gives 1.55x: notes/tests-port.md, 5). 1.1x:
    a first probe on the uniform prior alone is paid from the bank in full (1.13x at alpha
    0.6 since; on the 24-layer stand-in at c = 8 a free first probe on that prior, W=7
    over 8 rows, lost where no width pays)."""
    plain = decode(FLAT, FLAT, alpha, fixed=1)
    auto = sum(decode(FLAT, FLAT, alpha, seed=s) for s in range(3)) / 3
    assert auto >= 1.1 * plain, f"{auto / plain:.3f}x plain batching"


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_batches_on_a_stale_steep_calibration_find_that_speculation_pays(alpha):
    """Memory-bound, calibrated on a compute-bound device: the bank is the pair's policy's,
    carried across batches, so a look the first batch cannot afford comes in a later one;
    the batches after it speculate."""
    plain = decode(FLAT, FLAT, alpha, fixed=1)
    policy = AutoPolicy(STEEP.curves(), BLOCK)
    got = [decode(FLAT, STEEP, alpha, seed=s, policy=policy) for s in range(12)]
    assert max(got[-4:]) >= 1.1 * plain and min(got[-4:]) >= plain, [g / plain for g in got]


MID = Device(lambda t: 1.0 + 0.06 * t, lambda n: 0.1 + 0.01 * n)  # wide passes dear-ish


@pytest.mark.parametrize("alphas", [[0.1, 0.95, 0.95, 0.95], [0.1, 0.1, 0.95, 0.95]])
def test_the_rows_a_wave_leaves_decode_on_their_own_acceptance(alphas):
    """Four requests of 128 tokens decoded together (a wave, answered when its last row
    ends), some of whose drafts are nearly always right and the others' nearly never, on a
    device where a 4-row cycle at W = 16 costs 4.5 plain passes. The rows that draft well
    end first; the rows left go on with their own texts' acceptance, not the pool's that
    the departed rows made, on which the last row alone went on verifying 9-16 tokens a
    cycle for one each (0.81-0.83x plain batching; now 0.84-0.88x). What is left of the
    loss is the rows' mean pricing the batch's cycles while all four run: the laggard gets
    a token for 4.5 passes (settling by the slowest row was tried: on the demo pair it gave
    up c = 2's gains, docs/measurements.md)."""
    lengths = [128] * 4
    plain = decode(MID, MID, 0.0, fixed=1, lengths=lengths, alphas=alphas)
    auto = statistics.fmean(
        decode(MID, MID, 0.0, seed=s, lengths=lengths, alphas=alphas) for s in range(3)
    )
    assert auto >= 0.84 * plain, f"{auto / plain:.3f}x plain batching"
