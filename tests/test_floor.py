"""The floor under the width chooser (`costs.Floor`, SPEC 5.4): speculation settled against
plain decoding as measured, on a fake clock. Whatever the cost model gets wrong, the
automatic width cannot lose against plain decoding for long."""

from __future__ import annotations

import pytest

import dflash_mlx.speed.costs as costs
from dflash_mlx.speed.adaptive import FIRST_LOOK, CostCurves, WidthChooser
from dflash_mlx.speed.costs import Floor

from .test_adaptive import BLAS, BLOCK, CPU, accepted_at, best_fixed_rate, curves, true_cost


def blind(ch: WidthChooser, truth, alpha: float, cycles: int, extra: float = 0.0):
    """The engine on a fake clock, with a cost model that never sees what speculative
    cycles cost (as for trees, which it does not price, or host work it does not time):
    plain steps are observed, speculative cycles only settled, at their true seconds plus
    `extra`. [(tokens, seconds)] per cycle."""
    log = []
    for _ in range(cycles):
        w, n = ch.choose(depth=0)
        if w == 1:
            seconds = truth.verify[0]
            ch.observe(1, seconds)
            log.append((1, seconds))
            continue
        a = accepted_at(alpha, w)
        seconds = true_cost(truth, w, n) + extra
        ch.settle(a + 1, seconds)
        ch.update(w, a)
        log.append((a + 1, seconds))
    return log


def speed(log) -> float:
    return sum(t for t, _ in log) / sum(s for _, s in log)


def no_floor(monkeypatch):
    monkeypatch.setattr(costs.Floor, "losing", property(lambda self: False))
    monkeypatch.setattr(costs.Floor, "net", property(lambda self: 0.0))


def test_the_floor_settles_cycles_against_plain_decoding():
    f = Floor(decay=0.5, evidence=1.5)
    assert not f.losing and f.net == 0.0 and f.cycle_loss() == 0.0
    assert f.settle(tokens=3, seconds=2.0, plain_step=1.0) == pytest.approx(1.0)
    assert not f.losing, "one cycle that paid"
    f.settle(tokens=1, seconds=4.0, plain_step=1.0)  # lost 3 s
    f.settle(tokens=1, seconds=4.0, plain_step=1.0)
    assert f.losing and f.net < 0 and f.cycle_loss() == pytest.approx(-f.net)
    for _ in range(4):
        f.settle(tokens=8, seconds=2.0, plain_step=1.0)  # a good stretch wins it back
    assert not f.losing and f.cycle_loss() == 0.0
    f.charge(100.0)  # a catch-up that committed nothing
    assert f.losing


@pytest.mark.parametrize("alpha", [0.6, 0.8])
def test_a_cost_model_blind_to_what_cycles_cost_cannot_lose_for_long(alpha, monkeypatch):
    """Calibrated flat (speculation looks almost free), the device steep, and the cost model
    never told what speculative cycles really cost: settled against plain decoding, the
    chooser backs off and decodes within 3% of plain decoding. Without the floor it keeps
    believing its calibration and loses several times that."""
    plain = 1.0 / CPU.verify[0]
    ch = WidthChooser(BLAS, BLOCK)
    assert speed(blind(ch, CPU, alpha, 3000)) >= 0.97 * plain
    assert ch.floor.losing
    no_floor(monkeypatch)
    assert speed(blind(WidthChooser(BLAS, BLOCK), CPU, alpha, 3000)) < 0.85 * plain


def test_host_work_the_model_does_not_see_is_found_out():
    """The cost model sees each cycle's passes but not a host cost each speculative cycle
    pays (a slow machine's Python, a busy core): what they really give decides."""
    flat_but_dear = 3.0  # seconds of host work per speculative cycle, never observed
    ch = WidthChooser(BLAS, BLOCK)
    log = blind(ch, BLAS, 0.6, 3000, extra=flat_but_dear)
    plain = 1.0 / BLAS.verify[0]
    assert speed(log) >= 0.97 * plain, speed(log) / plain


def test_across_short_requests_a_losing_device_costs_at_most_the_probe_budget(monkeypatch):
    """Many short requests on a device where no width pays: the interval between probes
    keeps growing from request to request (a new request does not reset it while what
    speculation lately gave, as measured, is a loss), so their probes cost ~the probe
    budget overall, not each request's own budget again and again."""

    def run():
        ch = WidthChooser(CPU, BLOCK)
        tokens = seconds = 0.0
        for _ in range(60):
            ch.begin_request()
            log = blind(ch, CPU, 0.5, 64, extra=0.5)
            tokens += sum(t for t, _ in log)
            seconds += sum(s for _, s in log)
        return tokens / seconds * CPU.verify[0]

    with_floor = run()
    assert with_floor >= 0.99, f"{1 - with_floor:.1%} lost to probes"
    no_floor(monkeypatch)
    assert run() < with_floor - 0.01, "without the floor each request probes afresh"


def test_after_a_request_whose_probes_all_lost_the_next_requests_probe_less():
    """256-token requests on a device where a wide verify costs 0.3 of a step a token (so
    drafts that were always right would pay, and probes are worth making) and no draft is
    ever right. The first request's probes, all lost, are too few cycles for the floor to
    call speculation `losing`; still, the next requests do not reset the interval and
    spend their whole budget again (on the stock wheel each request spent its 3%, 0.96x
    plain): each loses at most about one probe."""
    sub = curves(lambda w: 1.0 + 0.3 * (w - 1), lambda n: 0.3 + 0.05 * n)
    ch = WidthChooser(sub, BLOCK)
    rates, probes = [], []
    for _ in range(8):
        made = ch.probes
        rates.append(speed(request(ch, sub, 0.0, 256, extra=0.5)) * sub.verify[0])
        probes.append(ch.probes - made)
    assert probes[0] >= 1, "the first request looks"
    assert min(rates[1:]) >= 0.99, ([round(r, 3) for r in rates], probes)


# The demo pair's calibration on the stock wheel (in plain steps): a W=2 cycle costs 2.1
# plain steps, so no W=2 cycle can win; W=4 costs 3.0 and W=16 8.7, which drafts that are
# right often enough pay for.
STOCK_MS = (
    "3.81 5.28 6.56 7.86 8.67 9.68 10.86 12.51 13.5 14.89 15.59 16.88 18.01 19.09 20.24 21.36",
    "0 2.72 3.2 3.69 4.24 4.93 5.59 6.35 7.08 7.77 8.38 9.15 9.8 10.56 11.02 11.64",
)
STOCK = CostCurves(*(tuple(float(v) / 3.81 for v in ms.split()) for ms in STOCK_MS))


def test_probes_are_made_at_a_width_that_could_win():
    """Where a W=2 cycle cannot win even with its draft right (the stock wheel), probes
    that earlier unpredictable texts left at W=2 show nothing: a predictable text that
    follows is found by a probe at a width that could win, and speculation pays on it."""
    ch = WidthChooser(STOCK, BLOCK)
    for alpha in (0.0, 0.0, 0.95):
        log = request(ch, STOCK, alpha, 512)
    assert speed(log) >= 1.2 / STOCK.verify[0], speed(log) * STOCK.verify[0]


def test_the_first_look_at_a_calibration_times_the_cheapest_cycle():
    """On curves read back from a cache (not yet confirmed here), the first probe only has
    to time a cycle: it is the cheapest width, even where that width cannot win; once a
    cycle is timed, probes are made at a width that could."""
    ch = WidthChooser(STOCK, BLOCK, first_look=FIRST_LOOK)
    request(ch, STOCK, 0.0, 512)
    widths = ch.widths
    assert widths[0] == 2, widths
    assert len(widths) >= 2 and min(widths[1:]) >= 3, widths


def test_speculation_resumes_when_the_text_turns_predictable():
    """A stretch where every draft is wrong turns speculation off; when drafts turn good
    again, a probe finds it and the chooser is back within 10% of the best fixed width."""
    ch = WidthChooser(BLAS, BLOCK)
    blind(ch, BLAS, 0.0, 300)
    assert ch.choose(depth=0)[0] == 1 or ch.probing
    log = blind(ch, BLAS, 0.95, 1500)
    assert speed(log[300:]) >= 0.9 * best_fixed_rate(BLAS, 0.95)


def test_a_new_text_is_looked_at_while_the_floor_says_speculation_loses():
    """Short requests whose drafts are never right grow the interval between probes past a
    request's length and leave the floor losing; a request whose text is predictable is
    still probed within it (as its own budget affords) and speculates, instead of staying
    plain on the interval earlier texts grew."""
    ch = WidthChooser(BLAS, BLOCK)
    for _ in range(40):  # texts the draft never gets right
        ch.begin_request()
        blind(ch, BLAS, 0.0, 96, extra=0.5)
    assert ch.floor.losing and ch.probe_interval > 96, (ch.floor.losing, ch.probe_interval)
    ch.begin_request()
    log = blind(ch, BLAS, 0.95, 96)  # a predictable text: speculation pays on this device
    assert max(t for t, _ in log) > 1, "the predictable text was never probed"
    assert sum(t for t, _ in log) / len(log) > 2.0, "it did not speculate once it paid"


def request(
    ch: WidthChooser,
    truth,
    alpha: float,
    tokens: int,
    behind: tuple[int, int] = (0, 0),
    extra: float = 0.0,
) -> list[tuple[int, float]]:
    """One request of `tokens` tokens on a fake clock, the chooser told what is left (and
    what the draft's context is `behind` until the first speculative cycle: a dormant
    prefill's window); speculative cycles cost `extra` more (host work). Records the plain
    steps that captured features (`ch.captured`) and the speculative widths (`ch.widths`)."""
    ch.begin_request()
    log, left = [], tokens
    ch.captured, ch.widths = 0, []
    while left > 0:
        w, n = ch.choose(limit=left, depth=0, context=behind)
        behind = (0, 0) if w > 1 else behind
        ch.captured += w == 1 and ch.capture
        a = accepted_at(alpha, w) if w > 1 else 0
        seconds = true_cost(truth, w, n) + (extra if w > 1 else 0.0)
        if w > 1:
            ch.widths.append(w)
        ch.observe(w, seconds)
        if w > 1:
            ch.settle(a + 1, seconds)
        ch.update(w, a)
        log.append((a + 1, seconds))
        left -= a + 1
    return log


def test_a_short_request_may_spend_less_on_probes_than_a_long_one():
    """What a probe can win back grows with what is left to decode: a 64-token request on
    a device where speculation cannot pay makes no probe and captures nothing for one (with
    the whole 3% of its time it made one late: 0.97x plain on the stock wheel), a 512-token
    one still looks, within 3%. (On curves it trusts: `first_look` 0, as once a speculative
    cycle has been timed; `test_a_stale_calibration_that_prices_speculation_out_is_found_out`
    covers the first.)"""
    short = WidthChooser(CPU, BLOCK, first_look=0.0)
    request(short, CPU, 0.5, 64)
    assert short.probes == 0 and short.budget() == pytest.approx(0.015)
    assert short.captured == 0, "no plain step captures features for a probe that cannot come"
    dear = WidthChooser(CPU, BLOCK, request_budget=0.06, budget_tokens=0, first_look=0.0)
    request(dear, CPU, 0.5, 64)  # twice 3%, whole
    assert dear.probes >= 1 and dear.captured > 0, "the test shows nothing"
    long = WidthChooser(CPU, BLOCK, first_look=0.0)
    log = request(long, CPU, 0.5, 512)
    assert long.probes >= 1 and long.budget() == pytest.approx(0.03)
    plain = 512 * CPU.verify[0]
    assert sum(s for _, s in log) <= 1.03 * plain


def test_a_stale_calibration_that_prices_speculation_out_is_found_out():
    """Curves taken where a W-token verify costs W plain steps (the stock wheel), a device
    where wide verifies are nearly free (OpenBLAS), drafts right 9 times in 10, 96-token
    requests: no request's own budget (2.25% of it) pays the probe those curves price, so a
    chooser that trusts them stays plain for good (0.29x the best fixed width, measured);
    the first look, paid once from `first_look`, finds them out in the first request, and
    the requests after it run near the best fixed width. Where the curves were right, the
    look costs the one request it falls in at most `first_look` of its time, and no more
    probes come."""
    stock = CostCurves(CPU.verify, CPU.draft, context=0.01, lazy=0.01)
    window = (32, 0)  # each request's draft context starts a window behind
    trusting = WidthChooser(stock, BLOCK, first_look=0.0)
    logs = [request(trusting, BLAS, 0.9, 96, window) for _ in range(4)]
    assert trusting.probes == 0 and {t for log in logs for t, _ in log} == {1}, "shows nothing"
    looking = WidthChooser(stock, BLOCK)
    first, *rest = [request(looking, BLAS, 0.9, 96, window) for _ in range(4)]
    assert looking.looked and max(t for t, _ in first) > 1
    best = best_fixed_rate(BLAS, 0.9)
    assert speed(first) >= 0.5 * best, speed(first) / best
    for log in rest:
        assert speed(log) >= 0.9 * best, speed(log) / best

    right = WidthChooser(stock, BLOCK)
    logs = [request(right, stock, 0.5, 64, window) for _ in range(6)]
    assert right.probes == 1 and right.looked
    assert sum(s for _, s in logs[0]) <= (1.0 + FIRST_LOOK) * 64 * stock.verify[0]
    assert {t for log in logs[1:] for t, _ in log} == {1}, "no probe after the look"
