"""The width chooser (SPEC 5.4) on synthetic costs, and the calibration cache."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

import dflash_mlx
import dflash_mlx.calibration as calibrate
from dflash_mlx import Pair
from dflash_mlx.speed.adaptive import FIRST_LOOK, CostCurves, WidthChooser

BLOCK = 16


def curves(verify, draft) -> CostCurves:
    return CostCurves(
        tuple(verify(w) for w in range(1, BLOCK + 1)), tuple(draft(n) for n in range(1, BLOCK + 1))
    )


FLAT = curves(lambda w: 1.0 + 0.02 * w, lambda n: 0.1)  # a memory-bound GPU
STEEP = curves(lambda w: 1.0 * w, lambda n: 0.25 * n)  # a compute-bound CPU


def teach(chooser: WidthChooser, alpha: float, cycles: int = 400, width: int = BLOCK) -> None:
    """Feed cycles whose drafted tokens are each accepted with conditional rate alpha
    (deterministically: the expected acceptance pattern, not random draws)."""
    for _ in range(cycles):
        n = 0
        reach = 1.0
        for _j in range(1, width):
            reach *= alpha
            if reach >= 0.5:
                n += 1
        chooser.update(width, n)


def analytic_best(costs: CostCurves, alphas: list[float]) -> int:
    """argmax over W of E[tokens | W] / (t_draft + t_verify), written out independently."""
    best, best_rate = 1, 1.0 / costs.verify[0]
    for w in range(2, BLOCK + 1):
        expected = 1.0 + sum(math.prod(alphas[:i]) for i in range(1, w))
        draft = min(costs.draft[w - 1 : BLOCK])
        rate = expected / (costs.verify[w - 1] + draft)
        if rate > best_rate:
            best, best_rate = w, rate
    return best


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.9, 0.99])
def test_chooser_picks_the_analytically_best_width(costs, alpha):
    ch = WidthChooser(costs, BLOCK)
    # Set the statistics to a known profile directly: many trials at each position.
    ch.trials = [0.0] + [1e6] * (BLOCK - 1)
    ch.hits = [0.0] + [alpha * 1e6] * (BLOCK - 1)
    w, n = ch.choose()
    assert w == analytic_best(costs, [alpha] * (BLOCK - 1)), (w, alpha)
    assert w == 1 or n >= w


def test_flat_costs_go_wide_and_steep_costs_go_narrow():
    flat = WidthChooser(FLAT, BLOCK)
    teach(flat, 0.95)
    steep = WidthChooser(STEEP, BLOCK)
    teach(steep, 0.3)
    assert flat.choose()[0] >= 12
    assert steep.choose()[0] == 1


def test_chooser_adapts_when_acceptance_changes():
    ch = WidthChooser(FLAT, BLOCK)
    teach(ch, 0.97)
    wide = ch.choose()[0]
    teach(ch, 0.0, cycles=100, width=wide)
    narrow = ch.choose()[0]
    assert wide >= 12 and narrow <= 2, (wide, narrow)
    teach(ch, 0.97, cycles=60, width=max(narrow, 2))
    assert ch.choose()[0] >= 8, "good drafts again: the width grows back"


def test_draft_block_is_the_cheapest_block_that_covers_w():
    costs = curves(lambda w: 1.0, lambda n: 0.5 if n == 16 else 0.1 * n)
    ch = WidthChooser(costs, BLOCK)
    ch.trials, ch.hits = [0.0] + [1e6] * 15, [0.0] + [0.9e6] * 15
    w, n = ch.choose()
    assert n == (16 if 0.1 * w > 0.5 else w)
    fixed = WidthChooser(costs, BLOCK, draft_block=16)
    fixed.trials, fixed.hits = ch.trials, ch.hits
    assert fixed.choose()[1] == 16
    short = WidthChooser(costs, BLOCK, draft_block=4)
    short.trials, short.hits = ch.trials, ch.hits
    assert short.choose() == (4, 4), "W never exceeds a fixed draft block"


def simulate_never_right(ch: WidthChooser, steps: int) -> tuple[int, float, float]:
    """Run the chooser like the engine with a draft that is never right, on the cost the
    curves give: (probes, seconds lost by probes against plain decoding, total seconds)."""
    probes, lost, total = 0, 0.0, 0.0
    for _ in range(steps):
        w, n = ch.choose()
        if w > 1:
            probes += 1
            cost = ch.costs.verify[w - 1] + ch.costs.draft[n - 1]
            lost += cost - ch.costs.verify[0]  # it made one token, as a plain step would
            ch.observe(w, cost)
            ch.update(w, 0)
        else:
            cost = ch.costs.verify[0]
            ch.observe(1, cost)
        total += cost
    return probes, lost, total


def test_plain_decoding_is_probed_rarely_with_backoff():
    ch = WidthChooser(STEEP, BLOCK)
    probes, lost, total = simulate_never_right(ch, 20000)
    assert probes >= 5, "speculation is still re-tried now and then"
    assert lost / total < 0.02, f"probes lost {lost / total:.1%} of the time"
    cap = ch.probe_cap(2)
    assert ch.probe_interval == cap > 32, (ch.probe_interval, cap)


def test_cheap_probes_are_retried_more_often_than_costly_ones():
    cheap = curves(lambda w: 1.0 + 0.1 * (w - 1), lambda n: 0.05)  # a probe loses ~0.15 steps
    costly = curves(lambda w: 1.0 * w, lambda n: 1.0)  # a probe loses >= 2 steps
    counts = []
    for costs in (cheap, costly):
        ch = WidthChooser(costs, BLOCK)
        probes, lost, total = simulate_never_right(ch, 20000)
        assert lost / total < 0.02, f"probes lost {lost / total:.1%} of the time"
        counts.append(probes)
    assert counts[0] > 4 * counts[1], counts


def test_plain_steps_capture_features_only_in_the_window_before_a_probe():
    ch = WidthChooser(STEEP, BLOCK, window=16)
    trace = []
    for _ in range(5000):
        w, n = ch.choose()
        trace.append((w, ch.capture))
        if w > 1:
            ch.observe(w, STEEP.verify[w - 1] + STEEP.draft[n - 1])
            ch.update(w, 0)
        else:
            ch.observe(1, STEEP.verify[0])
    late = trace[2500:]  # the probe interval has long outgrown the window
    assert sum(c for _, c in late) < 0.3 * len(late), "dormant plain steps still capture"
    probes = [i for i, (w, _) in enumerate(trace) if w > 1]
    for i in probes[3:]:
        assert all(c for _, c in trace[i - 16 : i + 1]), "a probe without a window of context"


def test_a_probe_that_finds_good_drafts_switches_back_to_speculation():
    costs = curves(lambda w: 1.0 + 0.1 * w, lambda n: 0.3)
    ch = WidthChooser(costs, BLOCK, prior=0.05)
    assert ch.choose()[0] == 1
    for _ in range(200):
        w, _ = ch.choose()
        if w > 1:
            ch.update(w, w - 1)  # every probe finds all drafts accepted
    assert ch.choose()[0] > 1


def test_budget_limit_caps_the_width():
    ch = WidthChooser(FLAT, BLOCK)
    teach(ch, 0.95)
    assert ch.choose(limit=3)[0] <= 3


def test_bad_cost_curves_are_refused():
    with pytest.raises(ValueError, match="equal, non-empty"):
        CostCurves((1.0, 2.0), (0.1,))
    with pytest.raises(ValueError, match="positive"):
        CostCurves((0.0, 1.0), (0.0, 0.1))
    with pytest.raises(ValueError, match="need 16"):
        WidthChooser(CostCurves((1.0,) * 4, (0.1,) * 4), 16)


# -- calibration ----------------------------------------------------------------------------


def test_calibration_measures_increasing_verify_cost_and_is_cached(
    target, draft, monkeypatch, tmp_path
):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    model, _ = target
    pair = Pair(model, draft)
    curves1 = calibrate.load_or_measure(pair)
    assert len(curves1.verify) == len(curves1.draft) == draft.config.block_size
    assert all(t > 0 for t in curves1.verify)
    files = list((tmp_path / "calibration").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["mlx"] == mx.__version__

    def no_measure(*a, **k):
        raise AssertionError("cached curves must be reused")

    monkeypatch.setattr(calibrate, "measure", no_measure)
    assert calibrate.load_or_measure(pair) == curves1
    pair.calibration.forget()  # a new process: read back from the file
    assert calibrate.load_or_measure(pair) == curves1


@pytest.fixture
def measure_calls(draft, monkeypatch, tmp_path) -> list[int]:
    """A private cache folder and a calibration that only counts how often it is measured."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    calls: list[int] = []
    fake = CostCurves((1.0,) * 16, (0.1,) * 16)
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: calls.append(1) or fake)
    return calls


def test_a_calibration_rewritten_on_disk_is_what_the_next_request_reads(
    target, draft, tmp_path, measure_calls
):
    """Another process (or another instance of the model) re-calibrated: this process
    follows the file, as a fresh process would, so seeded widths agree across processes."""
    model, _ = target
    pair = Pair(model, draft)
    first = calibrate.load_or_measure(pair)
    path = calibrate.cache_path(pair)
    data = json.loads(path.read_text())
    data["verify"] = [2 * t for t in data["verify"]]
    path.write_text(json.dumps(data) + "\n")
    again = calibrate.load_or_measure(pair)
    assert again != first and again.verify == tuple(data["verify"])
    assert len(measure_calls) == 1


def test_curves_from_another_process_are_looked_at_once_then_trusted(
    target, draft, tmp_path, measure_calls
):
    """Curves measured in this process are trusted: the chooser makes no first look. Read
    back from the cache (another process measured them, under conditions that may have
    changed), its first probe may look (`first_look`); a speculative cycle it timed that
    agrees with them marks the file confirmed, and the next process trusts it; one that
    disagrees confirms nothing."""
    model, _ = target
    pair = Pair(model, draft)
    opts = dflash_mlx.GenerateOptions()
    _, _, ch = pair.plan(opts)
    assert pair.calibration.trusted and ch.first_look == 0.0

    def new_process():
        pair.forget()
        pair.calibration.forget()
        return pair.plan(opts)[2]

    path = calibrate.cache_path(pair)
    for factor, confirmed in ((3.0, False), (1.1, True)):
        ch = new_process()
        assert not pair.calibration.trusted and ch.first_look == FIRST_LOOK
        assert ch.budget() >= FIRST_LOOK and not ch.looked
        cal = ch.calibrated(0)
        ch.observe(1, cal[0])
        ch.observe(4, factor * cal[3])  # the look: a speculative cycle timed
        assert ch.looked and ch.budget() < FIRST_LOOK
        assert pair.plan(opts)[2] is ch
        assert pair.calibration.trusted is confirmed
        assert ("confirmed" in json.loads(path.read_text())) is confirmed
    ch = new_process()
    assert pair.calibration.trusted and ch.first_look == 0.0
    assert len(measure_calls) == 1, "confirming is no new measurement"


def test_a_changed_mlx_version_invalidates_the_calibration(
    target, draft, monkeypatch, tmp_path, measure_calls
):
    model, _ = target
    pair = Pair(model, draft)
    calls = measure_calls
    calibrate.load_or_measure(pair)
    pair.calibration.forget()
    calibrate.load_or_measure(pair)
    assert len(calls) == 1
    monkeypatch.setattr(mx, "__version__", "0.0.0-other")
    calibrate.load_or_measure(pair)
    assert len(calls) == 2
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2


def test_a_changed_blas_library_or_power_source_invalidates_the_calibration(
    target, draft, monkeypatch, tmp_path, measure_calls
):
    model, _ = target
    pair = Pair(model, draft)
    calls = measure_calls
    monkeypatch.setattr(calibrate, "_conditions", None)
    calibrate.load_or_measure(pair)
    calibrate.load_or_measure(pair)
    assert len(calls) == 1
    # The same process, later: OpenBLAS is not what was loaded, or the Mac is on battery.
    for what, value in (("blas_library", "libopenblas.so.0"), ("_power_source", "Battery")):
        monkeypatch.setattr(calibrate, what, lambda value=value: value)
        monkeypatch.setattr(calibrate, "_conditions", None)
        calibrate.load_or_measure(pair)
    assert len(calls) == 3
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 3


def test_calibration_covers_several_depths_and_reads_back(target, draft, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    model, _ = target
    pair = Pair(model, draft)
    real = calibrate.measure
    monkeypatch.setattr(
        calibrate, "measure", lambda p, **k: real(p, repeats=1, depths=(16, 300), **k)
    )
    curves1 = calibrate.load_or_measure(pair)
    assert curves1.depths == (16, 300) and len(curves1.deeper) == 1
    assert all(t > 0 for t in curves1.deeper[0][0])
    pair.calibration.forget()
    monkeypatch.setattr(calibrate, "measure", None)  # must come from the file now
    assert calibrate.load_or_measure(pair) == curves1
    limit = min(model.args.max_position_embeddings, draft.config.max_position_embeddings)
    assert all(d + 2 * draft.config.block_size <= limit for d in calibrate.calibration_depths(pair))


def test_measured_cycle_costs_override_an_optimistic_calibration():
    """Calibration says W=4 pays; the cycles as really run (syncs, Python) say it does not."""
    ch = WidthChooser(FLAT, BLOCK)
    ch.trials, ch.hits = [0.0] + [1e6] * 15, [0.0] + [0.6e6] * 15
    assert ch.choose()[0] > 1
    for w in range(2, BLOCK + 1):
        ch.observe(w, 10.0 * FLAT.verify[0])  # every speculative cycle costs 10 plain steps
    assert ch.choose()[0] == 1
    assert ch.rates()[1][0] == 1.0 / FLAT.verify[0], "plain steps: calibrated until measured"
    for _ in range(30):  # plain steps really cost 20x their calibration here too
        ch.observe(1, 20.0 * FLAT.verify[0])
    assert ch.plain_cost() == pytest.approx(20.0 * FLAT.verify[0], rel=0.02)
    assert ch.choose()[0] > 1, "measured against measured, speculation pays again"


def test_a_stalled_first_cycle_does_not_turn_good_speculation_off():
    ch = WidthChooser(FLAT, BLOCK)
    teach(ch, 0.95)
    assert ch.choose()[0] >= 12
    w = ch.choose()[0]
    ch.observe(w, 100.0 * (FLAT.verify[w - 1] + FLAT.draft[w - 1]))  # a 100x stall, first seen
    assert ch.choose()[0] > 1, "one stall made speculation look worse than plain decoding"


def test_one_stalled_cycle_does_not_swing_the_measured_cost():
    ch = WidthChooser(FLAT, BLOCK)
    for _ in range(30):
        ch.observe(1, 0.5)  # plain steps run at half their calibrated cost here
    assert ch.plain_cost() == pytest.approx(0.5, rel=0.02)
    ch.observe(1, 50.0)  # the machine stalled once (GC, another process)
    assert ch.plain_cost() < 0.65


def test_positions_little_tried_borrow_the_pooled_rate_not_one_unlucky_estimate():
    ch = WidthChooser(FLAT, BLOCK)
    ch.trials = [0.0] + [100.0] * 5 + [5.0] + [0.0] * 9
    ch.hits = [0.0] + [90.0] * 5 + [3.0] + [0.0] * 9  # position 6: 3 of 5, by chance
    alphas = ch.acceptance()
    assert alphas[5] < 0.75, "position 6's own evidence counts"
    assert all(a > 0.85 for a in alphas[6:]), "untried positions borrow the pooled 0.9"


def true_cost(truth: CostCurves, w: int, n: int) -> float:
    """What a cycle really costs on the simulated device (a fake clock): its passes plus a
    fixed overhead per speculative cycle (host syncs, Python)."""
    return truth.verify[0] if w == 1 else truth.verify[w - 1] + truth.draft[n - 1] + 0.2


def accepted_at(alpha: float, w: int) -> int:
    """Drafts accepted by a cycle of width w (the expected pattern of teach())."""
    return sum(1 for j in range(1, w) if alpha**j >= 0.5)


def best_fixed_rate(truth: CostCurves, alpha: float) -> float:
    rates = [1.0 / truth.verify[0]]
    for w in range(2, BLOCK + 1):
        n = min(range(w, BLOCK + 1), key=lambda n: truth.draft[n - 1])
        rates.append((accepted_at(alpha, w) + 1) / true_cost(truth, w, n))
    return max(rates)


def drive(ch: WidthChooser, truth: CostCurves, alpha: float, cycles: int, depth=lambda i: 0):
    """Run the chooser as the engine does on a fake clock: [(tokens, seconds)] per cycle."""
    log = []
    for i in range(cycles):
        w, n = ch.choose(depth=depth(i))
        seconds = true_cost(truth, w, n)
        ch.observe(w, seconds)
        a = accepted_at(alpha, w) if w > 1 else 0
        if w > 1:
            ch.settle(a + 1, seconds)  # as the decode loop does, before `update`
        ch.update(w, a)
        log.append((a + 1, seconds))
    return log


def rate(log) -> float:
    return sum(t for t, _ in log) / sum(s for _, s in log)


CPU = curves(lambda w: 1.0 * w, lambda n: 0.25 * n)  # stock BLAS: a W-row verify ~ W steps
BLAS = curves(lambda w: 1.0 + 0.05 * w, lambda n: 0.1 + 0.01 * n)  # wide verifies ~ free


@pytest.mark.parametrize(
    "calibrated, truth, alpha",
    [(CPU, BLAS, 0.9), (CPU, BLAS, 0.7), (BLAS, CPU, 0.9), (BLAS, CPU, 0.5)],
    ids=["steep-cal-flat-device", "steep-cal-flat-device-a.7", "flat-cal-steep-device", "a.5"],
)
def test_a_stale_calibration_is_unlearnt_within_a_hundred_cycles(calibrated, truth, alpha):
    """Calibrated under one BLAS, decoding under another: within 100 cycles the chooser
    runs within 5% of the best fixed width on the device as it really is."""
    ch = WidthChooser(calibrated, BLOCK)
    log = drive(ch, truth, alpha, 400)
    assert rate(log[100:]) >= 0.95 * best_fixed_rate(truth, alpha), rate(
        log[100:]
    ) / best_fixed_rate(truth, alpha)


def test_a_measured_width_replaces_its_calibration_and_others_follow_the_measured_shape():
    ch = WidthChooser(CPU, BLOCK)  # calibrated steep; the device is flat
    cal = ch.calibrated(0)
    for w in (2, 16):
        for _ in range(30):
            ch.observe(w, true_cost(BLAS, w, ch._draft_block(w)))
    for w in (2, 16):
        assert ch.cycle_cost(w) == pytest.approx(true_cost(BLAS, w, ch._draft_block(w)), rel=5e-3)
    # Width 8 was never tried: it sits between the measured ones, not at its stale
    # calibration (even rescaled by the measured widths' average factor).
    truth8 = true_cost(BLAS, 8, ch._draft_block(8))
    assert ch.cycle_cost(8) == pytest.approx(truth8, rel=0.15)
    assert ch.cycle_cost(8) < 0.5 * cal[7] * (
        ch.cycle_cost(16) / cal[15] + ch.cycle_cost(2) / cal[1]
    )


def test_one_measured_width_prices_wider_ones_no_dearer_until_tried():
    """Up to twice the measured width, a wider one is priced no dearer (a steep calibration
    is found out a doubling at a time); beyond, along the calibration, rescaled."""
    ch = WidthChooser(CPU, BLOCK)
    cal = ch.calibrated(0)
    ch.observe(3, 2.0)
    assert ch.cycle_cost(6) == pytest.approx(2.0)
    assert ch.cycle_cost(12) == pytest.approx(2.0 * cal[11] / cal[2])
    ch.observe(12, 5.0)
    assert ch.cycle_cost(12) == pytest.approx(5.0)
    assert 2.0 < ch.cycle_cost(7) < 5.0


def test_persistent_disagreement_with_the_calibration_asks_for_a_new_one():
    stale = WidthChooser(CPU, BLOCK)
    fresh = WidthChooser(BLAS, BLOCK)
    for ch in (stale, fresh):
        drive(ch, BLAS, 0.9, 200)
    assert stale.recalibrate and not fresh.recalibrate


@pytest.mark.parametrize("factor, cycles", [(1 / 6, 8), (4.0, 8), (0.45, 64), (2.2, 64)])
def test_speculative_cycles_far_off_the_calibration_ask_for_a_new_one_soon(factor, cycles):
    """Speculative cycles a factor of three or more off the calibration ask for a new one
    after 8 of them; nearer (but beyond a factor of two), after 64."""
    ch = WidthChooser(CPU, BLOCK)
    ch.observe(1, CPU.verify[0])
    for i in range(cycles):
        assert not ch.recalibrate, i
        w = 4 + i % 8
        ch.observe(w, factor * ch.calibrated(0)[w - 1])
    assert ch.recalibrate


@pytest.mark.parametrize("factor, due", [(0.42, True), (2.5, True), (0.7, False), (1.6, False)])
def test_plain_steps_far_from_the_calibration_ask_for_a_new_one(factor, due):
    """Where the calibration says speculation cannot pay, only plain steps run: 64 of them
    a factor of two or more from it ask for a new calibration; nearer, they do not."""
    ch = WidthChooser(CPU, BLOCK)
    for _ in range(63):
        ch.observe(1, factor * CPU.verify[0])
    assert not ch.recalibrate, "not on fewer than 64"
    ch.observe(1, factor * CPU.verify[0])
    assert ch.recalibrate is due


def test_a_stretch_of_plain_steps_teaches_what_its_single_steps_would():
    """A plain stretch is observed once, `times` steps at their mean cost: its steps count
    as so many (64 of them ask for a new calibration) and move the measured cost as far as
    the single steps would have."""
    single, stretched = WidthChooser(CPU, BLOCK), WidthChooser(CPU, BLOCK)
    for ch in (single, stretched):
        ch.observe(1, 0.4 * CPU.verify[0])
    for _ in range(63):
        single.observe(1, 0.3 * CPU.verify[0])
    stretched.observe(1, 0.3 * CPU.verify[0], times=63)
    assert stretched.recalibrate and single.recalibrate
    assert stretched.plain_cost() == pytest.approx(single.plain_cost(), rel=1e-4)
    once = WidthChooser(CPU, BLOCK)
    once.observe(1, 0.4 * CPU.verify[0])
    once.observe(1, 0.3 * CPU.verify[0])
    assert not once.recalibrate


# -- context depth ---------------------------------------------------------------------------


def test_calibrated_costs_are_interpolated_between_depths():
    shallow = tuple(float(w) for w in range(1, 5))
    deep = tuple(3.0 * w for w in range(1, 5))
    c = CostCurves(shallow, (0.0, 1, 1, 1), depths=(0, 2048), deeper=((deep, (0.0, 3, 3, 3)),))
    assert c.at(0) == (shallow, (0.0, 1, 1, 1))
    assert c.at(1024)[0] == pytest.approx((2.0, 4.0, 6.0, 8.0))
    assert c.at(4096)[0] == pytest.approx((5.0, 10.0, 15.0, 20.0)), "extrapolated"
    assert c.at(4096)[1] == pytest.approx((0.0, 5.0, 5.0, 5.0))
    with pytest.raises(ValueError, match="increasing"):
        CostCurves(shallow, shallow, depths=(10, 5), deeper=((deep, deep),))
    with pytest.raises(ValueError, match="deeper"):
        CostCurves(shallow, shallow, depths=(0, 5))


def test_a_decision_asking_for_several_depths_prices_each_once(monkeypatch):
    """A dormant decision asks for the latest depth, a probe's and the request's end: each
    depth's calibrated costs, curve and rates are computed once while nothing they rest on
    changed (one entry per memo recomputed them at each call: 72 us a decision, 49 with
    one entry a depth), and again once the costs learnt have moved."""
    shallow = tuple(float(w) for w in range(1, BLOCK + 1))
    deep = tuple(3.0 * w for w in range(1, BLOCK + 1))
    draft = (0.0,) + (0.5,) * (BLOCK - 1)
    c = CostCurves(shallow, draft, depths=(0, 2048), deeper=((deep, draft),))
    ch = WidthChooser(c, BLOCK)
    seen = []
    at = CostCurves.at
    monkeypatch.setattr(CostCurves, "at", lambda self, d: seen.append(d) or at(self, d))
    first = [(ch.curve(d), ch.rates(d)) for d in (100, 5000)]
    for _ in range(5):
        assert [(ch.curve(d), ch.rates(d)) for d in (100, 5000)] == first
    assert seen == [100, 5000], "a depth's calibrated costs were computed again"
    ch.observe(1, 2.0, depth=100)
    assert ch.curve(100)[0] == pytest.approx(2.0), "the curve was not recomputed"
    assert ch.curve(5000)[0] > first[1][0][0], "the deep curve was not recomputed"
    assert seen == [100, 5000], "the calibration does not change with what is learnt"


def test_online_costs_are_kept_per_depth_bucket():
    """Cycles measured deep in a context do not reprice short ones, and the reverse."""
    ch = WidthChooser(BLAS, BLOCK)
    for _ in range(20):
        ch.observe(1, 1.0, depth=100)
        ch.observe(4, 1.5, depth=100)
        ch.observe(1, 3.0, depth=6000)
        ch.observe(4, 9.0, depth=6000)
    assert ch.cycle_cost(4, depth=100) == pytest.approx(1.5, rel=0.02)
    assert ch.cycle_cost(4, depth=6000) == pytest.approx(9.0, rel=0.02)
    assert ch.plain_cost(depth=120) == pytest.approx(1.0, rel=0.02)
    assert ch.plain_cost(depth=5000) == pytest.approx(3.0, rel=0.02)


def test_a_new_depth_borrows_the_measured_shape_priced_by_the_calibration_at_that_depth():
    shallow = curves(lambda w: 1.0 + 0.05 * w, lambda n: 0.1)
    deep = tuple(3.0 * v for v in shallow.verify)
    c = CostCurves(shallow.verify, shallow.draft, depths=(0, 8192), deeper=((deep, shallow.draft),))
    ch = WidthChooser(c, BLOCK)
    for _ in range(10):
        ch.observe(1, 2.0 * c.verify[0], depth=0)  # the device runs at half its calibration
        for w in (2, 8):
            ch.observe(w, 2.0 * ch.calibrated(0)[w - 1], depth=0)
    # Never measured at 8k: the calibration at 8k, at the measured factor.
    assert ch.cycle_cost(8, depth=8192) == pytest.approx(2.0 * ch.calibrated(8192)[7], rel=0.02)
    assert ch.plain_cost(depth=8192) == pytest.approx(2.0 * deep[0], rel=0.02)


def test_probes_are_priced_at_the_current_depth():
    shallow = curves(lambda w: 1.0 + 0.1 * w, lambda n: 0.1)
    deep = tuple(1.0 + 3.0 * w for w in range(1, BLOCK + 1))  # attention makes width dear
    c = CostCurves(shallow.verify, shallow.draft, depths=(0, 8192), deeper=((deep, shallow.draft),))
    ch = WidthChooser(c, BLOCK, prior=0.05)
    ch.depth = 0
    near = ch.probe_loss(2) / ch.plain_cost()
    ch.depth = 8192
    far = ch.probe_loss(2) / ch.plain_cost()
    assert far > 2 * near, (near, far)


def test_probes_keep_within_a_budget_per_request():
    """A never-right draft, short requests at a long context where probes are dear: each
    request loses at most its budget to probes, however the interval stands."""
    ch = WidthChooser(CPU, BLOCK, request_budget=0.03)
    for _ in range(12):
        ch.begin_request()
        spent = lost = 0.0
        for _ in range(60):
            w, n = ch.choose(depth=4000)
            seconds = true_cost(CPU, w, n)
            ch.observe(w, seconds)
            if w > 1:
                ch.settle(1, seconds)
            ch.update(w, 0)
            spent += seconds
            lost += max(seconds - CPU.verify[0], 0.0) if w > 1 else 0.0
        assert lost <= 0.03 * spent + 1e-9, f"probes lost {lost / spent:.1%} of a request"
    assert ch.probes >= 1, "long enough requests still probe"


# -- the chooser in the decode loop ------------------------------------------------------------


def decode_with(model, d, ids, n, chooser):
    """`model`: a target model, or a Pair (then `d` is its draft)."""
    from dflash_mlx import GenerateOptions
    from dflash_mlx.engine.batch import speculative_decode

    pair = model if isinstance(model, Pair) else Pair(model, d)
    cycles = speculative_decode(
        pair,
        ids,
        GenerateOptions(max_tokens=n),
        width=BLOCK,
        draft_block=BLOCK,
        chooser=chooser,
        learn_costs=False,
    )
    return [t for c in cycles for t in c.tokens]


# The captured layers and the projection of a row of context at 1% of a plain step, as the
# demo pair measures them with OpenBLAS (BLAS's estimate, `lazy` None, is 4%).
BLAS_CHEAP_CONTEXT = CostCurves(BLAS.verify, BLAS.draft, lazy=0.005, context=0.005)


@pytest.mark.parametrize(
    "case, repeats",
    [("plain", 12), ("plain", 3), ("speculates", 12), ("dear", 12)],
)
def test_prefill_builds_no_draft_context_for_a_draft_expected_dormant(
    target, draft, monkeypatch, case, repeats
):
    """A chooser that expects plain decoding: prefill projects nothing for the draft (the
    prompt's last `window` positions wait, unevaluated, for the first probe, which then
    reads them); one that expects to speculate: prefill projects the whole prompt, unless
    (`dear`) the prompt's last chunk of context, which the first cycle would evaluate,
    costs more than speculating saves over the request (15 tokens against 407 rows here):
    then it is dormant too, and the first speculative cycle catches up on its window."""
    from mlx_lm.generate import generate_step

    from dflash_mlx.engine import batch
    from dflash_mlx.engine.prefill import SPLIT_BEFORE_WINDOW

    model, tok = target
    ids = tok.encode("def parse(line):\n    return line.split(',')\n" * repeats)
    dormant = case != "speculates"
    ch = WidthChooser(
        {"plain": CPU, "speculates": BLAS_CHEAP_CONTEXT, "dear": BLAS}[case],
        BLOCK,
        window=8,
        prior=0.05 if case == "plain" else 0.9,
        request_budget=1.0,  # a probe within these few tokens
        budget_tokens=0,  # of any length
    )
    assert ch.expects_plain(len(ids)) is (case == "plain")
    assert ch.builds_context(len(ids), 15, len(ids) - 1) is (case == "speculates")
    events = []
    # Patched on the class: on the instance, monkeypatch's undo would leave the bound
    # method behind as an instance attribute, shadowing later tests' class patches.
    real = type(draft).add_context
    monkeypatch.setattr(
        type(draft),
        "add_context",
        lambda self, f, s: events.append(("rows", f.shape[1])) or real(self, f, s),
    )
    first = batch.first_token  # where the engine takes it
    monkeypatch.setattr(
        batch, "first_token", lambda req, lg: events.append(("prefilled", 0)) or first(req, lg)
    )
    pair = Pair(model, draft)
    forward = pair.target.forward
    monkeypatch.setattr(  # this pair's adapter alone
        pair.target,
        "forward",
        lambda t, c, ids: events.append(("target", t.shape[1])) or forward(t, c, ids),
    )
    out = decode_with(pair, draft, ids, 16, ch)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=16, sampler=None)]
    assert out == ref
    at = events.index(("prefilled", 0))
    passes = [n for what, n in events[:at] if what == "target"]
    during = [e for e in events[:at] if e[0] == "rows"]
    after = [n for what, n in events[at + 1 :] if what == "rows"]
    if case == "dear":
        assert during == [], f"a dormant prefill projected {during}"
        # Split off its chunk, the window waits for the first cycle, which speculates (the
        # chooser expects to) after catching up on the window and the prompt's last token.
        assert passes == [len(ids) - 1 - ch.window, ch.window, 1], passes
        assert after and after[0] == ch.window + 1, after
    elif dormant:
        assert ch.probes >= 1, "no probe: the test shows nothing"
        assert during == [], f"a dormant prefill projected {during}"
        cut = len(ids) - 1 - ch.window
        if cut < SPLIT_BEFORE_WINDOW:
            # Chunked as the target alone would be: a window near the chunk's start is
            # not split off (nor kept).
            assert passes == [len(ids) - 1, 1], passes
        else:
            # Far into its chunk, the window is split off: a probe then computes the
            # captured layers over the window alone, not over the positions before it.
            assert passes == [cut, ch.window, 1], passes
        if cut < SPLIT_BEFORE_WINDOW:
            # No window kept: the first probe reads the last prompt token and the plain
            # steps (the window would have cost the captured layers over the chunk).
            assert after and ch.base_probe <= after[0] < 8 + ch.base_probe, after
        else:
            # The first probe reads the window, the last prompt token and the plain steps.
            assert after and after[0] >= 8 + 1 + ch.base_probe - 1, after
    else:
        assert sum(n for _, n in during) >= len(ids) - 1, during


def test_a_context_is_built_in_prefill_only_on_costs_measured_near_its_depth():
    """Curves calibrated at 128 and 2048 tokens: where speculation pays and saves more
    than the context costs, a prompt's context is built up to twice the deepest point once
    a speculative cycle was timed at that depth; at
    8k the costs are only extrapolated (on the demo pair a plain step priced at 11 ms took
    9, and the context built on that cost a 64-token request 7-11 plain steps), so the
    prefill of a request whose probe budget the context exceeds is dormant, until a plain
    step and a speculative cycle timed at that depth say what they cost."""
    deep = tuple(2.0 * v for v in BLAS.verify), BLAS.draft
    curves_ = CostCurves(
        BLAS.verify, BLAS.draft, depths=(128, 2048), deeper=(deep,), lazy=0.01, context=0.002
    )
    ch = WidthChooser(curves_, BLOCK, prior=0.9)
    assert not ch.builds_context(3000, 32, 255), "nothing timed at that depth yet"
    ch.observe(4, ch.cycle_cost(4, 3000), depth=3000)  # a speculative cycle timed there
    assert ch.builds_context(3000, 32, 255)
    # The 255 rows cost more than the probe budget of a 32-token request (3%) there.
    assert ch.context_cost(255, 255, 8192) > 0.03 * 32 * ch.plain_cost(8192)
    assert not ch.builds_context(8192, 32, 255)
    assert ch.builds_context(8192, 1024, 255), "a long reply can afford a wrong guess"
    ch.observe(1, ch.plain_cost(8192), depth=8192)  # a plain step timed there, as priced
    assert not ch.builds_context(8192, 32, 255), "the speculative widths are still guessed"
    ch.observe(4, ch.cycle_cost(4, 8192), depth=8192)  # and a speculative cycle
    assert ch.builds_context(8192, 32, 255)
    # What the context costs still counts: not worth it for a request of one token more.
    assert not ch.builds_context(8192, 1, 255)


def test_acceptance_learnt_on_shallow_texts_does_not_buy_a_deep_prompt_its_context():
    """Drafts right 9 times in 10 on short prompts (speculative cycles timed at 128 tokens)
    say nothing of a 1k-token prompt's: building its context is a bet the prompt's text
    has not confirmed (the unwindowed demo draft at 1k committed one token in its first
    cycle, whose 48 ms evaluating the context cost a 128-token request 10%). So the prompt's
    last 511 rows, 15 plain steps' worth, are built only when a request's probe budget can
    lose them (a long reply) or once a speculative cycle was timed at that depth."""
    c = CostCurves(BLAS.verify, BLAS.draft, lazy=0.015, context=0.015)
    ch = WidthChooser(c, BLOCK)
    ch.begin_request()
    for _ in range(40):  # short prompts: every cycle timed there, at its calibrated cost
        ch.choose(limit=256, depth=128)
        ch.observe(8, ch.cycle_cost(8, 128), depth=128)
    teach(ch, 0.95, cycles=40)
    ch.begin_request()
    assert ch.carried and not ch.expects_plain(1024)
    cost = ch.context_cost(511, 511, 1024)
    assert cost > 10 * ch.plain_cost(1024)
    assert ch.saving(127, depth=1024) > cost, "on its acceptance alone it would be built"
    assert ch.builds_context(128, 127, 511), "where the acceptance was seen, it is built"
    assert not ch.builds_context(1024, 127, 511)
    assert ch.builds_context(1024, 1024, 511), "a long reply can afford a wrong guess"
    ch.observe(8, ch.cycle_cost(8, 1024), depth=1024)  # a speculative cycle at 1k
    assert ch.builds_context(1024, 127, 511)


def test_a_first_cycle_on_acceptance_from_other_texts_pays_its_catch_up_from_its_budget():
    """A 128-token request whose prefill was dormant (its draft's context a 33-row window
    behind), on acceptance only earlier texts showed: were every draft of its first cycle
    wrong, that cycle and the catch-up before it lose at most half the request's probe
    budget. Before, the catch-up was not counted: a W=6 first cycle within the half lost
    as much again catching up (2.8% of the request at 1k tokens, the unwindowed demo
    draft with OpenBLAS). With nothing to catch up the first cycle still speculates."""
    c = CostCurves(BLAS.verify, BLAS.draft, lazy=0.05, context=0.05)  # a row: 0.1 steps
    ch = WidthChooser(c, BLOCK)
    ch.begin_request()
    for _ in range(40):
        ch.choose(limit=256, depth=128)
        ch.observe(8, ch.cycle_cost(8, 128), depth=128)
    teach(ch, 0.95, cycles=40)
    for context in [(0, 0), (33, 33)]:
        ch.begin_request()
        assert ch.carried
        w, _ = ch.choose(limit=127, depth=1024, context=context)
        room = 0.5 * 0.03 * 127 * ch.plain_cost()
        catch = ch.context_cost(*context) if any(context) else 0.0
        if context == (0, 0):
            assert w > 1, "nothing to catch up: the first cycle looks"
        else:
            assert catch > 0
        lost = ch.cycle_cost(w) - ch.plain_cost() + catch if w > 1 else 0.0
        assert lost <= room + 1e-12, f"W={w} risks {lost / room:.1f}x half the budget"


@pytest.mark.parametrize(
    "depth, limit, speculates", [(3000, 16, True), (8192, 16, False), (8192, 4096, True)]
)
def test_speculation_expected_only_on_extrapolated_costs_is_tested_by_a_probe_or_not_at_all(
    depth, limit, speculates
):
    """Curves calibrated at 128 and 2048 tokens: a request's first decision speculates
    where its rates say so within twice the deepest point; far beyond it (8k) the rates
    rest on extrapolated costs, and a request too short for a probe's budget decodes
    plainly (on the demo pair such a first cycle cost a 64-token request 5%), while one
    long enough to afford a probe still makes it."""
    deep = tuple(2.0 * v for v in BLAS.verify), BLAS.draft
    curves_ = CostCurves(BLAS.verify, BLAS.draft, depths=(128, 2048), deeper=(deep,))
    ch = WidthChooser(curves_, BLOCK, prior=0.9)
    ch.begin_request()
    assert ch.rates(depth)[1][0] < max(r for r, _ in ch.rates(depth).values())
    # Woken from a dormant prefill: a window of 33 rows to catch up on first.
    w, _ = ch.choose(limit=limit, depth=depth, context=(33, 33))
    assert (w > 1) is speculates, w


def test_the_decode_loop_gives_the_chooser_the_context_depth_and_a_new_request(target, draft):
    model, tok = target
    ids = tok.encode("import os\nimport sys\n" * 10)
    seen = []

    class Recording(WidthChooser):
        def choose(self, limit=None, depth=None, context=(0, 0)):
            seen.append(depth)
            return super().choose(limit, depth, context)

        def begin_request(self):
            seen.append("new request")
            super().begin_request()

    ch = Recording(BLAS, BLOCK)
    decode_with(model, draft, ids, 12, ch)
    assert seen[0] == "new request", "the request's probe budget starts afresh"
    depths = seen[1:]
    assert depths[0] == len(ids) and depths == sorted(depths) and depths[-1] < len(ids) + 12


def test_every_result_says_what_ran(target, draft):
    """Cycles and tokens per width, the plain share, probes and the draft's state."""
    model, tok = target
    ids = tok.encode("for i in range(10):\n    print(i)\n")
    fixed = dflash_mlx.generate(model, draft, tok, ids, max_tokens=24, verify_width=4)
    auto = dflash_mlx.generate(model, draft, tok, ids, max_tokens=24)
    for r in (fixed, auto):
        ran = r.stats.what_ran()
        assert sum(w["cycles"] for w in ran["widths"].values()) == r.cycles
        # The first token comes from the prefill, not from a cycle.
        assert sum(w["tokens"] for w in ran["widths"].values()) == r.generation_tokens - 1
    # Fixed W=4: narrower only where the token budget ends (at most one plain step).
    assert fixed.stats.widths.get(1, [0, 0])[0] <= 1 and fixed.stats.draft == "active"
    assert fixed.stats.widths[4][0] >= 15 and fixed.stats.probes == 0
    plain = auto.stats.widths.get(1, [0, 0])[1]
    assert auto.stats.plain_fraction == pytest.approx(plain / (auto.generation_tokens - 1))
    assert auto.stats.draft in ("active", "dormant")
    none = dflash_mlx.generate(model, None, tok, ids, max_tokens=8)
    assert none.stats.draft is None and none.stats.plain_fraction == 1.0


def test_stats_count_cycles_and_tokens_per_width():
    from dflash_mlx import Stats

    s = Stats(draft="active")
    for width, accepted in [(4, 3), (1, 0), (4, 1), (1, 0)]:
        s.add(width, accepted)
    assert s.widths == {4: [2, 6], 1: [2, 2]}
    assert s.plain_fraction == pytest.approx(2 / 8)
    both = s.merge(Stats(widths={2: [1, 2]}, cycles=1, committed=2, probes=3))
    assert both.widths == {4: [2, 6], 1: [2, 2], 2: [1, 2]} and both.probes == 3
    assert both.what_ran()["widths"]["4"] == {"cycles": 2, "tokens": 6}


def test_numpys_own_blas_does_not_change_the_calibration_key():
    """NumPy loads a private ILP64 OpenBLAS MLX never calls: importing numpy (as some
    library may, at any time) must not make a process's calibration look stale."""
    import numpy  # noqa: F401  (maps numpy.libs/libscipy_openblas64_*.so)

    blas = calibrate.blas_library() or ""
    assert "openblas64" not in blas and "scipy_openblas" not in blas


def test_a_new_request_does_not_inherit_one_prompts_useless_drafts():
    """Acceptance belongs to the text: after a request whose drafts were all wrong (plain
    decoding, probes backed off), the next request probes within the base interval and,
    its drafts being right, speculates. Costs carry over."""
    costs = curves(lambda w: 1.0 + 0.25 * w, lambda n: 0.5)  # pays only for good drafts
    ch = WidthChooser(costs, BLOCK)
    ch.begin_request()
    for _ in range(2000):
        w, _ = ch.choose()
        if w > 1:
            ch.update(w, 0)
    assert ch.choose()[0] == 1 and ch.probe_interval > 4 * ch.base_probe
    ch.begin_request()
    assert ch.choose()[0] == 1, "the new request starts from the earlier evidence"
    widths = []
    for _ in range(60):
        w, _ = ch.choose()
        widths.append(w)
        if w > 1:
            ch.update(w, w - 1)
    first = next(i for i, w in enumerate(widths) if w > 1)
    assert first <= 3 * ch.base_probe, f"the new request waited {first} cycles for a probe"
    assert min(widths[-10:]) >= 8, widths


def test_earlier_requests_acceptance_is_a_prior_a_few_cycles_outweigh():
    ch = WidthChooser(curves(lambda w: 1.0 + 0.25 * w, lambda n: 0.5), BLOCK)
    ch.begin_request()
    teach(ch, 0.0, cycles=400)  # one prompt on which the draft is useless
    assert ch.choose()[0] == 1
    ch.begin_request()
    teach(ch, 1.0, cycles=2)  # two cycles of this prompt, every draft right
    assert ch.choose()[0] >= 8


def test_a_probe_is_paid_for_as_if_its_drafts_were_all_wrong():
    """Acceptance learnt on short prompts says little of a draft at depth (an unwindowed
    draft at 1k tokens: right on short prompts, never at 1k). A 128-token request at depth
    where every draft is wrong loses at most its budget to probes, however well earlier
    texts drafted: a probe is priced at what it loses when it fails, not at what the
    acceptance so far expects of it (which let the first request make three, 3.9%)."""
    flat = curves(lambda w: 1.0 + 0.05 * w, lambda n: 0.1)
    # At depth a wide verify is cheap and the draft's pass costs 1.5 plain steps.
    deep = (tuple(1.0 + 0.1 * (w - 1) for w in range(1, BLOCK + 1)), (1.5,) * BLOCK)
    c = CostCurves(flat.verify, flat.draft, depths=(0, 1024), deeper=(deep,))
    ch = WidthChooser(c, BLOCK, request_budget=0.03)
    ch.begin_request()
    teach(ch, 0.6, cycles=40)  # short prompts draft fairly well
    for _ in range(6):
        ch.begin_request()
        spent = lost = 0.0
        for left in range(128, 0, -1):
            w, n = ch.choose(limit=left, depth=1024)
            seconds = deep[0][0] if w == 1 else deep[0][w - 1] + deep[1][n - 1]
            ch.observe(w, seconds)
            if w > 1:
                ch.settle(1, seconds)
                lost += seconds - deep[0][0]
            ch.update(w, 0)
            spent += seconds
        assert lost <= 0.03 * spent + 1e-9, f"probes lost {lost / spent:.1%} of a request"
    assert ch.probes >= 6, "each request still looks at its text"
