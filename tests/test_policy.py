"""Properties of the automatic width's rule (`speed.policy.choose`) over random inputs, of
`AutoPolicy` learning from a stream of cycles on a fake clock, and of the engine driven by
it on a simulated device (`tests/sim.py`): costs never come from the wall."""

from __future__ import annotations

import math
import random

import pytest

from dflash_mlx.speed.costs import CostCurves
from dflash_mlx.speed.policy import PROBE_SHARE, AutoPolicy, Estimate, choose

from .sim import SimClock, curves, decode, drive, plans, records, tokens

EXAMPLES = 300

try:  # hypothesis drives the random inputs where it is installed (and shrinks a failure)
    from hypothesis import given, settings
    from hypothesis import strategies as st

    def forall(test):
        run = given(st.randoms(use_true_random=False))(test)
        return settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)(run)

except ImportError:  # a seeded loop

    def forall(test):
        def run():
            for seed in range(EXAMPLES):
                test(random.Random(seed))

        run.__name__, run.__doc__ = test.__name__, test.__doc__
        return run


# -- random inputs ----------------------------------------------------------------------------


def random_costs(r: random.Random, block: int | None = None) -> list[float]:
    """Seconds of a cycle of width 1..B over the rows: plain first, never cheaper wider."""
    block = block or r.randint(2, 16)
    costs = [r.uniform(0.2, 3.0)]
    for _ in range(2, block + 1):
        step = r.choice([0.0, r.uniform(0.0, 0.2), r.uniform(0.0, 1.5)])
        costs.append(costs[-1] + step * costs[0])
    return costs


def random_rows(r: random.Random, block: int, alpha=None, sd=None) -> list[Estimate]:
    rows = []
    for _ in range(r.randint(1, 4)):
        shape = r.choice([0.2, 1.0, 4.0])  # mostly right, uniform, mostly wrong
        alphas = tuple(
            alpha if alpha is not None else r.random() ** shape for _ in range(block - 1)
        )
        sds = tuple(sd if sd is not None else r.uniform(0.0, 0.3) for _ in range(block - 1))
        rows.append(Estimate(alphas, sds, r.choice([r.randint(1, 20), r.randint(1, 500)])))
    return rows


def random_case(r: random.Random):
    costs = random_costs(r)
    rows = random_rows(r, len(costs))
    catch = r.choice([0.0, r.uniform(0.0, 3.0) * costs[0]])
    bank = r.choice([0.0, r.uniform(0.0, 3.0) * costs[0], 100.0 * costs[0]])
    return costs, rows, catch, bank, r.random() < 0.5


def committed(row: Estimate, width: int, low: bool = False) -> float:
    """E[tokens a cycle of `width` commits] for `row`, written out again (not `tokens`):
    the anchor's token, then each draft while every draft before it was accepted."""
    total, reach = 1.0, 1.0
    for j in range(min(width, row.left) - 1):
        a = row.alphas[j] - (row.sds[j] if low else 0.0)
        reach *= min(max(a, 0.0), 1.0)
        total += reach
    return total


# -- the rule ---------------------------------------------------------------------------------


def always_wrong(r: random.Random, short: bool):
    """Rows whose drafts are always wrong (alphas 0, no doubt), on costs where no width
    could pay even were every draft right (a W-wide cycle costs W plain steps or more);
    `short`: some row has fewer tokens left than the widest width."""
    block = r.randint(3, 16)
    plain = r.uniform(0.2, 3.0)
    rows = random_rows(r, block, alpha=0.0, sd=0.0)
    lefts = [r.randint(1, block - 1) if short else r.randint(block, 500) for _ in rows]
    rows = [Estimate(x.alphas, x.sds, left) for x, left in zip(rows, lefts)]
    costs = [plain] + [plain * w * r.uniform(1.0, 1.5) for w in range(2, block + 1)]
    catch = r.choice([0.0, r.uniform(0.0, 2.0) * plain])
    return costs, rows, catch


@forall
def test_drafts_always_wrong_decode_plainly_where_a_probe_cannot_pay(r):
    """(a) Drafts always wrong and no width that could pay: plain, and no probe, whatever
    the bank. Before any speculative cycle was timed the rule may look at the cheapest
    width (the calibration may be stale), but only from the bank: with none, nothing."""
    costs, rows, catch = always_wrong(r, short=False)
    c = choose(costs, rows, catch, r.choice([0.0, 1e9]), looked=True)
    assert (c.width, c.probe) == (1, False), c
    c = choose(costs, rows, catch, 0.0, looked=r.random() < 0.5)
    assert (c.width, c.probe) == (1, False), c


@forall
def test_drafts_always_wrong_near_the_end_decode_plainly(r):
    """(a) The same, with fewer tokens left than the widest width: a probe then can win
    back even less. E.g. `choose([1, 2, 3], [Estimate((0, 0), (0, 0), left=1)], 0, 100,
    True)` probes W = 3."""
    costs, rows, catch = always_wrong(r, short=True)
    c = choose(costs, rows, catch, 1e9, looked=True)
    assert (c.width, c.probe) == (1, False), (c, costs, rows, catch)


@forall
def test_drafts_always_right_on_free_rows_go_widest(r):
    """(b) alphas 1 with no doubt, every width costing what a plain step costs, and tokens
    to spare: the widest width, planned (no probe)."""
    block = r.randint(2, 16)
    plain = r.uniform(0.2, 3.0)
    rows = [
        Estimate((1.0,) * (block - 1), (0.0,) * (block - 1), r.randint(block, 1000))
        for _ in range(r.randint(1, 4))
    ]
    c = choose([plain] * block, rows, 0.0, r.uniform(0.0, 10.0), r.random() < 0.5)
    assert (c.width, c.probe) == (block, False), c


@forall
def test_dearer_wide_passes_never_widen_the_planned_width(r):
    """(c) Widths from some k on made dearer by a factor (or all widths by factors growing
    with W): the width the rule plans (a probe counts as plain: it is a look) is never
    wider."""
    costs, rows, catch, bank, looked = random_case(r)
    if r.random() < 0.5:
        k, f = r.randint(2, len(costs)), 1.0 + r.uniform(0.0, 2.0)
        dearer = [c * f if w >= k else c for w, c in enumerate(costs, 1)]
    else:
        dearer, f = [costs[0]], 1.0
        for c in costs[1:]:
            f *= 1.0 + r.choice([0.0, r.uniform(0.0, 0.5)])
            dearer.append(c * f)
    before = choose(costs, rows, catch, bank, looked)
    after = choose(dearer, rows, catch, bank, looked)
    planned = [1 if c.probe else c.width for c in (before, after)]
    assert planned[1] <= planned[0], (before, after)


@forall
def test_a_planned_width_beats_plain_with_every_alpha_one_sd_low(r):
    """(d) The floor: a width > 1 that is not a probe commits, with each alpha one standard
    deviation low, more tokens per second than plain decoding, its catch-up included."""
    costs, rows, catch, bank, looked = random_case(r)
    c = choose(costs, rows, catch, bank, looked)
    if c.width == 1 or c.probe:
        return
    n, plain = len(rows), costs[0]
    low = sum(committed(row, c.width, low=True) for row in rows)
    assert low / costs[c.width - 1] > n / plain, (c, low, costs)
    mean = sum(committed(row, c.width) for row in rows)
    assert mean / costs[c.width - 1] > n / plain


@forall
def test_a_probe_happens_only_when_the_bank_covers_its_worst_case(r):
    """(e) A probe of width W is made only when the bank holds what it loses were every
    draft wrong: costs[W - 1] - costs[0] + what waking the draft costs (`wake`, default
    `catch`), or, where the estimate expects W to pay (acceptance as estimated, not taken
    low), when the bank is not in debt; else plain, with the plain steps until one could be
    paid at `PROBE_SHARE` of each."""
    costs, rows, catch, bank, looked = random_case(r)
    wake = r.choice([None, r.uniform(0.0, 2.0) * costs[0]])
    c = choose(costs, rows, catch, bank, looked, wake)
    worst = catch if wake is None else wake
    if c.probe:
        assert c.width > 1 and c.wait == 0.0
        mean = sum(e.tokens(c.width) for e in rows) * costs[0] / len(rows)
        left = min(e.left for e in rows)
        spread = catch / max(left / max(mean / costs[0] / len(rows) * len(rows), 1.0), 1.0)
        hopeful = mean - costs[c.width - 1] - spread > 0
        assert bank >= (0.0 if hopeful else costs[c.width - 1] - costs[0] + worst), (c, bank)
    elif c.width == 1 and c.wait < math.inf:
        assert c.wait > 0
        # Given the bank it waits for, the same inputs probe.
        more = bank + c.wait * PROBE_SHARE * costs[0] * (1 + 1e-9)
        assert choose(costs, rows, catch, more, looked, wake).probe


# -- AutoPolicy on a fake clock ---------------------------------------------------------------

BLOCK = 16
PLAIN = 0.01
STEEP = curves(lambda w: PLAIN * w, lambda n: 0.1 * PLAIN * n)  # W tokens: W plain steps
FLAT = curves(lambda w: PLAIN * (1 + 0.02 * w), lambda n: 0.05 * PLAIN)  # wide ~ free
# Speculation dear, but paying were every draft right: W tokens cost (W + 1) / 2 steps.
HALF = curves(lambda w: PLAIN * (1 + w) / 2, lambda n: 0.05 * PLAIN)


def run(policy: AutoPolicy, truth: CostCurves, right, steps: int, depth: int = 100):
    """`sim.drive` on a device whose passes cost what `truth` says, `right(cycle)` drafts
    accepted: the widths planned per cycle (probes marked), the seconds of plain steps and
    what speculative cycles lost against plain decoding."""
    step = truth.target(1, depth)

    def cost(w, block):
        return step if w == 1 else truth.target(w, depth) + truth.drafting(1, block, depth)

    log = drive(policy, cost, lambda c, w: right(c), steps, depth=depth)
    plain_time = sum(s * times for w, _, _, s, times in log if w == 1)
    lost = sum(s - (n + 1) * step for w, _, n, s, _ in log if w > 1)
    return [(w, probe) for w, probe, *_ in log], plain_time, lost


@pytest.mark.parametrize("calibrated", [HALF, FLAT], ids=["true-calibration", "stale"])
def test_a_policy_where_speculation_is_dear_stays_plain_and_probes_within_its_share(calibrated):
    """(f) Drafts never right, speculation dear on the device: after what it learns from
    its first cycles, width 1 is planned and every speculative cycle is a probe, and probes
    lose at most `PROBE_SHARE` of the plain time plus one probe's loss."""
    policy = AutoPolicy(calibrated, BLOCK)
    if calibrated is FLAT:  # a stale calibration: it speculates until its cycles say
        log, _, _ = run(policy, HALF, lambda c: 0, 64)
        assert [w for w, _ in log[3:]].count(1) >= len(log[3:]) - 1, log
    log, plain_time, lost = run(policy, HALF, lambda c: 0, 20000)
    assert all(probe for w, probe in log if w > 1), "a speculative cycle that was not a probe"
    probes = sum(probe for _, probe in log)
    assert probes >= 3, "speculation is still looked at now and then"
    one = HALF.target(BLOCK, 100) + HALF.drafting(1, BLOCK, 100) - PLAIN
    assert lost <= PROBE_SHARE * plain_time + one, (lost, plain_time)


@pytest.mark.parametrize("calibrated", [FLAT, STEEP], ids=["true-calibration", "stale"])
def test_a_policy_where_wide_verifies_are_free_and_drafts_right_speculates_soon(calibrated):
    """(f) Drafts always right and wide verifies nearly free: width > 1 is planned (not as a
    probe) after at most a few cycles, and wide. From a stale calibration that says a W-wide
    cycle costs W plain steps, after the first look the bank pays for (how wide it then
    grows: `test_adaptive.test_a_stale_calibration_is_unlearnt_within_a_hundred_cycles`)."""
    policy = AutoPolicy(calibrated, BLOCK)
    log, _, _ = run(policy, FLAT, lambda c: BLOCK, 2000)
    first = next(i for i, (w, probe) in enumerate(log) if w > 1 and not probe)
    if calibrated is FLAT:
        assert first <= 3, log[:12]
        assert min(w for w, _ in log[first + 3 : -1]) >= 8, log
    else:
        look = next(i for i, (w, probe) in enumerate(log) if probe)
        assert first == look + 1 and look <= 8, log[:12]
        assert all(w > 1 for w, _ in log[first:-1]), log


def test_a_plain_plan_stands_until_the_bank_pays_for_a_probe():
    """Plain steps pay for no decision: a plain plan stands for the steps until the bank
    could pay for a probe (less the window the draft's context is kept current over), so
    between two probes the policy plans at most three times (the wait is re-estimated when
    the window opens and when the estimate's hopes move)."""
    policy = AutoPolicy(HALF, BLOCK)
    log, _, _ = run(policy, HALF, lambda c: 0, 5000)
    probes = sum(probe for _, probe in log)
    assert probes >= 100, probes
    assert len(log) - probes <= 3 * (probes + 1), f"{len(log)} decisions for {probes} probes"


# -- the engine on a simulated device ---------------------------------------------------------


@pytest.fixture
def greedy(target):
    from .test_decode import PROMPTS, target_greedy

    model, tok = target
    ids = tok.encode(PROMPTS[1])
    return ids, target_greedy(model, ids, 120)


def test_the_engine_on_a_device_where_verifies_cost_their_width_decodes_plainly(
    target, draft, greedy
):
    """(g) Each W-token verify charged W plain steps: auto decodes plainly but for its probes,
    and what it decodes is the target's greedy decode."""
    from dflash_mlx import Pair

    model, _ = target
    ids, ref = greedy
    policy = AutoPolicy(STEEP, BLOCK)
    cycles, events = decode(Pair(model, draft), ids, 120, policy, clock=SimClock(STEEP))
    assert tokens(cycles) == ref
    made = plans(events)
    assert made and all(p.probe for p in made if max(p.widths) > 1), made
    learnt = records(events)
    assert all(r.probe for r in learnt if max(r.widths) > 1)
    assert sum(max(r.widths) == 1 for r in learnt) >= 1
    plain = sum(c.steps for c in cycles if c.width == 1)
    assert plain >= 0.8 * (len(ref) - 1), [c.width for c in cycles]


def test_the_engine_on_a_device_where_verifies_are_free_speculates_wide(target, draft, greedy):
    """(g) Verifies cost what a plain step does, drafting nothing, and the draft proposes
    what the target decodes: auto speculates wide from the first cycle, losslessly."""
    from dflash_mlx import Pair

    from .test_decode import ScriptedDraft

    model, _ = target
    ids, ref = greedy
    free = curves(lambda w: PLAIN, lambda n: 0.0)
    right = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: 99)
    cycles, events = decode(
        Pair(model, right), ids, 120, AutoPolicy(free, BLOCK), clock=SimClock(free)
    )
    assert tokens(cycles) == ref
    widths = [c.width for c in cycles[1:]]
    assert min(widths[:-1]) >= 8 and not any(p.probe for p in plans(events)), widths
    assert all(c.accepted == c.width - 1 for c in cycles[1:])
