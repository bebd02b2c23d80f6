"""The batch's width choice on a fake clock (issue 35, the cells "alone" and "4 concurrent"):
requests of different lengths decode together through `batch_cycle.batch_chooser` and
`batch_cycle.learn`, as `BatchDecoder` drives them, on a device whose passes cost what the
test says. Where batched speculation cannot pay, the batch decodes within a few percent of
plain batching; where it pays, near the best fixed width; a stale calibration is unlearnt."""

from __future__ import annotations

import random

import pytest

from dflash_mlx import GenerateOptions
from dflash_mlx.engine import batch_cycle as bc
from dflash_mlx.speed.adaptive import CostCurves, WidthChooser

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


def row(chooser: WidthChooser, tokens: int):
    r = bc.Row([1], GenerateOptions(max_tokens=tokens), chooser=chooser, fixed=None)
    r.req = object()
    r.left, r.alpha = tokens, 0.0
    return r


def decode(device: Device, calibrated: Device, alpha: float, fixed=None, seed=0) -> float:
    """Tokens per second of a batch of `LENGTHS` requests, each draft right with probability
    `alpha` per position, at the automatic width (or at `fixed`, a width for every cycle)."""
    rng = random.Random(seed)
    base = WidthChooser(calibrated.curves(), BLOCK)
    known: dict = {}
    rows = [row(base, n) for n in LENGTHS]
    made = seconds = 0.0
    last = None
    while rows:
        size = len(rows)
        # As `BatchDecoder._chooser` does: a batch shrinking row by row goes on from the
        # last size's chooser.
        chooser = bc.batch_chooser(known, size, base, last)
        last = chooser
        budget = max(r.left for r in rows)
        if fixed is None:
            width, length = chooser.choose(limit=budget, depth=200)
        else:
            width, length = fixed, fixed
        results = []
        for r in rows:
            w = min(width, r.left)
            n = 0
            while n < w - 1 and rng.random() < alpha:
                n += 1
            results.append((n, [0] * (n + 1)))
        spent = device.cycle(size, width, length)
        seconds += spent
        if fixed is None:
            bc.learn(chooser, rows, [(width, length)] * size, results, width, spent)
        for r, (_, new) in zip(rows, results):
            r.left -= len(new)
            made += len(new)
        if any(r.left <= 0 for r in rows):
            rows = [r for r in rows if r.left > 0]
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


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_where_batched_speculation_pays_the_batch_speculates_near_the_best_width(alpha):
    """Memory-bound (wide passes nearly free), calibrated here: near the best fixed width."""
    best = best_fixed(FLAT, alpha)
    plain = decode(FLAT, FLAT, alpha, fixed=1)
    auto = sum(decode(FLAT, FLAT, alpha, seed=s) for s in range(3)) / 3
    assert best > 1.3 * plain, "the device must make speculation pay for this to mean much"
    assert auto >= 0.88 * best, f"{auto / best:.3f}x the best fixed width"


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_a_batch_on_a_stale_steep_calibration_finds_that_speculation_pays(alpha):
    """Memory-bound, calibrated on a compute-bound device: the batch's probe budget and the
    plain steps since its last probe carry on as rows leave (each size's chooser began with
    none, and a batch of short requests never afforded one probe: exactly plain)."""
    plain = decode(FLAT, FLAT, alpha, fixed=1)
    auto = sum(decode(FLAT, STEEP, alpha, seed=s) for s in range(3)) / 3
    assert auto >= 1.1 * plain, f"{auto / plain:.3f}x plain batching"
