"""Probes priced with everything they cost (issue 27): the draft context a probe must build,
its verify, and what is left of the request. Synthetic costs and fake clocks, no wall time."""

from __future__ import annotations

import json

import pytest

import dflash_mlx.calibration as calibrate
from dflash_mlx import GenerateOptions, Pair
from dflash_mlx.engine.batch import speculative_decode
from dflash_mlx.speed.adaptive import CostCurves, WidthChooser

BLOCK = 16
VERIFY = tuple(1.0 + 0.02 * w for w in range(1, BLOCK + 1))  # wide verifies nearly free
DRAFT = (0.0,) + (0.3,) * (BLOCK - 1)


class Ignoring(WidthChooser):
    """The broken variant: a probe's catch-up of the draft's context costs nothing."""

    def context_cost(self, rows, lazy=0, depth=None):
        return 0.0


def due_chooser(kind, row: float, **kw) -> WidthChooser:
    """A chooser whose drafts proved useless (plain wins, probes come due), one speculative
    cycle measured, at the start of a new request; projecting a context row costs `row`."""
    ch = kind(CostCurves(VERIFY, DRAFT, context=row), BLOCK, **kw)
    ch.observe(4, VERIFY[3] + DRAFT[3])
    for _ in range(50):
        ch.update(4, 0)
    ch.begin_request()
    return ch


def first_probe(ch: WidthChooser, tokens: int, rows: int) -> int | None:
    """Decode plainly through a request of `tokens` tokens; the step its first probe came
    at (None: none), the draft `rows` rows behind all along."""
    for i in range(tokens):
        w, _ = ch.choose(limit=tokens - i, depth=1000, context=(rows, 0))
        if w > 1:
            return i
    return None


def test_a_probe_is_refused_when_its_context_costs_more_than_the_rest_of_the_request_can_gain():
    """40 rows at 1 s each cannot be won back over a 24-token request even were every draft
    right (plain 1.02 s, W=16 0.1 s a token); at 0.01 s a row they can. With the budget
    out of the way (request_budget=1), the gain over what is left is what decides."""
    dear = due_chooser(WidthChooser, row=1.0, request_budget=1.0)
    assert first_probe(dear, 24, rows=40) is None
    assert not dear.capture, "no probe can come: plain steps capture nothing for the draft"
    cheap = due_chooser(WidthChooser, row=0.01, request_budget=1.0)
    assert first_probe(cheap, 24, rows=40) is not None
    # The same request, longer: 400 tokens can pay 40 s back.
    assert first_probe(due_chooser(WidthChooser, row=1.0, request_budget=1.0), 400, 40) is not None
    # Context cost ignored: the dear probe is taken, and loses its 40 s.
    assert first_probe(due_chooser(Ignoring, row=1.0, request_budget=1.0), 24, rows=40) is not None


def test_a_probe_near_the_end_of_a_request_is_not_taken():
    """The same dear context: probes come early in a long request, none in its last tokens."""
    ch = due_chooser(WidthChooser, row=0.05, request_budget=1.0)
    probes_at = []
    for i in range(300):
        w, _ = ch.choose(limit=300 - i, depth=1000, context=(40, 0))
        if w > 1:
            probes_at.append(i)
            ch.update(w, 0)
    assert probes_at, "a long request probes"
    # 40 rows x 0.05 s = 2 s: about two tokens' worth of saving at best, plus the verify.
    assert max(probes_at) < 300 - 2, probes_at


def simulate(kind, requests: int = 10, tokens: int = 200, rows: int = 40, row: float = 0.02):
    """Short requests at depth, drafts never right, as the engine runs them on a fake clock:
    a speculative cycle after plain steps first catches the draft up (`rows` rows at `row`
    seconds each). Returns, per request, (seconds lost to probes, seconds spent)."""
    ch = kind(CostCurves(VERIFY, DRAFT, context=row), BLOCK, request_budget=0.03)
    out = []
    for _ in range(requests):
        ch.begin_request()
        lost = spent = 0.0
        behind = rows
        for i in range(tokens):
            w, n = ch.choose(limit=tokens - i, depth=2000, context=(behind, 0))
            seconds = VERIFY[0] if w == 1 else VERIFY[w - 1] + DRAFT[n - 1]
            if w > 1:
                catch_up = behind * row
                ch.observe_context(behind, 0, catch_up)
                seconds += catch_up
                lost += seconds - VERIFY[0]
                behind = 0
            else:
                behind += 1
            ch.observe(w, seconds - (catch_up if w > 1 else 0.0))
            ch.update(w, 0)
            spent += seconds
        out.append((lost, spent))
    return out


def test_the_request_budget_counts_the_context_a_probe_builds():
    for lost, spent in simulate(WidthChooser):
        assert lost <= 0.03 * spent + 1e-9, f"probes lost {lost / spent:.1%} of a request"
    assert sum(lost for lost, _ in simulate(WidthChooser)) > 0, "long enough requests probe"
    # Context cost ignored: probes lose more than the budget allows.
    worst = max(lost / spent for lost, spent in simulate(Ignoring))
    assert worst > 0.03, worst


def test_catch_up_costs_are_learnt_from_what_they_measure():
    ch = WidthChooser(CostCurves(VERIFY, DRAFT, context=0.01), BLOCK)
    predicted = ch.context_cost(40, 30, depth=0)
    for _ in range(20):
        ch.observe_context(40, 30, 0.25 * predicted)  # catch-ups run 4x cheaper here
    assert ch.context_cost(40, 30, depth=0) == pytest.approx(0.25 * predicted, rel=0.05)
    ch.observe_context(40, 30, 100 * predicted)  # one stall: a nudge, not a new truth
    assert ch.context_cost(40, 30, depth=0) < 0.6 * predicted
    assert ch.context_cost(0, 0) == 0.0


# -- the decode loop ---------------------------------------------------------------------------


def test_the_decode_loop_tells_the_chooser_what_a_probe_must_catch_up_on(target, draft):
    """After a dormant prefill the first probe is told the rows the draft is behind (the
    prompt's window, deferred, and the plain steps since), those rows are what it feeds,
    and what the catch-up took is reported; a speculative cycle's successor is up to date."""
    model, tok = target
    ids = tok.encode("def parse(line):\n    return line.split(',')\n" * 12)
    seen, observed = [], []

    class Recording(WidthChooser):
        def choose(self, limit=None, depth=None, context=(0, 0)):
            w, n = super().choose(limit, depth, context)
            seen.append((w, context))
            return w, n

        def observe_context(self, rows, lazy, seconds):
            observed.append((rows, lazy))
            super().observe_context(rows, lazy, seconds)

    flat = CostCurves(VERIFY, DRAFT, context=1e-4)
    ch = Recording(flat, BLOCK, window=8, prior=0.05, request_budget=1.0)
    assert ch.expects_plain(len(ids))
    pair = Pair(model, draft)
    cycles = list(
        speculative_decode(
            pair, ids, GenerateOptions(max_tokens=24), width=BLOCK, draft_block=BLOCK, chooser=ch
        )
    )
    probe = next(i for i, (w, _) in enumerate(seen) if w > 1)
    rows, lazy = seen[probe][1]
    # The window (8 positions and the prompt's last token) and every plain step before it
    # (decided one by one or standing, `coasting`).
    first = next(i for i, c in enumerate(cycles) if c.width > 1)
    steps = sum(len(c.tokens) for c in cycles[1:first])
    assert rows == ch.window + 1 + steps and lazy >= ch.window + 1, seen[probe]
    assert observed and observed[0] == (rows, lazy)
    if probe + 1 < len(seen):
        assert seen[probe + 1][1] == (0, 0), "after a speculative cycle the draft is up to date"
    assert len(cycles) > 1


def test_a_batch_prices_and_pays_for_catching_its_rows_drafts_up(target, draft, monkeypatch):
    """Rows of a batch that resume speculating after plain cycles catch their drafts'
    context up first (in one pass): the batch's chooser is told the rows they are behind,
    summed over the rows, before it decides, and what the catch-up took is reported to it
    (priced for the next probes, charged to its floor as time that committed nothing)."""
    from dflash_mlx.engine.batch import BatchDecoder

    model, tok = target
    prompts = ["def parse(line):\n    return line.split(',')\n" * 3, "class Stack:\n" * 6]
    seen, observed = [], []
    choose, observe_context = WidthChooser.choose, WidthChooser.observe_context

    def spy_choose(self, limit=None, depth=None, context=(0, 0)):
        w, n = choose(self, limit, depth, context)
        seen.append((self, w, context))
        return w, n

    def spy_context(self, rows, lazy, seconds):
        observed.append((self, rows, lazy))
        return observe_context(self, rows, lazy, seconds)

    monkeypatch.setattr(WidthChooser, "choose", spy_choose)
    monkeypatch.setattr(WidthChooser, "observe_context", spy_context)
    # Context cheap to build (the prompts' is, in prefill: `builds_context`).
    flat = CostCurves(VERIFY, DRAFT, context=1e-4, lazy=1e-4)
    base = WidthChooser(flat, BLOCK, window=8, request_budget=1.0, budget_tokens=0)
    dec = BatchDecoder(Pair(model, draft), tok, max_batch=2)
    for p in prompts:
        row = dec.submit(p, GenerateOptions(max_tokens=24))
        row.plan = (BLOCK, BLOCK, base)
    steps = 0
    while dec.busy and steps < 200:
        dec.step()
        steps += 1
    batched = [(c, w, ctx) for c, w, ctx in seen if c is not base and w > 1 and ctx[0]]
    assert batched, "the batch never resumed speculating with its drafts behind"
    chooser, _, (rows, lazy) = batched[0]
    assert rows >= 2, "both rows' drafts are behind: their rows are summed"
    assert (chooser, rows, lazy) in observed, "what was caught up is reported"


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
    assert curves.context_row() == curves.context
    # A file written before the projection was measured: read, the projection estimated.
    path = pair.calibration.path
    data = json.loads(path.read_text())
    del data["context"]
    path.write_text(json.dumps(data))
    pair.calibration.forget()
    monkeypatch.setattr(calibrate, "measure", None)  # must come from the file
    old = pair.costs()
    assert old.context is None and old.verify == curves.verify
    assert old.context_row() == pytest.approx(old.draft[-1] / len(old.draft))
    with pytest.raises(ValueError, match="context cost"):
        CostCurves(VERIFY, DRAFT, context=-1.0)


# -- what earlier requests taught --------------------------------------------------------------

DEEP = CostCurves(  # at depth: a wide verify costs several plain steps, as on a CPU at 1k+
    tuple(1.0 + 0.25 * (w - 1) for w in range(1, BLOCK + 1)), (0.0,) + (0.5,) * (BLOCK - 1)
)


class Trusting(WidthChooser):
    """The broken variant: what earlier requests' texts taught is trusted whole."""

    def begin_request(self):
        super().begin_request()
        self.carried = False


def accepted_at(alpha: float, w: int) -> int:
    return sum(1 for j in range(1, w) if alpha**j >= 0.5)


def request(ch: WidthChooser, alpha: float, tokens: int) -> tuple[float, list[int]]:
    """A request on a fake clock; its speed against plain decoding, and the widths it ran."""
    ch.begin_request()
    spent, made, widths = 0.0, 0, []
    while made < tokens:
        w, n = ch.choose(limit=tokens - made, depth=0)
        seconds = DEEP.verify[w - 1] + (DEEP.draft[n - 1] if w > 1 else 0.0)
        ch.observe(w, seconds)
        a = accepted_at(alpha, w) if w > 1 else 0
        ch.update(w, a)
        spent, made = spent + seconds, made + a + 1
        widths.append(w)
    return made * DEEP.verify[0] / spent, widths


@pytest.mark.parametrize("bad", [0.0, 0.3])
def test_a_request_unlike_the_ones_before_loses_one_cheap_cycle_to_them(bad):
    """Drafts that were right in earlier requests (alpha 0.95) and are wrong in this one:
    its first cycle risks no more than half the request's probe budget (1.5% of 64 plain
    steps) and one failure ends what they taught."""
    ch = WidthChooser(DEEP, BLOCK)
    for _ in range(6):
        request(ch, 0.95, 96)
    speed, widths = request(ch, bad, 64)
    first = DEEP.verify[widths[0] - 1] + DEEP.draft[widths[0] - 1]
    assert 1 < widths[0] < BLOCK and first - 1.0 <= 0.015 * 64, widths[0]
    assert sum(w > 1 for w in widths[:8]) == 1, widths[:8]
    assert speed >= 0.95, speed
    old = Trusting(DEEP, BLOCK)
    for _ in range(6):
        request(old, 0.95, 96)
    assert request(old, bad, 64)[0] < 0.9, "the test would pass with the trust whole"


def test_a_request_like_the_ones_before_still_speculates_from_its_start():
    ch, old = WidthChooser(DEEP, BLOCK), Trusting(DEEP, BLOCK)
    for _ in range(6):
        request(ch, 0.95, 96), request(old, 0.95, 96)
    speed, widths = request(ch, 0.95, 64)
    assert widths[0] > 1 and widths[1] >= 8, widths[:3]
    assert speed >= 0.9 * request(old, 0.95, 64)[0]
    # A long request's budget covers a wide first cycle.
    assert request(ch, 0.95, 1024)[1][0] >= 12
