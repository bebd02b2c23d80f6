"""Batched decoding (SPEC 8): every row's output is its solo run's, whatever joins or leaves.

The reference is always a request decoded alone: mlx-lm's own greedy decoding of the target,
or `generate` with the same seed at the same fixed width. Drafts that are partly right make
each row accept a different number of tokens every cycle, so the rows' rewinds differ; each
check is also run against a broken engine (a rewind applied to every row, one shared
offset, recurrent rows replayed together) to show it can fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import GenerateOptions, Pair, generate, load
from dflash_mlx.engine import batch_cache, batch_draft
from dflash_mlx.engine import batch_cycle as batch_mod
from dflash_mlx.engine import plain as plain_mod
from dflash_mlx.engine.batch import BatchDecoder, batch_generate
from dflash_mlx.engine.prefill import Request
from dflash_mlx.engine.sampling import PositionKeys, propose
from dflash_mlx.engine.walks import draft_keys
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.speed.costs import CostCurves
from dflash_mlx.speed.policy import DECAY, AutoPolicy
from dflash_mlx.speed.port import Ask, Record

from .test_decode import target_greedy

PROMPTS = [
    "def add(a, b):",
    "class Point:\n    def __init__(self, x, y):",
    "import os\nimport sys\n\n\ndef main():\n    x = [1, 2, 3]\n    for i in x:",
    "for i in range(10):\n    print(",
]
LENGTHS = [24, 40, 11, 33]  # rows leave at different cycles


class LookupDraft(DFlashDraft):
    """Proposes the reference continuation of whichever row it drafts for (found by its
    anchor at the draft context's end), wrong from a block index that changes with the
    position: rows accept different numbers of drafts in every cycle. A draft that drafts alone
    (`batch_draft.batchable` is false for it), so the batched *verify* is what is tested."""

    def __init__(self, base: DFlashDraft, scripts: list[list[int]]):
        super().__init__(base.config)
        self.update(base.parameters())
        self.scripts = scripts

    def block_logits(self, anchor, length, rows, state):
        pos, a = state.context_end, anchor.item()
        script = next((s for s in self.scripts if pos < len(s) and s[pos] == a), [])
        # 0 .. L-1 right before the first wrong one: a function of the row's position, so
        # that a row drafts the same batched or alone (seeds replay).
        right = (pos * 5) % self.config.block_size  # whatever rows are drafted
        vocab = self.config.vocab_size
        want = []
        for i in range(1, length):
            t = script[pos + i] if pos + i < len(script) else 0
            want.append(t if i <= right else (t + 1) % vocab)
        rows = length - 1 if rows is None else rows
        return (mx.eye(vocab)[mx.array(want)] * 30.0)[:rows]


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def case(request, models_dir, draft):
    """A dense or hybrid target, its reference continuations and a lookup draft."""
    model, tok = load(str(models_dir / request.param))
    ids = [tok.encode(p) for p in PROMPTS]
    refs = [target_greedy(model, i, n) for i, n in zip(ids, LENGTHS)]
    lookup = LookupDraft(draft, [i + r for i, r in zip(ids, refs)])
    return request.param, model, tok, ids, refs, lookup


def options(i: int, width: int | None, **kw) -> GenerateOptions:
    return GenerateOptions(max_tokens=LENGTHS[i], verify_width=width, **kw)


def run_mid_stream(pair, tok, ids, width, max_batch=8, joins=(0, 0, 1, 2)):
    """Rows submitted at the steps `joins` say (mid-stream), stepped to the end; each
    row's tokens and the batch sizes its cycles saw."""
    dec = BatchDecoder(pair, tok, max_batch=max_batch)
    tokens = {i: [] for i in range(len(ids))}
    stats = {}
    step = 0
    pending = sorted(range(len(ids)), key=lambda i: joins[i])
    while pending or dec.busy:
        while pending and joins[pending[0]] <= step:
            i = pending.pop(0)
            dec.submit(ids[i], options(i, width), handle=i)
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            stats[row.handle] = item.stats
        step += 1
    return tokens, stats, dec


@pytest.mark.parametrize("width", [None, 1, 2, 5])
def test_rows_joining_and_leaving_mid_stream_equal_their_solo_greedy(case, width):
    name, model, tok, ids, refs, lookup = case
    tokens, stats, dec = run_mid_stream(Pair(model, lookup), tok, ids, width)
    for i, ref in enumerate(refs):
        assert tokens[i] == ref, f"{name} W={width}: row {i} diverged from its solo decode"
    assert max(dec.sizes) >= 3, f"rows must have joined running ones: {dec.sizes}"
    if width == 1 and name == "qwen3":
        # Plain passes chained on the device (each launched before the last one's tokens
        # were read), across rows joining and leaving.
        assert dec.chained > 10, dec.chained
    if width is not None and width > 1:
        taus = [s.tau for s in stats.values()]
        assert max(taus) > 1.5, f"drafts must be accepted for the test to mean much: {taus}"
        assert sum(s.batches.get(3, 0) for s in stats.values()) > 0


def test_chained_plain_passes_survive_joins_cancels_and_eos(target, monkeypatch):
    """Plain rows whose next pass runs before their last tokens are read: a row that ends
    (its budget, or cancelled) while the next pass already ran for it, and a request that
    joins then, leave every other row's tokens its own (a cycle a step: no stretches,
    `test_stretch.py`)."""
    monkeypatch.setattr(plain_mod, "STRETCH_TOKENS", 1)
    model, tok = target
    pair = Pair(model, None)
    ids = [tok.encode(p) for p in PROMPTS]
    lengths = [3, 17, 9, 25]
    refs = [target_greedy(model, i, n) for i, n in zip(ids, lengths)]
    dec = BatchDecoder(pair, tok)
    got = {i: [] for i in range(4)}
    for i in (0, 1, 2):
        dec.submit(ids[i], GenerateOptions(max_tokens=lengths[i]), handle=i)
    steps = 0
    late = None
    while dec.busy:
        if steps == 6:  # joins while a chained pass is in flight
            dec.submit(ids[3], GenerateOptions(max_tokens=lengths[3]), handle=3)
        if steps == 8:
            late = dec.submit(tok.encode("x = 1"), GenerateOptions(max_tokens=30), handle="x")
        if steps == 10 and late is not None:
            dec.cancel(late)  # cancelled with a chained pass in flight
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            got[row.handle] = got.get(row.handle, []) + item.tokens
        steps += 1
    assert [got[i] for i in range(4)] == refs
    assert dec.chained > 5, dec.chained


def test_more_requests_than_the_batch_holds_queue_and_join_as_rows_leave(case):
    name, model, tok, ids, refs, lookup = case
    got = batch_generate(
        Pair(model, lookup), tok, ids, [options(i, 4) for i in range(4)], max_batch=2
    )
    assert [r.tokens for r in got] == refs
    sizes = set().union(*(r.stats.batches for r in got))
    assert sizes == {2}, f"never more than 2 rows in a pass, and 2 at times: {sizes}"
    assert any(r.stats.what_ran()["batches"] for r in got)


def broken_trim_every_row_alike(self, drops):
    """A rewind applied to every row: all rows drop what the row that kept least drops."""
    most = max(drops)
    self.lengths = [n - most for n in self.lengths]
    self.offset = mx.array(self.lengths)


def broken_shared_offset(self, drops):
    """One offset for every row: each row rewinds its own length, but all are positioned
    (RoPE) and masked at row 0's."""
    good_trim(self, drops)
    self.offset = mx.full((len(self.lengths),), self.lengths[0])


good_trim = batch_cache.RowsKVCache.trim_rows


def broken_replay_together(target, cache, keeps, snapshot, calls):
    """Recurrent rows all replayed over the longest row's prefix."""
    return good_replay(target, cache, [max(keeps)] * len(keeps), snapshot, calls)


good_replay = batch_cache.replay_rows


@pytest.mark.parametrize(
    "where,what,broken",
    [
        (batch_cache.RowsKVCache, "trim_rows", broken_trim_every_row_alike),
        (batch_cache.RowsKVCache, "trim_rows", broken_shared_offset),
        (batch_cache, "replay_rows", broken_replay_together),
    ],
)
def test_the_identity_check_catches_a_broken_batch(case, monkeypatch, where, what, broken):
    name, model, tok, ids, refs, lookup = case
    if what == "replay_rows" and name == "qwen3":
        pytest.skip("a dense target has no recurrent rows to replay")
    monkeypatch.setattr(where, what, broken)
    tokens, _, _ = run_mid_stream(Pair(model, lookup), tok, ids, 5)
    assert any(tokens[i] != ref for i, ref in enumerate(refs)), f"{what} broken, not caught"


@pytest.mark.parametrize("tree", [False, True])
def test_seeded_sampled_rows_replay_their_solo_runs_at_a_fixed_width(case, tree):
    name, model, tok, ids, refs, lookup = case
    pair = Pair(model, lookup)
    width = 6 if tree else 4
    opts = [options(i, width, temperature=0.9, seed=100 + i, tree=tree) for i in range(4)]
    solo = [generate(pair, tok, i, o).tokens for i, o in zip(ids, opts)]
    got = batch_generate(pair, tok, ids, opts)
    assert [r.tokens for r in got] == solo
    if tree and name == "qwen3":  # sampled trees verified in the batch's passes
        assert all(r.stats.trees for r in got) and max(got[0].stats.batches) >= 2
    other = batch_generate(pair, tok, ids, [o.replace(seed=o.seed + 7) for o in opts])
    assert [r.tokens for r in other] != solo, "another seed must sample differently"


def test_a_cancelled_row_stops_and_the_others_finish_as_alone(case):
    name, model, tok, ids, refs, lookup = case
    dec = BatchDecoder(Pair(model, lookup), tok)
    rows = [dec.submit(i, options(k, 3), handle=k) for k, i in enumerate(ids)]
    tokens = {k: [] for k in range(4)}
    after_cancel = []
    steps = 0
    while dec.busy:
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            if rows[1].cancelled:
                after_cancel.append(row.handle)
        steps += 1
        if steps == 6:
            dec.cancel(rows[1])
    assert 0 < len(tokens[1]) < len(refs[1]), "cancelled mid-stream"
    assert tokens[1] == refs[1][: len(tokens[1])]
    assert 1 not in after_cancel[1:], "a cancelled row responds no more"
    for k in (0, 2, 3):
        assert tokens[k] == refs[k]


def test_a_failing_row_ends_with_its_error_and_the_others_go_on(case, monkeypatch):
    name, model, tok, ids, refs, lookup = case
    real = batch_mod.make_drafts
    boom = RuntimeError("row 2's draft failed")

    def failing(req, *args, **kw):
        if req.prompt == ids[2] and len(req.generated) > 4:
            raise boom
        return real(req, *args, **kw)

    monkeypatch.setattr(batch_mod, "make_drafts", failing)
    dec = BatchDecoder(Pair(model, lookup), tok)
    for k, i in enumerate(ids):
        dec.submit(i, options(k, 4), handle=k)
    tokens, errors = {k: [] for k in range(4)}, {}
    while dec.busy:
        for row, item in dec.step():
            if isinstance(item, BaseException):
                errors[row.handle] = item
            else:
                tokens[row.handle] += item.tokens
    assert errors == {2: boom}
    for k in (0, 1, 3):
        assert tokens[k] == refs[k]
    with pytest.raises(RuntimeError, match="row 2"):
        batch_generate(Pair(model, lookup), tok, ids, [options(k, 4) for k in range(4)])


def test_rows_resume_from_their_prompt_caches(case):
    from dflash_mlx import PromptCache

    name, model, tok, ids, refs, lookup = case
    pair = Pair(model, lookup)
    caches = [PromptCache() for _ in ids]
    first = [
        generate(pair, tok, i, options(k, 4), prompt_cache=c)
        for k, (i, c) in enumerate(zip(ids, caches))
    ]
    follow = [i + r.tokens + tok.encode(" x") for i, r in zip(ids, first)]
    dec = BatchDecoder(pair, tok)
    for k, (p, c) in enumerate(zip(follow, caches)):
        dec.submit(p, GenerateOptions(max_tokens=12, verify_width=4), handle=k, prompt_cache=c)
    tokens, reused = {k: [] for k in range(4)}, {}
    while dec.busy:
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            reused[row.handle] = item.stats.cached_tokens
    for k, p in enumerate(follow):
        assert tokens[k] == target_greedy(model, p, 12)
        assert reused[k] > 0, "the conversation's prefix must come from its cache"


@pytest.mark.parametrize("stretch", [1, 32])
def test_chained_plain_rows_leave_prompt_caches_the_next_turn_resumes_from(
    target, monkeypatch, stretch
):
    """Rows decoded with chained plain passes (a cycle a step, or stretches) end with a
    position fed past their last token in their caches; the next turn resumes from those
    caches and is still the target's greedy decode."""
    from dflash_mlx import PromptCache

    monkeypatch.setattr(plain_mod, "STRETCH_TOKENS", stretch)

    model, tok = target
    pair = Pair(model, None)
    ids = [tok.encode(p) for p in PROMPTS]
    caches = [PromptCache() for _ in ids]
    first = batch_mod_run(pair, tok, ids, caches, [14, 9, 21, 6], cancel=(0, 5))
    follow = [i + t + tok.encode(" x") for i, (t, _) in zip(ids, first)]
    second = batch_mod_run(pair, tok, follow, caches, [10] * 4)
    for p, (tokens, reused) in zip(follow, second):
        assert tokens == target_greedy(model, p, 10)
        assert reused > 0, "the conversation's prefix must come from its cache"


def batch_mod_run(pair, tok, prompts, caches, lengths, cancel=None):
    """Every prompt at once, plain (chained passes), each with its prompt cache; `cancel`:
    (row, step) cancelled then, with a chained pass in flight. Per prompt (tokens, prompt
    tokens reused)."""
    dec = BatchDecoder(pair, tok)
    rows = [
        dec.submit(p, GenerateOptions(max_tokens=n), handle=k, prompt_cache=c)
        for k, (p, c, n) in enumerate(zip(prompts, caches, lengths))
    ]
    tokens, reused = {k: [] for k in range(len(prompts))}, {}
    step = 0
    while dec.busy:
        if cancel is not None and step == cancel[1]:
            if plain_mod.STRETCH_TOKENS == 1:
                assert dec._ahead is not None, "the next pass must be in flight"
            dec.cancel(rows[cancel[0]])
        step += 1
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            reused[row.handle] = item.stats.cached_tokens
    assert dec.chained > 0
    return [(tokens[k], reused[k]) for k in range(len(prompts))]


def test_a_long_prompt_is_prefilled_between_the_running_rows_cycles(case):
    """A prompt of many chunks arriving mid-stream: the running rows decode between its
    chunks (never stalled for more than one), and everyone's output is still its own."""
    name, model, tok, ids, refs, lookup = case
    long = tok.encode("\n".join(PROMPTS * 3))
    dec = BatchDecoder(Pair(model, lookup), tok)
    dec.submit(ids[1], options(1, 3), handle=1)
    order = []
    tokens = {1: [], "long": []}
    for _ in range(2):
        for row, item in dec.step():
            tokens[row.handle] += item.tokens
    dec.submit(long, GenerateOptions(max_tokens=8, verify_width=3, prefill_step=16), handle="long")
    while dec.busy:
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            order.append(row.handle)
    chunks = (len(long) - 1) // 16
    assert chunks >= 4
    before = order.index("long")
    # One cycle after each chunk but the last, or until the running row finished.
    want = min(chunks - 1, order.count(1))
    assert before >= want, f"{before} cycles of the running row during {chunks} chunks"
    assert before > 4
    assert tokens[1] == refs[1]
    assert tokens["long"] == target_greedy(model, long, 8)


def test_a_late_requests_first_token_waits_for_no_cycle_but_its_prefill(case):
    """A request arriving while four stream: the next step prefills it and hands out its
    first token before any further cycle of the others (time to first token: its own
    prefill, plus what was left of the cycle running when it arrived)."""
    name, model, tok, ids, refs, lookup = case
    dec = BatchDecoder(Pair(model, lookup), tok)
    for k, i in enumerate(ids):
        dec.submit(i, GenerateOptions(max_tokens=60, verify_width=3), handle=k)
    first = [dec.step() for _ in range(4)]  # one admission per step, each first token out
    assert [[(row.handle, item.width) for row, item in got] for got in first] == [
        [(k, 0)] for k in range(4)
    ]
    dec.step()  # a cycle of the four
    assert len(dec.active) == 4
    dec.submit(tok.encode("x = 1"), GenerateOptions(max_tokens=5, verify_width=3), handle="late")
    got = dec.step()
    assert [(row.handle, item.width) for row, item in got] == [("late", 0)]
    nxt = dec.step()
    assert {row.handle for row, _ in nxt} == {0, 1, 2, 3, "late"}, "then all decode together"


def test_a_batch_of_one_runs_as_a_request_alone(target, draft):
    model, tok = target
    pair = Pair(model, draft)
    ids = tok.encode(PROMPTS[0])
    solo = generate(pair, tok, ids, options(0, 4))
    (one,) = batch_generate(pair, tok, [ids], [options(0, 4)])
    assert one.tokens == solo.tokens
    assert one.stats.widths == solo.stats.widths
    assert one.stats.batches == {}, "a row alone is not counted as batched"


def test_batched_drafts_equal_each_rows_own(target, draft):
    """One draft pass over rows of different contexts, gaps, windows and sinks gives each
    row what its own pass gives."""
    model, tok = target
    pair = Pair(model, draft)
    dec = BatchDecoder(pair, tok)
    for k, p in enumerate(PROMPTS[:3]):
        window, sink = (16 if k else None), (3 if k == 2 else None)
        dec.submit(
            p,
            GenerateOptions(max_tokens=60, verify_width=4, draft_window=window, draft_sink=sink),
        )
    for _ in range(8):
        dec.step()
    reqs = [r.req for r in dec.active]
    assert len(reqs) == 3 and all(batch_draft.batchable(r) for r in reqs)
    for r in reqs:
        r.feed_draft()
    assert reqs[2].state.sink == 3 and reqs[2].state.context_length > 3 + 15, "no sink to see"
    reqs[1].state.skip_to(reqs[1].state.context_end + 5)  # a gap: RoPE distances kept
    anchors = [mx.array([t]) for t in (5, 9, 17)]
    starts = [len(r.generated) - 1 for r in reqs]
    alone = []
    for r, a in zip(reqs, anchors):
        alone.append(np.array(draft.block_logits(a, 8, 7, r.state)))
    got = []
    real_logits = DFlashDraft.logits

    def keep(self, h, head):
        out = real_logits(self, h, head)
        got.append(out)
        return out

    DFlashDraft.logits = keep
    try:
        batch_draft.propose_rows(reqs, anchors, starts, [8, 8, 8], 8)
    finally:
        DFlashDraft.logits = real_logits
    batched = np.array(got[0].astype(mx.float32))
    for b in range(3):
        np.testing.assert_allclose(batched[b], alone[b], atol=2e-3, rtol=2e-3)
    assert not np.allclose(alone[0], alone[1], atol=1e-2), "rows must differ for this to mean much"
    params = reqs[0].params
    one = propose(draft, reqs[0].state, anchors[0], 8, 3, params, PositionKeys(0)(0, 1, 3))
    assert one[0].tolist() == np.argmax(alone[0][:3], axis=-1).tolist()


def test_a_batchs_cycle_is_priced_as_its_whole_pass():
    """All rows' tokens through the target at once, a draft pass per row."""
    curves = CostCurves((1.0, 1.5, 2.0, 2.5), (0.0, 0.5, 0.6, 0.7))
    policy = AutoPolicy(curves, 4)
    four = policy.costs(4, 0)
    assert four[0] == 2.5  # four rows of one token: the curve at 4 tokens
    assert four[1] == 2.5 + 0.5 * 4 + 4 * 0.5  # 8 tokens (along the last segment), 4 drafts
    assert four[3] == pytest.approx(2.5 + 0.5 * 12 + 4 * 0.7)


def flat_policy() -> AutoPolicy:
    # A verify of 16 rows x 16 tokens costs what a plain one does: speculating pays.
    return AutoPolicy(CostCurves((1e-3,) * 16, (1e-4,) * 16), 16)


def batch_record(policy, tickets, accepted, seconds=None, width=16, probe=False):
    """What a cycle of the batch's rows (one `Ticket` each) at `width` taught."""
    asks = tuple(Ask(t, 100, 1000) for t in tickets)
    rec = Record(
        asks,
        (width,) * len(asks),
        tuple(accepted),
        100,
        seconds,
        block=width,
        rows=len(asks),
        probe=probe,
    )
    policy.learn(rec)
    return rec


def test_one_rows_short_first_cycle_keeps_the_batchs_pooled_acceptance():
    """Rows of four texts share the width: one row whose first cycle accepts nothing says
    its text differs, not that the others' acceptance is stale (the batch must not decode
    plainly on the prior alone)."""
    policy = flat_policy()
    earlier = policy.begin(None)
    for _ in range(30):
        batch_record(policy, [earlier], [15])  # texts whose drafts were all accepted
    tickets = [policy.begin(None) for _ in range(4)]
    batch_record(policy, tickets, [0, 15, 15, 15], seconds=1e-3)
    assert sum(policy.pool.hits) > 70, "the evidence carried from the texts before was dropped"
    plan = policy.plan([Ask(t, 100, 100) for t in tickets], rows=4)
    assert max(plan.widths) > 1 and not plan.probe


def test_a_batchs_probe_is_one_probe_not_one_a_row():
    """A probe the batch's policy made is counted once for the cycle (each row's request
    is told of it), its loss taken from the bank once, and every row's acceptance learnt."""
    # A verify of w tokens costs w plain steps: the batch's plain pass is what pays.
    policy = AutoPolicy(CostCurves(tuple(1e-3 * w for w in range(1, 17)), (1e-4,) * 16), 16)
    tickets = [policy.begin(None) for _ in range(4)]
    policy.bank = 1.0
    trials = list(policy.pool.trials)
    batch_record(policy, tickets, [0, 3, 1, 3], seconds=0.02, width=4, probe=True)
    assert policy.probes == 1 and [t.probes for t in tickets] == [1] * 4
    assert policy.bank < 1.0
    assert policy.pool.trials[1] == pytest.approx(
        trials[1] * DECAY**4 + sum(DECAY**k for k in range(4))
    ), "every row's acceptance reaches the pool"
    assert [t.trials[1] for t in tickets] == [1.0] * 4


def test_batched_speculation_that_loses_against_plain_batches_goes_plain():
    """Speculative batched cycles that commit a token a row for far more than a plain pass:
    their loss is taken from the bank, and the batch then decodes plainly (probing only
    from the bank)."""
    policy = flat_policy()
    tickets = [policy.begin(None) for _ in range(4)]
    for _ in range(5):
        batch_record(policy, tickets, [0] * 4, seconds=0.05)  # 50 plain passes' time
    assert policy.bank < 0
    plan = policy.plan([Ask(t, 100, 100) for t in tickets], rows=4)
    assert max(plan.widths) == 1 and not plan.probe


def test_rows_left_alone_in_a_batch_go_on_with_their_own_texts_acceptance():
    """Three rows whose drafts were all accepted and one whose drafts never were: pooled,
    their acceptance promises many tokens at W = 16. When the three have ended, the fourth
    alone goes on from what its own text taught (the pool a prior worth a few cycles),
    while a new text reads the pool."""
    policy = flat_policy()
    tickets = [policy.begin(None) for _ in range(4)]
    for _ in range(10):
        batch_record(policy, tickets, [0, 15, 15, 15])
    fresh = policy.begin(None)
    pooled = policy.estimate(Ask(fresh, 100, 100)).tokens(16)
    assert pooled > 6.0, "the pool, three texts in four drafting well"
    own = policy.estimate(Ask(tickets[0], 100, 100))
    assert own.alphas[0] < 0.5, "its own text: no first draft ever accepted"
    assert own.tokens(16) < 0.5 * pooled


def test_bad_batch_arguments_are_the_callers_errors(target, draft):
    from dflash_mlx import BadArgument

    model, tok = target
    with pytest.raises(ValueError, match="max_batch 0"):
        BatchDecoder(Pair(model, draft), tok, max_batch=0)
    with pytest.raises(BadArgument, match="2 options for 3 prompts"):
        batch_generate(Pair(model, draft), tok, ["a", "b", "c"], [GenerateOptions()] * 2)
    with pytest.raises(BadArgument, match="verify_width"):
        BatchDecoder(Pair(model, draft), tok).submit("a", GenerateOptions(verify_width=99))


# -- sampling batched: the target's distribution, row by row -----------------------------


class _IdsOnly:
    """A tokenizer for a model without one: prompts are token ids, text is not looked at."""

    eos_token_ids: frozenset[int] = frozenset()

    class _Detok:
        last_segment = ""

        def reset(self):
            pass

        def add_token(self, t):
            pass

        def finalize(self):
            pass

    @property
    def detokenizer(self):
        return self._Detok()


def batched_joint_counts(model, draft, draws: int) -> tuple[dict, list[int]]:
    """`test_sampling.joint_counts`, each draw a row of batches of 8 (rows of other seeds
    beside it, joining as others leave)."""
    from .test_sampling import JOINT, JOINT_PARAMS, PROMPT, as_options

    dec = BatchDecoder(Pair(model, draft), _IdsOnly(), max_batch=8)
    base = as_options(JOINT_PARAMS, JOINT).replace(verify_width=4, draft_block=4)
    for seed in range(draws):
        dec.submit(list(PROMPT), base.replace(seed=seed), handle=seed)
    tokens = {s: [] for s in range(draws)}
    first = {}
    while dec.busy:
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            if item.width and row.handle not in first:
                first[row.handle] = item.accepted
    counts, by_accepted = {}, [0, 0, 0, 0]
    for s in range(draws):
        key = tuple(tokens[s][:JOINT])
        counts[key] = counts.get(key, 0) + 1
        by_accepted[first[s]] += 1
    assert max(dec.sizes) == 8
    return counts, by_accepted


@pytest.fixture(scope="module")
def table_pair():
    from .test_sampling import TableDraft, build_tiny_vocab_pair, greedy_table

    model, draft = build_tiny_vocab_pair(12)
    return model, TableDraft(draft, greedy_table(model))


@pytest.mark.slow  # thousands of sampled rows for a chi-square test
def test_batched_sampling_keeps_the_targets_joint_distribution(table_pair):
    from .test_sampling import exact_joint, joint_rejects

    model, draft = table_pair
    counts, by_accepted = batched_joint_counts(model, draft, 3000)
    assert min(by_accepted) > 100, f"every acceptance length must occur: {by_accepted}"
    assert not joint_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


@pytest.mark.slow  # thousands of sampled rows for a chi-square test
def test_the_batched_chi_square_catches_rows_sharing_their_draws(table_pair, monkeypatch):
    """A broken batch: every row draws with the first row's keys (its seed), so rows of one
    batch are not independent draws."""
    from .test_sampling import exact_joint, joint_rejects

    model, draft = table_pair
    real = BatchDecoder._admit

    def shared_keys(self, row):
        real(self, row)
        if row.req is not None and self.active:
            row.req.keys = self.active[0].req.keys

    monkeypatch.setattr(BatchDecoder, "_admit", shared_keys)
    counts, _ = batched_joint_counts(model, draft, 2000)
    assert joint_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


def test_rows_under_controls_and_dflash2_drafts_decode_in_the_batch(target, models_dir):
    """DFlash 2 rows, rows under a penalty (its per-row history) and under a grammar share
    one draft pass, each walking its own block's logits: each stays its own."""
    from dflash_mlx import load_draft
    from dflash_mlx.models.tiny import build_draft, draft_config

    model, tok = target
    folder = models_dir / "draft2-batch"
    if not folder.exists():
        build_draft(folder, draft_config(4, [1, 2], dflash2=True), seed=5)
    pair = Pair(model, load_draft(folder))
    ids = [tok.encode(p) for p in PROMPTS]
    opts = [options(k, 4) for k in range(4)]
    opts[1] = opts[1].replace(presence_penalty=0.8, frequency_penalty=0.3)
    opts[2] = opts[2].replace(json_schema=True, max_tokens=30)
    solo = [generate(pair, tok, i, o).tokens for i, o in zip(ids, opts)]
    shared = []
    real = batch_draft.block_rows

    def spy(reqs, anchors, length, rows):
        shared.append(sum(r.controls is not None for r in reqs))
        return real(reqs, anchors, length, rows)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch_draft, "block_rows", spy)
        got = batch_generate(pair, tok, ids, opts)
    assert [r.tokens for r in got] == solo
    assert max(shared) == 2, f"the penalty's and the grammar's rows share the pass: {shared}"
    assert solo[0] == target_greedy(model, ids[0], LENGTHS[0])
    assert solo[1] != target_greedy(model, ids[1], LENGTHS[1]), "the penalty must matter"
    assert solo[2] != target_greedy(model, ids[2], 30), "the grammar must matter"
    assert max(max(r.stats.batches, default=0) for r in got) >= 3


class SiblingLookupDraft(LookupDraft):
    """`LookupDraft`'s rows, but each position's right token ranked second after a wrong one
    from a block index that changes with the position: chains accept up to there, trees
    accept through siblings past it, and rows accept different paths every cycle."""

    def block_logits(self, anchor, length, rows, state):
        pos, a = state.context_end, anchor.item()
        script = next((s for s in self.scripts if pos < len(s) and s[pos] == a), [])
        right = (pos * 3) % length
        vocab = self.config.vocab_size
        rows = length - 1 if rows is None else rows
        out = np.zeros((rows, vocab), dtype=np.float32)
        for i in range(rows):
            t = script[pos + 1 + i] if pos + 1 + i < len(script) else 0
            out[i, (t + 1) % vocab] = 9.0 if i >= right else 7.0
            out[i, t] = 8.0
        return mx.array(out)


@pytest.mark.parametrize("budget", [6, 12])
def test_rows_verifying_trees_in_one_pass_equal_their_solo_greedy(case, draft, budget):
    """Trees are verified in batches (issue 34): rows of different tree shapes, beside
    rows verifying chains, in one target pass, each its own solo greedy decode."""
    name, model, tok, ids, refs, lookup = case
    sib = SiblingLookupDraft(draft, lookup.scripts)
    pair = Pair(model, sib)
    dec = BatchDecoder(pair, tok)
    tokens = {i: [] for i in range(4)}
    stats = {}
    step, joins = 0, [0, 0, 1, 2]
    pending = [0, 1, 2, 3]
    while pending or dec.busy:
        while pending and joins[pending[0]] <= step:
            i = pending.pop(0)
            # Row 3 verifies chains beside the others' trees.
            dec.submit(ids[i], options(i, budget if i < 3 else 4, tree=i < 3), handle=i)
        for row, item in dec.step():
            assert not isinstance(item, BaseException), item
            tokens[row.handle] += item.tokens
            stats[row.handle] = item.stats
        step += 1
    for i, ref in enumerate(refs):
        assert tokens[i] == ref, f"{name} budget {budget}: row {i} diverged from its solo decode"
    assert max(dec.sizes) >= 3
    if name == "qwen35":  # recurrent layers: chains, and the reply says why
        assert not any(s.trees for s in stats.values())
        assert "recurrent" in stats[0].tree_note
        return
    for i in range(3):
        s = stats[i]
        assert s.trees, f"row {i} verified no tree"
        assert s.tree_note is None
        assert max(s.batches) >= 2, s.batches
    assert not stats[3].trees
    assert max(stats[i].tau for i in range(3)) > 1.5, "siblings must be accepted"


def test_tree_rows_share_the_batchs_draft_pass(case, draft, monkeypatch):
    """Tree rows of a DFlash 1 draft get their ranked tokens from the batch's one draft
    pass (with chain rows of the same block), and stay their solo greedy decode."""
    name, model, tok, ids, refs, lookup = case
    if name == "qwen35":
        pytest.skip("a hybrid target verifies chains: no tree rows to share a pass")
    passes = []
    real = batch_draft.block_rows

    def spy(reqs, anchors, length, rows):
        passes.append(len(reqs))
        return real(reqs, anchors, length, rows)

    monkeypatch.setattr(batch_draft, "block_rows", spy)
    shared = []
    real_tree = batch_mod.propose_tree

    def tree_spy(req, anchor, budget, rows, logits=None, hidden=None):
        if logits is not None:  # from the batch's pass: what the row's own pass gives
            own = req.draft.block_logits(anchor, rows, rows - 1, req.state)
            assert mx.allclose(logits, own, atol=1e-4).item()
            shared.append(budget)
        return real_tree(req, anchor, budget, rows, logits, hidden=hidden)

    monkeypatch.setattr(batch_mod, "propose_tree", tree_spy)
    # The chain row drafts the whole block, as the tree rows do (a fixed width alone drafts
    # only the positions it verifies: a pass of another length).
    block = draft.config.block_size
    opts = [
        options(i, 6 if i < 3 else 4, tree=i < 3, draft_block=None if i < 3 else block)
        for i in range(4)
    ]
    got = batch_generate(Pair(model, draft), tok, ids, opts)
    assert [r.tokens for r in got] == refs
    assert all(r.stats.trees for r in got[:3]) and not got[3].stats.trees
    assert passes and max(passes) == 4, f"tree and chain rows must share a pass: {passes}"
    assert len(shared) > 10, shared


def test_the_rows_context_is_fed_in_one_pass_as_each_alone(target, draft, monkeypatch):
    """The batch's draft pass feeds every row's committed features at once (`feed_rows`:
    one projection for all rows, each at its own RoPE position, across gaps, windows and
    sinks): each row's context then holds what feeding it alone gives, and the per-row
    path is not what ran."""
    model, tok = target
    pair = Pair(model, draft)
    feats = draft.config.hidden_size * len(draft.config.target_layer_ids)

    def rows() -> list:
        dec = BatchDecoder(pair, tok)
        for k, p in enumerate(PROMPTS[:3]):
            window, sink = (16 if k else None), (3 if k == 2 else None)
            opts = GenerateOptions(
                max_tokens=60, verify_width=4, draft_window=window, draft_sink=sink
            )
            dec.submit(p, opts)
        for _ in range(8):
            dec.step()
        reqs = [r.req for r in dec.active]
        for r in reqs:
            r.feed_draft()
        reqs[1].state.skip_to(reqs[1].state.context_end + 5)  # a gap: RoPE positions jump
        mx.random.seed(1)
        for b, r in enumerate(reqs):  # pending rows of different counts, in pieces
            r.pending = [mx.random.normal((1, n, feats)) for n in (2, b + 1)]
        return reqs

    alone, together = rows(), rows()
    for r in alone:
        r.feed_draft()
    fed = []
    real = Request.feed_draft
    monkeypatch.setattr(Request, "feed_draft", lambda self: fed.append(self) or real(self))
    batch_draft.feed_rows(together)
    assert not fed, "the rows were fed one by one"
    for a, t in zip(alone, together):
        assert not t.pending and t.state.context_end == a.state.context_end
        got, want = [np.array(x) for x in t.state.arrays], [np.array(x) for x in a.state.arrays]
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_dflash2_rows_share_one_draft_pass_and_propose_as_alone(target, temperature):
    """DFlash 2 rows (issue 34): one draft pass for the batch, each row's conv rows
    (carried across blocks) and selector walk its own: proposals, their `q` and the conv
    rows each row keeps equal what the row's own pass gives."""
    from dflash_mlx.models.tiny import draft_config

    model, tok = target
    mx.random.seed(3)
    d2 = DFlashDraft(DraftConfig.from_dict(draft_config(4, [1, 2], dflash2=True)))
    mx.eval(d2.parameters())
    d2.conv_state = "carry"
    pair = Pair(model, d2)
    dec = BatchDecoder(pair, tok)
    for i, p in enumerate(PROMPTS[:3]):
        # Seeded: an unseeded sampled row draws its own seed and may end early at random.
        seed = 7 + i if temperature else None
        dec.submit(
            p, GenerateOptions(max_tokens=60, verify_width=4, temperature=temperature, seed=seed)
        )
    for _ in range(5):  # three admissions, two cycles
        dec.step()
    reqs = [r.req for r in dec.active]
    assert len(reqs) == 3 and all(batch_draft.batchable(r) for r in reqs)
    assert all(r.state.conv[0].state[0] is not None for r in reqs), "conv rows must be carried"
    anchors = [mx.array([t]) for t in (5, 9, 17)]
    starts = [len(r.generated) - 1 for r in reqs]
    for r in reqs:
        r.feed_draft()
    alone, kept = [], []
    for r, a, s in zip(reqs, anchors, starts):
        keys = None if r.params.greedy else r.keys(draft_keys(r), s + 1, 5)
        alone.append(propose(d2, r.state, a, 8, 5, r.params, keys))
        kept.append([np.array(c.last[0]) for c in r.state.conv])
    got = batch_draft.propose_rows(reqs, anchors, starts, [6, 6, 6], 8)
    for b, r in enumerate(reqs):
        assert got[b][0].tolist() == alone[b][0].tolist()
        if temperature:
            np.testing.assert_allclose(np.array(got[b][1]), np.array(alone[b][1]), atol=1e-4)
        for c, want in zip(r.state.conv, kept[b]):
            np.testing.assert_allclose(np.array(c.last[0]), want, atol=1e-4)
    assert got[0][0].tolist() != got[1][0].tolist(), "rows must differ for this to mean much"


def test_a_seeded_reply_is_one_however_it_is_decoded(case, draft):
    """Issue 43 item 7: a seeded sampled request gets the reply plain decoding with that
    seed gives, alone or among others, at any width, with trees or without, with or
    without a draft: each token is the target's Gumbel-max draw keyed by (seed, position),
    and drafts are accepted when they equal it (`sampling.coupled_accept`)."""
    name, model, tok, ids, refs, lookup = case
    opts = [options(i, None, temperature=0.9, seed=40 + i) for i in range(4)]
    plain = [generate(model, None, tok, ids[i], opts[i]).tokens for i in range(4)]
    # A draft that knows each plain reply, wrong from a position-dependent index: cycles
    # accept different numbers of drafts, and agree with the target where it is right.
    knowing = LookupDraft(draft, [i + p for i, p in zip(ids, plain)])
    pair = Pair(model, knowing)
    taus = []
    for width, tree in ((2, False), (5, False), (None, False), (8, True), (None, None)):
        alone = generate(pair, tok, ids[0], opts[0].replace(verify_width=width, tree=tree))
        assert alone.tokens == plain[0], f"{name} W={width} tree={tree}: not the seeded reply"
        taus.append(alone.stats.tau)
        got = batch_generate(
            pair, tok, ids, [o.replace(verify_width=width, tree=tree) for o in opts]
        )
        assert [r.tokens for r in got] == plain, f"{name} W={width} tree={tree}: batched"
        assert max(max(r.stats.batches, default=0) for r in got) >= 2
    assert max(taus) > 1.5, f"drafts must be accepted for this to mean much: {taus}"
    other = generate(model, None, tok, ids[0], opts[0].replace(seed=41))
    assert other.tokens != plain[0], "another seed must sample differently"


def test_a_cycle_planned_before_the_last_token_commits_keeps_to_max_tokens(case, monkeypatch):
    """A plain cycle plans the next (speculative) one before its own token is committed:
    that cycle must still verify no more than each row has tokens left (it once verified
    one more, and a row ended a token past its `max_tokens`)."""
    name, model, tok, ids, refs, lookup = case
    if name == "qwen35":
        pytest.skip("a recurrent target's plain cycles are not chained or planned ahead")
    real, calls = batch_mod.plan, [0]

    def every_other_plain(rows, policy, ahead=0):
        calls[0] += 1
        if calls[0] % 2:  # a plain cycle: the next one is planned before it commits
            return [(1, 1) for _ in rows], [False] * len(rows), None
        return real(rows, policy)  # planned as if its last token were committed

    monkeypatch.setattr(batch_mod, "plan", every_other_plain)
    for extra in range(3):  # where each row's last cycles fall moves with its length
        opts = [options(i, 5).replace(max_tokens=LENGTHS[i] - extra) for i in range(4)]
        got = batch_generate(Pair(model, lookup), tok, ids, opts)
        for i, r in enumerate(got):
            assert r.tokens == refs[i][: LENGTHS[i] - extra], f"row {i}, {extra} fewer"


@pytest.mark.parametrize("others,policy", [(0, "plain"), (1, "plain"), (1, "speculates")])
def test_a_prefill_is_dormant_where_its_batch_expects_plain_decoding(target, draft, others, policy):
    """A policy that plans plain decoding (a stock CPU's curves): alone, the prompt's draft
    context is left out but for a window (a dormant prefill); joining another request, the
    batch it joins is planned at its size, plain too, and the prefill is dormant (at c = 8
    with OpenBLAS, contexts built for a batch that never speculated cost 6% of its time).
    Where the batch's plan speculates (wide verifies nearly free, the context cheap to
    build), the whole prompt's context is built."""
    from .test_adaptive import BLAS, BLOCK, CPU

    model, tok = target
    ids = tok.encode("def parse(line):\n    return line.split(',')\n" * 12)
    curves = CPU if policy == "plain" else CostCurves(BLAS.verify, BLAS.draft, context=0.005)
    auto = AutoPolicy(curves, BLOCK)
    auto.window = 8
    if policy == "speculates":  # the pair's drafts seen right (the prior alone bets nothing)
        from dflash_mlx.speed.policy import teach

        for _ in range(8):
            teach(auto.pool, BLOCK, BLOCK - 1)
    dec = BatchDecoder(Pair(model, draft), tok, max_batch=2)
    rows = [dec.submit(ids, GenerateOptions(max_tokens=16)) for _ in range(1 + others)]
    for r in rows:
        r.plan = (BLOCK, BLOCK, auto)
    row = rows[0]
    size = len(rows)
    plan = auto.plan([Ask(auto.begin(16), len(ids) - 1, 15)], rows=size)
    assert (plan.widths[0] == 1) is (policy == "plain")
    dec.step()  # its admission: prefill and first token
    state = row.req.state
    seen = state.context_length + len(row.req.pending)
    if policy == "plain":
        assert seen <= auto.window + 1, f"a dormant prefill kept {seen} positions"
    else:
        assert state.context_length >= len(ids) - 1, state.context_length
