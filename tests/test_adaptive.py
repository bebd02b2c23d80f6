"""The automatic width (SPEC 5.4): `AutoPolicy` on synthetic costs (what it plans from
acceptance and costs, what it learns from the cycles it runs), the cost table, and the
calibration cache."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

import dflash_mlx
import dflash_mlx.calibration as calibrate
from dflash_mlx import Pair, sysinfo
from dflash_mlx.speed.costs import SMOOTHING, SPREAD, CostCurves, CostTable, Shape
from dflash_mlx.speed.policy import POOLED_CYCLES, AutoPolicy, teach
from dflash_mlx.speed.port import Ask, Record, Ticket

from .sim import drive, rate

BLOCK = 16


def curves(verify, draft) -> CostCurves:
    return CostCurves(
        tuple(verify(w) for w in range(1, BLOCK + 1)), tuple(draft(n) for n in range(1, BLOCK + 1))
    )


FLAT = curves(lambda w: 1.0 + 0.02 * w, lambda n: 0.1)  # a memory-bound GPU
STEEP = curves(lambda w: 1.0 * w, lambda n: 0.25 * n)  # a compute-bound CPU


def known(alpha: float, trials: float = 1e6) -> Ticket:
    """A row's evidence: `trials` cycles at every drafted position, accepted at `alpha`."""
    return Ticket([0.0] + [trials] * (BLOCK - 1), [0.0] + [alpha * trials] * (BLOCK - 1))


def width(policy: AutoPolicy, ticket: Ticket, left: int = 10**6, depth: int = 100) -> int:
    return policy.plan([Ask(ticket, depth, left)]).widths[0]


def learn_acceptance(policy, ticket, alpha: float, cycles: int = 400, w: int = BLOCK):
    """Cycles whose drafts are each accepted at conditional rate alpha (the expected
    pattern, not random draws), acceptance only (no seconds: no cost is learnt)."""
    for _ in range(cycles):
        n = accepted_at(alpha, w)
        policy.learn(Record((Ask(ticket, 100, 10**6),), (w,), (n,), 100, None, block=w))


def accepted_at(alpha: float, w: int) -> int:
    """Drafts accepted by a cycle of width w (the expected pattern)."""
    return sum(1 for j in range(1, w) if alpha**j >= 0.5)


def analytic_best(costs: CostCurves, alphas: list[float]) -> int:
    """argmax over W of E[tokens | W] / (t_draft + t_verify), written out independently."""
    best, best_rate = 1, 1.0 / costs.verify[0]
    for w in range(2, BLOCK + 1):
        expected = 1.0 + sum(math.prod(alphas[:i]) for i in range(1, w))
        draft = min(costs.draft[w - 1 : BLOCK])
        r = expected / (costs.verify[w - 1] + draft)
        if r > best_rate:
            best, best_rate = w, r
    return best


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.9, 0.99])
def test_the_policy_plans_the_analytically_best_width(costs, alpha):
    policy = AutoPolicy(costs, BLOCK)
    plan = policy.plan([Ask(known(alpha), 100, 10**6)])
    w = plan.widths[0]
    assert w == analytic_best(costs, [alpha] * (BLOCK - 1)), (w, alpha)
    assert w == 1 or plan.blocks[0] >= w


def test_flat_costs_go_wide_and_steep_costs_go_narrow():
    flat, steep = AutoPolicy(FLAT, BLOCK), AutoPolicy(STEEP, BLOCK)
    a, b = flat.begin(None), steep.begin(None)
    learn_acceptance(flat, a, 0.95)
    learn_acceptance(steep, b, 0.3)
    assert width(flat, a) >= 12
    assert width(steep, b) == 1


def test_the_policy_adapts_when_acceptance_changes():
    policy = AutoPolicy(FLAT, BLOCK)
    t = policy.begin(None)
    learn_acceptance(policy, t, 0.97)
    wide = width(policy, t)
    learn_acceptance(policy, t, 0.0, cycles=100, w=wide)
    narrow = width(policy, t)
    assert wide >= 12 and narrow <= 2, (wide, narrow)
    learn_acceptance(policy, t, 0.97, cycles=60, w=max(narrow, 2))
    assert width(policy, t) >= 8, "good drafts again: the width grows back"


def test_draft_block_is_the_cheapest_block_that_covers_w():
    costs = curves(lambda w: 1.0, lambda n: 0.5 if n == 16 else 0.1 * n)
    t = known(0.9)
    plan = AutoPolicy(costs, BLOCK).plan([Ask(t, 100, 10**6)])
    w, n = plan.widths[0], plan.blocks[0]
    assert n == (16 if 0.1 * w > 0.5 else w)
    assert AutoPolicy(costs, BLOCK, draft_block=16).plan([Ask(t, 100, 10**6)]).blocks[0] == 16
    short = AutoPolicy(costs, BLOCK, draft_block=4).plan([Ask(t, 100, 10**6)])
    assert (short.widths[0], short.blocks[0]) == (4, 4), "W never exceeds a fixed draft block"


def test_the_tokens_left_cap_the_width():
    policy = AutoPolicy(FLAT, BLOCK)
    assert width(policy, known(0.95), left=3) <= 3


def test_bad_cost_curves_are_refused():
    with pytest.raises(ValueError, match="equal, non-empty"):
        CostCurves((1.0, 2.0), (0.1,))
    with pytest.raises(ValueError, match="positive"):
        CostCurves((0.0, 1.0), (0.0, 0.1))
    with pytest.raises(ValueError, match="need 16"):
        AutoPolicy(CostCurves((1.0,) * 4, (0.1,) * 4), 16)
    with pytest.raises(ValueError, match="draft_block"):
        AutoPolicy(FLAT, BLOCK, draft_block=1)


def test_a_plain_plan_keeps_the_drafts_context_only_in_the_window_before_a_probe():
    """Drafts never right where speculation is dear: the plain plans stop capturing the
    draft's features, but every probe reads a window of context captured just before it."""
    half = curves(lambda w: (1.0 + w) / 2, lambda n: 0.01)  # pays only for right drafts
    policy = AutoPolicy(half, BLOCK)
    policy.window = 4
    t = policy.begin(None)
    trace = []  # (width, capture) per plain step or cycle
    for _ in range(3000):
        ask = Ask(t, 100, 10**6)
        plan = policy.plan([ask])
        w = plan.widths[0]
        steps = 1 if w > 1 else plan.stands + 1
        trace += [(w, plan.capture)] * steps
        seconds = half.verify[0] if w == 1 else half.verify[w - 1] + half.draft[w - 1]
        policy.learn(
            Record(
                (ask,),
                (w,),
                (0,),
                100,
                seconds,
                block=plan.blocks[0],
                times=steps if w == 1 else 1,
                probe=plan.probe,
            )
        )
        if len(trace) > 20000:
            break
    late = trace[len(trace) // 2 :]
    assert sum(c for _, c in late) < 0.3 * len(late), "dormant plain steps still capture"
    probes = [i for i, (w, _) in enumerate(trace) if w > 1]
    assert len(probes) >= 3
    for i in probes[1:]:
        assert all(c for _, c in trace[i - 4 : i + 1]), "a probe without a window of context"


def test_a_probe_that_finds_good_drafts_switches_back_to_speculation():
    costs = curves(lambda w: 1.0 + 0.1 * w, lambda n: 0.3)
    policy = AutoPolicy(costs, BLOCK)
    t = known(0.05, trials=50)
    assert width(policy, t) == 1
    log = drive(
        policy,
        lambda w, n: costs.verify[w - 1] + (costs.draft[n - 1] if w > 1 else 0),
        lambda c, w: w - 1,
        2000,
        ticket=t,
    )
    assert any(probe for _, probe, *_ in log), "no probe looked"
    assert log[-2][0] > 1 and not log[-2][1], log[-5:]


# -- costs learnt from the cycles ---------------------------------------------------------------


def test_measured_cycle_costs_override_an_optimistic_calibration():
    """Calibration says speculation pays; the cycles as really run (syncs, Python) say it
    does not. A busy machine then slows plain steps 20x: every pass is taken to slow alike
    (learnt from plain steps alone), so speculation stays priced out."""
    policy = AutoPolicy(FLAT, BLOCK)
    t = known(0.6)
    assert width(policy, t) > 1
    for w in range(2, BLOCK + 1):  # every speculative cycle costs 10 plain steps
        for _ in range(10):
            ask = Ask(t, 100, 10**6)
            policy.learn(Record((ask,), (w,), (0,), 100, 10.0 * FLAT.verify[0], block=w))
    assert width(policy, known(0.6)) == 1
    plain, wide = Shape(1, 1, 1, 100), Shape(1, 8, 8, 100)
    assert policy.table.cost(plain) == pytest.approx(FLAT.verify[0]), "calibrated till measured"
    assert policy.table.cost(wide) == pytest.approx(10.0 * FLAT.verify[0], rel=0.02)
    for _ in range(30):
        policy.learn(Record((Ask(t, 100, 10**6),), (1,), (0,), 100, 20.0 * FLAT.verify[0]))
    assert policy.table.cost(plain) == pytest.approx(20.0 * FLAT.verify[0], rel=0.02)
    assert policy.table.cost(wide) == pytest.approx(200.0 * FLAT.verify[0], rel=0.05)
    assert width(policy, known(0.6)) == 1


def test_a_busy_machine_slows_every_pass_alike():
    """Plain steps measured at 3x their calibration (a loaded machine): speculative cycles
    never timed are priced 3x too, and the plan is what it was idle."""
    policy = AutoPolicy(FLAT, BLOCK)
    t = known(0.8)
    before = width(policy, t)
    for _ in range(30):
        policy.learn(Record((Ask(t, 100, 10**6),), (1,), (0,), 100, 3.0 * FLAT.verify[0]))
    wide = Shape(1, 8, 8, 100)
    assert policy.table.cost(wide) == pytest.approx(3.0 * policy.table.calibrated(wide), rel=0.02)
    assert before > 1 and width(policy, t) == before


def test_a_stalled_first_cycle_does_not_turn_good_speculation_off():
    policy = AutoPolicy(FLAT, BLOCK)
    t = known(0.95)
    w = width(policy, t)
    assert w >= 12
    stall = 100.0 * (FLAT.verify[w - 1] + FLAT.draft[w - 1])  # a 100x stall, first seen
    policy.learn(Record((Ask(t, 100, 10**6),), (w,), (w - 1,), 100, stall, block=w))
    assert width(policy, t) > 1, "one stall made speculation look worse than plain decoding"


def test_one_stalled_cycle_does_not_swing_the_measured_cost():
    table = CostTable(FLAT)
    plain = Shape(1, 1, 1, 0)
    for _ in range(30):
        table.learn(plain, 0.5)  # plain steps run at about half their calibration here
    assert table.cost(plain) == pytest.approx(0.5, rel=0.02)
    table.learn(plain, 50.0)  # the machine stalled once (GC, another process)
    assert table.cost(plain) <= 0.5 * (1 + SMOOTHING * (SPREAD - 1)) * 1.02, "only a nudge"


def test_a_stretch_of_plain_steps_teaches_what_its_single_steps_would():
    single, stretched = CostTable(STEEP), CostTable(STEEP)
    plain = Shape(1, 1, 1, 0)
    for t in (single, stretched):
        t.learn(plain, 0.4 * STEEP.verify[0])
    for _ in range(63):
        single.learn(plain, 0.3 * STEEP.verify[0])
    stretched.learn(plain, 0.3 * STEEP.verify[0], times=63)
    assert stretched.cost(plain) == pytest.approx(single.cost(plain), rel=1e-4)


def test_a_measured_shape_replaces_its_calibration():
    table = CostTable(STEEP)  # calibrated steep; the device is flat
    for w in (2, 16):
        shape = Shape(1, w, w, 0)
        for _ in range(30):
            table.learn(shape, FLAT.verify[w - 1] + FLAT.draft[w - 1])
        assert table.cost(shape) == pytest.approx(FLAT.verify[w - 1] + FLAT.draft[w - 1], rel=5e-3)
    assert table.looked


def test_online_costs_are_kept_per_depth_bucket():
    """Cycles measured deep in a context do not reprice short ones, and the reverse."""
    table = CostTable(FLAT)
    for _ in range(20):
        table.learn(Shape(1, 1, 1, 100), 1.0)
        table.learn(Shape(1, 4, 4, 100), 1.5)
        table.learn(Shape(1, 1, 1, 6000), 3.0)
        table.learn(Shape(1, 4, 4, 6000), 9.0)
    assert table.cost(Shape(1, 4, 4, 100)) == pytest.approx(1.5, rel=0.02)
    assert table.cost(Shape(1, 4, 4, 6000)) == pytest.approx(9.0, rel=0.02)
    assert table.cost(Shape(1, 1, 1, 120)) == pytest.approx(1.0, rel=0.02)
    assert table.cost(Shape(1, 1, 1, 5000)) == pytest.approx(3.0, rel=0.02)


def test_a_new_depth_borrows_the_measured_shape_priced_by_the_calibration_at_that_depth():
    shallow = curves(lambda w: 1.0 + 0.05 * w, lambda n: 0.1)
    deep = tuple(3.0 * v for v in shallow.verify)
    c = CostCurves(shallow.verify, shallow.draft, depths=(0, 8192), deeper=((deep, shallow.draft),))
    table = CostTable(c)
    for _ in range(10):  # the device runs at half its calibration
        for w in (1, 2, 8):
            shape = Shape(1, w, w if w > 1 else 1, 0)
            table.learn(shape, 2.0 * table.calibrated(shape))
    # Never measured at 8k: the calibration at 8k, at the measured factor.
    far = Shape(1, 8, 8, 8192)
    assert table.cost(far) == pytest.approx(2.0 * table.calibrated(far), rel=0.02)
    assert table.cost(Shape(1, 1, 1, 8192)) == pytest.approx(2.0 * deep[0], rel=0.02)


def test_probes_are_priced_at_the_current_depth():
    shallow = curves(lambda w: 1.0 + 0.1 * w, lambda n: 0.1)
    deep = tuple(1.0 + 3.0 * w for w in range(1, BLOCK + 1))  # attention makes width dear
    c = CostCurves(shallow.verify, shallow.draft, depths=(0, 8192), deeper=((deep, shallow.draft),))
    policy = AutoPolicy(c, BLOCK)
    near, far = policy.costs(1, 0), policy.costs(1, 8192)
    assert (far[1] - far[0]) / far[0] > 2 * (near[1] - near[0]) / near[0], (near, far)


CPU = curves(lambda w: 1.0 * w, lambda n: 0.25 * n)  # stock BLAS: a W-row verify ~ W steps
BLAS = curves(lambda w: 1.0 + 0.05 * w, lambda n: 0.1 + 0.01 * n)  # wide verifies ~ free


def true_cost(truth: CostCurves, w: int, n: int) -> float:
    """What a cycle really costs on the simulated device: its passes plus a fixed overhead
    per speculative cycle (host syncs, Python)."""
    return truth.verify[0] if w == 1 else truth.verify[w - 1] + truth.draft[n - 1] + 0.2


def best_fixed_rate(truth: CostCurves, alpha: float) -> float:
    rates = [1.0 / truth.verify[0]]
    for w in range(2, BLOCK + 1):
        n = min(range(w, BLOCK + 1), key=lambda n: truth.draft[n - 1])
        rates.append((accepted_at(alpha, w) + 1) / true_cost(truth, w, n))
    return max(rates)


@pytest.mark.parametrize(
    "calibrated, truth, alpha",
    [
        pytest.param(CPU, BLAS, 0.9, id="steep-cal-flat-device"),
        pytest.param(CPU, BLAS, 0.7, id="steep-cal-flat-device-a.7"),
        pytest.param(BLAS, CPU, 0.9, id="flat-cal-steep-device"),
        pytest.param(BLAS, CPU, 0.5, id="a.5"),
    ],
)
def test_a_stale_calibration_is_unlearnt_within_a_thousand_tokens(calibrated, truth, alpha):
    """Calibrated under one BLAS, decoding under another (nothing is re-measured: costs are
    learnt from the passes): after its first thousand tokens the policy runs within 5% of
    the best fixed width on the device as it really is."""
    policy = AutoPolicy(calibrated, BLOCK)
    log = drive(
        policy, lambda w, n: true_cost(truth, w, n), lambda c, w: accepted_at(alpha, w), 4000
    )
    got = rate(log, skip=1000) / best_fixed_rate(truth, alpha)
    assert got >= 0.95, got


def test_earlier_requests_acceptance_is_a_prior_a_few_cycles_outweigh():
    """Acceptance belongs to the text: after a request whose drafts were all wrong, a few
    cycles of a new one whose drafts are right make it speculate wide."""
    policy = AutoPolicy(curves(lambda w: 1.0 + 0.25 * w, lambda n: 0.5), BLOCK)
    first = policy.begin(None)
    learn_acceptance(policy, first, 0.0)  # one prompt on which the draft is useless
    assert width(policy, first) == 1
    second = policy.begin(None)
    # A few cycles of this prompt, every draft right: at most as many as the pooled
    # evidence of other texts counts for.
    learn_acceptance(policy, second, 1.0, cycles=int(POOLED_CYCLES))
    assert width(policy, second) >= 8
    fresh = AutoPolicy(policy.table.curves, BLOCK)
    third = fresh.begin(None)
    learn_acceptance(fresh, third, 1.0, cycles=1)
    assert width(fresh, third) >= 8, "no earlier text: one cycle is enough"


def test_forget_drops_what_requests_taught_but_not_the_calibration():
    policy = AutoPolicy(FLAT, BLOCK)
    t = policy.begin(None)
    learn_acceptance(policy, t, 0.0)
    policy.learn(Record((Ask(t, 100, 10**6),), (1,), (0,), 100, 5.0))
    plain = Shape(1, 1, 1, 100)
    assert policy.table.cost(plain) != FLAT.verify[0] and any(policy.pool.trials)
    policy.forget()
    assert policy.table.cost(plain) == FLAT.verify[0]
    assert not any(policy.pool.trials) and policy.bank == 0.0 and not policy.table.looked


def test_teach_decays_old_evidence():
    t = Ticket([0.0] * 4, [0.0] * 4)
    teach(t, 4, 3)
    assert t.trials[1:] == [1.0, 1.0, 1.0] and t.hits[1:] == [1.0, 1.0, 1.0]
    teach(t, 4, 0)
    assert t.trials[1] == pytest.approx(1.95) and t.hits[1] == pytest.approx(0.95)
    assert t.trials[2] == pytest.approx(0.95), "positions after a rejection are not tried"


# -- the policy in the decode loop ------------------------------------------------------------


def test_the_decode_loop_tells_the_policy_each_cycles_depth_and_begins_each_request(target, draft):
    from .sim import SimClock, decode, records

    model, tok = target
    ids = tok.encode("import os\nimport sys\n" * 10)
    policy = AutoPolicy(BLAS, BLOCK)
    pair = Pair(model, draft)
    tickets = []
    for _ in range(2):
        _, events = decode(pair, ids, 12, policy, clock=SimClock(BLAS))
        learnt = records(events)
        depths = [r.depth for r in learnt]
        assert depths[0] == len(ids) and depths == sorted(depths) and depths[-1] < len(ids) + 12
        tickets.append({id(a.ticket) for r in learnt for a in r.asks})
    assert len(tickets[0]) == len(tickets[1]) == 1 and tickets[0] != tickets[1], (
        "each request is its own row in the policy"
    )


# The captured layers and the projection of a row of context at 0.5% of a plain step.
CHEAP_CONTEXT = dict(lazy=0.005, context=0.005)


@pytest.mark.parametrize("repeats", [12, 3])
def test_prefill_builds_no_draft_context_for_a_draft_expected_dormant(target, draft, repeats):
    """A policy that plans plain decoding from the first cycle: prefill projects nothing
    for the draft (the prompt's last `window` positions wait, unevaluated, for the first
    probe, which catches up on them and the plain steps' rows); one that plans to
    speculate: prefill projects the whole prompt, and nothing is caught up. Both lossless."""
    from mlx_lm.generate import generate_step

    from .sim import SimClock, decode

    model, tok = target
    ids = tok.encode("def parse(line):\n    return line.split(',')\n" * repeats)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=120, sampler=None)]
    # Plain pays at the prior acceptance (1/2), a probe loses little.
    dear = CostCurves(
        tuple(1.0 + 0.6 * (w - 1) for w in range(1, BLOCK + 1)), (0.01,) * BLOCK, **CHEAP_CONTEXT
    )
    cheap = CostCurves(BLAS.verify, BLAS.draft, **CHEAP_CONTEXT)
    for costs, dormant in ((dear, True), (cheap, False)):
        policy = AutoPolicy(costs, BLOCK)
        policy.window = 8
        cycles, events = decode(Pair(model, draft), ids, 120, policy, clock=SimClock(costs))
        assert [t for c in cycles for t in c.tokens] == ref
        kinds = [e.kind for e in events]
        first_verify = kinds.index("verify")
        caught = [e for e in events[:first_verify] if e.kind == "catch-up"]
        if dormant:
            assert kinds[kinds.index("prefill") + 1 : first_verify].count("plain") >= 1
            assert caught, "no catch-up before the first probe: the context was built"
            assert caught[0].tokens < len(ids) - 1, caught[0]
        else:
            assert caught == [], f"a built context was caught up: {caught}"
            assert "plain" not in kinds[:first_verify]


# -- calibration and stats ----------------------------------------------------------------------


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
    monkeypatch.setattr(sysinfo, "_conditions", None)
    calibrate.load_or_measure(pair)
    calibrate.load_or_measure(pair)
    assert len(calls) == 1
    # The same process, later: OpenBLAS is not what was loaded, or the Mac is on battery.
    for what, value in (("blas_library", "libopenblas.so.0"), ("_power_source", "Battery")):
        monkeypatch.setattr(sysinfo, what, lambda value=value: value)
        monkeypatch.setattr(sysinfo, "_conditions", None)
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

    blas = sysinfo.blas_library() or ""
    assert "openblas64" not in blas and "scipy_openblas" not in blas
