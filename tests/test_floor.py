"""The floor under the automatic width (SPEC 5.4): whatever the calibration gets wrong,
`AutoPolicy` learns what cycles cost from the cycles it runs (host work included: a
cycle is timed sync to sync) and cannot lose against plain decoding for long; probes are
paid from a bank plain steps fill with `PROBE_SHARE` of their time. On a fake clock
(`sim.drive`)."""

from __future__ import annotations

import pytest

from dflash_mlx.speed.costs import CostCurves
from dflash_mlx.speed.policy import PROBE_SHARE, AutoPolicy

from .sim import drive, rate
from .test_adaptive import BLAS, BLOCK, CPU, accepted_at, best_fixed_rate, curves, true_cost


def request(policy, truth, alpha, tokens, extra=0.0, behind=(0, 0), catch=None):
    """One request on a device whose cycles cost `true_cost` (plus `extra` host seconds a
    speculative cycle), drafts accepted at conditional rate `alpha`."""
    return drive(
        policy,
        lambda w, n: true_cost(truth, w, n) + (extra if w > 1 else 0.0),
        lambda c, w: accepted_at(alpha, w),
        tokens,
        behind=behind,
        catch=catch,
    )


def widths(log) -> list[int]:
    return [w for w, *_ in log if w > 1]


@pytest.mark.parametrize("alpha", [0.6, 0.8])
def test_a_calibration_that_says_speculation_is_free_cannot_lose_for_long(alpha):
    """Calibrated flat (speculation looks almost free), the device steep: the cycles it
    runs teach what they cost, and it decodes within 3% of plain decoding."""
    plain = 1.0 / CPU.verify[0]
    log = request(AutoPolicy(BLAS, BLOCK), CPU, alpha, 3000)
    assert rate(log) >= 0.97 * plain, rate(log) / plain


def test_host_work_the_calibration_does_not_see_is_found_out():
    """The calibration times passes, not a host cost each speculative cycle pays (a slow
    machine's Python, a busy core): a cycle is timed sync to sync, so what speculation
    really gives decides."""
    log = request(AutoPolicy(BLAS, BLOCK), BLAS, 0.6, 3000, extra=3.0)
    plain = 1.0 / BLAS.verify[0]
    assert rate(log) >= 0.97 * plain, rate(log) / plain


def test_across_short_requests_a_losing_device_costs_at_most_the_probe_share():
    """Many short requests on a device where no width pays: the bank is the pair's, not a
    request's, so their probes cost about `PROBE_SHARE` overall, not a share each."""
    policy = AutoPolicy(CPU, BLOCK)
    tokens = seconds = 0.0
    for _ in range(60):
        log = request(policy, CPU, 0.5, 64, extra=0.5)
        tokens += sum((n + 1) * t if w > 1 else t for w, _, n, _, t in log)
        seconds += sum(s * t for *_, s, t in log)
    got = tokens / seconds * CPU.verify[0]
    assert got >= 1.0 - PROBE_SHARE - 0.005, f"{1 - got:.1%} lost to probes"


# The demo pair's calibration on the stock wheel (in plain steps): a W=2 cycle costs 2.1
# plain steps, so no W=2 cycle can win; W=4 costs 3.0 and W=16 8.7, which drafts that are
# right often enough pay for.
STOCK_MS = (
    "3.81 5.28 6.56 7.86 8.67 9.68 10.86 12.51 13.5 14.89 15.59 16.88 18.01 19.09 20.24 21.36",
    "0 2.72 3.2 3.69 4.24 4.93 5.59 6.35 7.08 7.77 8.38 9.15 9.8 10.56 11.02 11.64",
)
STOCK = CostCurves(*(tuple(float(v) / 3.81 for v in ms.split()) for ms in STOCK_MS))


def test_probes_are_made_at_a_width_that_could_win():
    """On the stock wheel W=2 cannot win (2.1 plain steps for at most 2 tokens): drafts
    never right, every probe is made at a width that could, and nothing else speculates.
    (Where no width could, the first look times the cheapest one:
    `test_where_the_calibration_was_right_the_first_look_is_the_only_probe`.)"""
    log = request(AutoPolicy(STOCK, BLOCK), STOCK, 0.0, 4000)
    probes = [w for w, probe, *_ in log if probe]
    assert len(probes) >= 2 and min(probes) >= 3, probes
    assert widths(log) == probes, "a speculative cycle that was not a probe"


def predictable_after_unpredictable(tokens: int) -> list:
    policy = AutoPolicy(STOCK, BLOCK)
    for alpha in (0.0, 0.0, 0.95):
        log = request(policy, STOCK, alpha, tokens)
    return log


def test_a_predictable_text_after_unpredictable_ones_is_found_by_a_probe():
    """Texts whose drafts are never right leave the policy plain; a predictable one that
    follows is found by a probe at a width that could win, and speculation pays on it."""
    log = predictable_after_unpredictable(1024)
    assert any(w > 1 and not probe for w, probe, *_ in log), "it never planned speculation"
    assert rate(log) >= 1.2 / STOCK.verify[0], rate(log) * STOCK.verify[0]


def test_a_predictable_text_after_unpredictable_ones_pays_within_512_tokens():
    log = predictable_after_unpredictable(512)
    assert rate(log) >= 1.2 / STOCK.verify[0], rate(log) * STOCK.verify[0]


def test_speculation_resumes_when_the_text_turns_predictable():
    """A stretch where every draft is wrong turns speculation off; when drafts turn good,
    a probe finds it and the policy is back within 10% of the best fixed width."""
    policy = AutoPolicy(BLAS, BLOCK)
    ticket = policy.begin(None)
    log = drive(policy, lambda w, n: true_cost(BLAS, w, n), lambda c, w: 0, 300, ticket=ticket)
    assert widths(log[-3:]) == [] or all(p for w, p, *_ in log[-3:] if w > 1)
    log = drive(
        policy,
        lambda w, n: true_cost(BLAS, w, n),
        lambda c, w: accepted_at(0.95, w),
        3000,
        ticket=ticket,
    )
    assert rate(log, skip=300) >= 0.9 * best_fixed_rate(BLAS, 0.95)


def test_a_new_text_is_looked_at_after_many_useless_ones():
    """Short requests whose drafts are never right; then a request whose text is
    predictable is probed within its 96 tokens and speculates."""
    policy = AutoPolicy(BLAS, BLOCK)
    for _ in range(40):
        request(policy, BLAS, 0.0, 96, extra=0.5)
    log = request(policy, BLAS, 0.95, 96)
    assert widths(log), "the predictable text was never probed"
    spec = [n + 1 for w, _, n, *_ in log if w > 1]
    assert sum(spec) / len(spec) > 2.0 and len(spec) >= 3, "it did not speculate once it paid"


def test_a_stale_calibration_that_prices_speculation_out_is_found_out():
    """Curves taken where a W-token verify costs W plain steps (the stock wheel), a device
    where wide verifies are nearly free (OpenBLAS), drafts right 9 times in 10, 96-token
    requests whose draft context starts a window behind: the first look, paid from the
    bank, finds the curves out, and the requests after it run near the best fixed width."""
    stock = CostCurves(CPU.verify, CPU.draft, context=0.01, lazy=0.01)
    policy = AutoPolicy(stock, BLOCK)
    logs = [
        request(policy, BLAS, 0.9, 96, behind=(32, 0), catch=lambda r, z: 0.01 * (r + z))
        for _ in range(16)
    ]
    looked = next(i for i, log in enumerate(logs) if widths(log))
    best = best_fixed_rate(BLAS, 0.9)
    got = [round(rate(log) / best, 2) for log in logs[looked + 1 :]]
    assert min(got) >= 0.9, got


def test_where_the_calibration_was_right_the_first_look_is_the_only_probe():
    """Curves that say no width can pay, and a device where they are right: one look (the
    cheapest width, paid from the bank) and at most one at twice its width (while one width
    alone was timed, one twice as wide is priced no dearer), then plain decoding for good."""
    stock = CostCurves(CPU.verify, CPU.draft, context=0.01, lazy=0.01)
    policy = AutoPolicy(stock, BLOCK)
    logs = [request(policy, stock, 0.5, 256) for _ in range(8)]
    looks = [w for log in logs for w in widths(log)]
    assert looks[:1] == [2] and set(looks[1:]) <= {3, 4} and len(looks) <= 2, looks
    spent = sum(s * t for log in logs for *_, s, t in log)
    assert spent <= (1.0 + PROBE_SHARE) * 8 * 256 * stock.verify[0]


def test_curves_with_a_steep_verify_on_a_steep_device_decode_plainly_at_any_length():
    """A request of any length on a device where no width pays, once a cycle was timed:
    no probe (none could win back what it loses)."""
    policy = AutoPolicy(CPU, BLOCK)
    request(policy, CPU, 0.5, 2048)  # the first look
    assert policy.table.looked
    for tokens in (64, 512):
        assert widths(request(policy, CPU, 0.5, tokens)) == []


def test_a_row_that_pays_only_with_right_drafts_is_probed_within_the_share():
    """A device where wide verifies cost 0.3 of a step a token (right drafts would pay) and
    no draft is ever right: probes keep looking, within `PROBE_SHARE` of the time."""
    sub = curves(lambda w: 1.0 + 0.3 * (w - 1), lambda n: 0.3 + 0.05 * n)
    policy = AutoPolicy(sub, BLOCK)
    got = []
    for _ in range(8):
        log = request(policy, sub, 0.0, 256, extra=0.5)
        got.append(rate(log) * sub.verify[0])
    assert sum(len(widths(request(policy, sub, 0.0, 256))) for _ in range(4)) >= 1
    assert sum(got) / len(got) >= 1.0 - PROBE_SHARE - 0.005, got
