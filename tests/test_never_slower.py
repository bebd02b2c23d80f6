"""Probes priced with everything they cost (issue 27): the draft context a probe must catch
up on, its verify, and what is left of the request. Synthetic costs and fake clocks, no
wall time."""

from __future__ import annotations

import json

import pytest

import dflash_mlx.calibration as calibrate
from dflash_mlx import GenerateOptions, Pair
from dflash_mlx.engine.batch import speculative_decode
from dflash_mlx.speed.costs import CostCurves, CostTable
from dflash_mlx.speed.policy import POOLED_CYCLES, PROBE_SHARE, AutoPolicy
from dflash_mlx.speed.port import Ask, Record

from .sim import SimClock, decode, drive, records

BLOCK = 16
VERIFY = tuple(1.0 + 0.02 * w for w in range(1, BLOCK + 1))  # wide verifies nearly free
DRAFT = (0.0,) + (0.3,) * (BLOCK - 1)


def due_policy(row: float, window: int = 40) -> AutoPolicy:
    """A policy whose drafts proved useless (plain wins, probes come due), one speculative
    cycle measured, its bank full; a probe wakes the draft on a `window` of context rows,
    projecting a row costs `row` seconds."""
    policy = AutoPolicy(CostCurves(VERIFY, DRAFT, context=row, lazy=0.0), BLOCK)
    policy.window = window
    t = policy.begin(None)
    ask = Ask(t, 1000, 10**6)
    policy.learn(Record((ask,), (4,), (0,), 1000, VERIFY[3] + DRAFT[3], block=4))
    for _ in range(50):
        policy.learn(Record((ask,), (4,), (0,), 1000, None, block=4))
    policy.learn(Record((ask,), (1,), (0,), 1000, VERIFY[0], times=10**6))
    return policy


def first_probe(policy: AutoPolicy, tokens: int, rows: int = 40) -> int | None:
    """Plan plainly through a request of `tokens` tokens, the draft `rows` rows behind; the
    step its first probe came at (None: none)."""
    t = policy.begin(tokens)
    for i in range(tokens):
        plan = policy.plan([Ask(t, 1000, tokens - i, rows, 0)])
        if plan.widths[0] > 1:
            assert plan.probe
            return i
    return None


def test_a_probe_is_refused_when_its_context_costs_more_than_the_rest_of_the_request_can_gain():
    """A window of 40 rows at 1 s each cannot be won back over a 24-token request even were
    every draft right (plain 1.02 s, W=16 0.1 s a token); at 0.01 s a row it can; over 400
    tokens, 40 s can be won back too. The bank is full: what is left decides."""
    dear = due_policy(row=1.0)
    assert first_probe(dear, 24) is None
    assert first_probe(due_policy(row=0.01), 24) is not None
    assert first_probe(due_policy(row=1.0), 400) is not None


def test_a_probe_near_the_end_of_a_request_is_not_taken():
    """The same dear context: probes come in a long request, none in its last tokens."""
    policy = due_policy(row=0.25, window=8)
    t = policy.begin(300)
    probes_at = []
    for i in range(300):
        ask = Ask(t, 1000, 300 - i, 8, 0)
        plan = policy.plan([ask])
        w = plan.widths[0]
        if w > 1:
            probes_at.append(i)
            seconds = VERIFY[w - 1] + DRAFT[plan.blocks[0] - 1]
            rec = Record((ask,), (w,), (0,), 1000, seconds, block=plan.blocks[0], probe=True)
            policy.learn(rec)
        else:
            policy.learn(Record((ask,), (1,), (0,), 1000, VERIFY[0]))
    assert probes_at, "a long request probes"
    # 8 rows x 0.25 s = 2 s: about two tokens' worth of saving at best, plus the verify.
    assert max(probes_at) < 300 - 2, probes_at


def test_the_bank_counts_the_context_a_probe_catches_up_on():
    """Requests at depth, drafts never right, each probe first catching the draft up on 40
    rows: probes lose, their catch-ups included, at most `PROBE_SHARE` of the plain time
    (plus one probe's loss)."""
    row = 0.02
    policy = AutoPolicy(CostCurves(VERIFY, DRAFT, context=row), BLOCK)
    lost = plain = 0.0
    for _ in range(10):
        log = drive(
            policy,
            lambda w, n: VERIFY[0] if w == 1 else VERIFY[w - 1] + DRAFT[n - 1],
            lambda c, w: 0,
            200,
            depth=2000,
            behind=(40, 0),
            catch=lambda r, z: r * row,
        )
        lost += sum(s - VERIFY[0] for w, _, _, s, _ in log if w > 1)
        plain += sum(s * t for w, _, _, s, t in log if w == 1)
    assert lost > 0, "long enough requests probe"
    one = VERIFY[-1] + DRAFT[-1] - VERIFY[0] + 40 * row
    assert lost <= PROBE_SHARE * plain + one, (lost, plain)


def test_catch_up_costs_are_learnt_from_what_they_measure():
    table = CostTable(CostCurves(VERIFY, DRAFT, context=0.01))
    predicted = table.catch_up(40, 30, depth=0)
    for _ in range(20):
        table.learn_catch_up(40, 30, 0, 0.25 * predicted)  # catch-ups run 4x cheaper here
    assert table.catch_up(40, 30, depth=0) == pytest.approx(0.25 * predicted, rel=0.05)
    table.learn_catch_up(40, 30, 0, 100 * predicted)  # one stall: a nudge, not a new truth
    assert table.catch_up(40, 30, depth=0) < 0.6 * predicted
    assert table.catch_up(0, 0, depth=0) == 0.0


# -- the decode loop ---------------------------------------------------------------------------


def test_the_decode_loop_tells_the_policy_what_a_probe_caught_up_on(target, draft):
    """After a dormant prefill the first probe catches the draft up on the rows it is
    behind (a window of the prompt, deferred, and the plain steps captured since), and the
    cycle's record says so; a speculative cycle's successor is up to date."""
    model, tok = target
    ids = tok.encode("def parse(line):\n    return line.split(',')\n" * 12)
    # Plain pays at the prior acceptance; a probe loses little (cheap context).
    curves = CostCurves(
        tuple(1.0 + 0.6 * (w - 1) for w in range(1, BLOCK + 1)),
        (0.01,) * BLOCK,
        context=1e-3,
        lazy=1e-3,
    )
    policy = AutoPolicy(curves, BLOCK)
    policy.window = 8
    cycles, events = decode(Pair(model, draft), ids, 120, policy, clock=SimClock(curves))
    kinds = [e.kind for e in events]
    assert kinds[kinds.index("prefill") + 1] in ("plan", "plain"), "a plain first cycle"
    learnt = records(events)
    spec = [i for i, r in enumerate(learnt) if max(r.widths) > 1]
    assert spec, "no probe: the test shows nothing"
    probe = learnt[spec[0]]
    caught = next(e for e in events if e.kind == "catch-up")
    assert probe.probe and probe.caught == caught.tokens >= 1
    assert probe.lazy == caught.block >= 1, "the deferred window was computed by the probe"
    assert probe.caught_seconds > 0
    for i in spec:
        if i + 1 < len(learnt) and max(learnt[i + 1].widths) > 1:
            assert learnt[i + 1].caught == 0, "after a speculative cycle the draft is up to date"
    assert len(cycles) > 1


def test_a_batch_prices_and_pays_for_catching_its_rows_drafts_up(target, draft):
    """Rows of a batch that resume speculating after plain cycles catch their drafts'
    context up first (in one pass, summed over the rows), and the cycle's record reports
    what that took (priced for the next probes, charged to the bank)."""
    from dflash_mlx.engine.batch import BatchDecoder

    model, tok = target
    prompts = ["def parse(line):\n    return line.split(',')\n" * 3, "class Stack:\n" * 6]
    curves = CostCurves(
        tuple(1.0 + 0.6 * (w - 1) for w in range(1, BLOCK + 1)),
        (0.01,) * BLOCK,
        context=1e-3,
        lazy=1e-3,
    )
    policy = AutoPolicy(curves, BLOCK)
    policy.window = 8
    dec = BatchDecoder(Pair(model, draft), tok, max_batch=2)
    events = []
    dec.trace, dec.clock = events.append, SimClock(curves)
    for p in prompts:
        row = dec.submit(p, GenerateOptions(max_tokens=120))
        row.plan, row.eos = (BLOCK, BLOCK, policy), frozenset()  # both rows run to the end
    steps = 0
    while dec.busy and steps < 400:
        dec.step()
        steps += 1
    batched = [r for r in records(events) if r.rows == 2 and max(r.widths) > 1 and r.caught]
    assert batched, "the batch never resumed speculating with its drafts behind"
    assert batched[0].caught >= 2 and batched[0].caught_seconds > 0
    ups = [e for e in events if e.kind == "catch-up" and e.rows == 2]
    assert ups and ups[0].tokens == batched[0].caught, "both rows' drafts caught up, summed"


def test_forced_plain_decoding_builds_nothing_for_the_draft(target, draft, monkeypatch):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tok = target
    ids = tok.encode("class Stack:\n    def push(self, x):\n" * 4)
    calls = []
    real = type(draft).add_context
    monkeypatch.setattr(
        type(draft), "add_context", lambda self, f, s: calls.append(f.shape[1]) or real(self, f, s)
    )
    pair = Pair(model, draft)
    out = [
        t
        for c in speculative_decode(pair, ids, GenerateOptions(max_tokens=12, verify_width=1))
        for t in c.tokens
    ]
    ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=12, sampler=None)]
    assert out == ref and calls == [], calls
    list(speculative_decode(pair, ids, GenerateOptions(max_tokens=4, verify_width=2)))
    assert calls, "a speculating request does build the draft's context"


# -- calibration -------------------------------------------------------------------------------


def test_calibration_measures_the_context_projection_and_reads_older_files(
    target, draft, monkeypatch, tmp_path
):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    model, _ = target
    pair = Pair(model, draft)
    real = calibrate.measure
    monkeypatch.setattr(calibrate, "measure", lambda p, **k: real(p, repeats=1, depths=(16,), **k))
    curves = pair.costs()
    assert curves.context is not None and curves.context > 0
    assert curves.catch_up(10, 0, 16) == pytest.approx(10 * curves.context)
    # A file written before the projection was measured: read, the projection estimated.
    path = pair.calibration.path
    data = json.loads(path.read_text())
    del data["context"]
    path.write_text(json.dumps(data))
    pair.calibration.forget()
    monkeypatch.setattr(calibrate, "measure", None)  # must come from the file
    old = pair.costs()
    assert old.context is None and old.verify == curves.verify
    assert old.catch_up(10, 0, 16) == pytest.approx(10 * old.draft[-1] / len(old.draft))
    with pytest.raises(ValueError, match="context cost"):
        CostCurves(VERIFY, DRAFT, context=-1.0)


# -- what earlier requests taught --------------------------------------------------------------

DEEP = CostCurves(  # at depth: a wide verify costs several plain steps, as on a CPU at 1k+
    tuple(1.0 + 0.25 * (w - 1) for w in range(1, BLOCK + 1)), (0.0,) + (0.5,) * (BLOCK - 1)
)


def accepted_at(alpha: float, w: int) -> int:
    return sum(1 for j in range(1, w) if alpha**j >= 0.5)


def request(policy: AutoPolicy, alpha: float, tokens: int) -> tuple[float, list[int]]:
    """A request on a fake clock; its speed against plain decoding, and the widths it ran."""
    log = drive(
        policy,
        lambda w, n: DEEP.verify[w - 1] + (DEEP.draft[n - 1] if w > 1 else 0.0),
        lambda c, w: accepted_at(alpha, w),
        tokens,
        depth=0,
    )
    made = sum((n + 1) if w > 1 else t for w, _, n, _, t in log)
    spent = sum(s * t for *_, s, t in log)
    return made * DEEP.verify[0] / spent, [w for w, *_ in log]


def test_a_request_unlike_the_ones_before_falls_back_to_plain():
    """Drafts that were right in earlier requests (alpha 0.95) and are wrong in this one:
    what they taught is a prior its own failures overturn within a few cycles; the rest of
    the request decodes plainly."""
    policy = AutoPolicy(DEEP, BLOCK)
    for _ in range(6):
        request(policy, 0.95, 96)
    _, widths = request(policy, 0.0, 64)
    assert widths[0] > 1, "earlier texts' acceptance is a prior: the first cycle speculates"
    assert sum(w > 1 for w in widths) <= POOLED_CYCLES + 1 and widths[-1] == 1, widths


@pytest.mark.xfail(
    strict=True,
    reason="library: earlier texts' acceptance costs an unlike request 4 wrong W=14 cycles, "
    "0.81x plain over 64 tokens, was >= 0.95x (notes/tests-port.md, 4)",
)
def test_a_request_unlike_the_ones_before_loses_little_to_them():
    """... and loses little to them: within 5% of plain over a 64-token request."""
    policy = AutoPolicy(DEEP, BLOCK)
    for _ in range(6):
        request(policy, 0.95, 96)
    speed, _ = request(policy, 0.0, 64)
    assert speed >= 0.95, speed


def test_a_request_like_the_ones_before_still_speculates_from_its_start():
    policy = AutoPolicy(DEEP, BLOCK)
    for _ in range(6):
        request(policy, 0.95, 96)
    speed, widths = request(policy, 0.95, 64)
    assert widths[0] > 1 and widths[1] >= 8, widths[:3]
    assert speed >= 1.5, speed
