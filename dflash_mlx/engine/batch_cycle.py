"""One cycle of a batch (SPEC 8): choose -> draft -> one verify pass -> accept -> rewind.

The steps of `decode.py`'s cycle, for every active row of a `batch.BatchDecoder` at once:
`plan` picks each row's width (fixed rows keep theirs; the others share the width the
pair's policy picks for the whole batch, `speed.port`), `draft` proposes (one
draft pass for the rows that can share it, `batch_draft`; the single-request step for the
others), `verify` runs the target once over every row's block (rows padded at their end),
`accept` decides per row (greedy rows without processors together, one host read), and
`commit` rewinds each row to what it accepted. A row whose own steps fail ends with its
error (`Row.error`) and rides along the pass empty; the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..cache.prompt_cache import PromptCache
from ..options import GenerateOptions
from ..speed.port import Ask, Plan, Policy, Record, Ticket
from . import batch_draft
from .batch_cache import keep, row_lengths
from .bookkeeping import follow_capture
from .decode import NO_DRAFTS, _Step, accept, commit_draft, result
from .generate import Reply
from .prefill import Request
from .trace import Event
from .tree import ShapeChooser, batch_mask, grammar_tree, node_outputs, propose_tree
from .walks import make_drafts


@dataclass(eq=False)
class Row:
    """One request of a batch, from `submit` to its last response."""

    prompt: list[int]
    options: GenerateOptions
    handle: Any = None  # the caller's own (the server's job)
    prompt_cache: PromptCache | None = None
    progress: Any = None  # progress(done, total) of its prefill
    reply: Reply | None = None
    req: Request | None = None
    fixed: tuple[int, int] | None = None  # (W, L) the request fixed; None: the batch's
    plan: tuple[int, int, Policy | None] | None = None  # `Pair.plan`, made at submit
    rows: int = 1  # the draft block L of an automatic row
    grammar: Any = None
    eos: frozenset[int] = frozenset()
    anchor: mx.array | None = None  # the last committed token, on the device
    policy: Policy | None = None  # an automatic row's width policy (the pair's)
    ticket: Ticket | None = None  # its row in that policy
    lease: int = 0
    done: bool = False
    cancelled: bool = False
    error: BaseException | None = None  # what ended the row, if something failed
    learn: bool = True  # its cycles' wall time teaches costs (not a seeded request's)
    cut: bool = False  # its last cycle fed tokens past an EOS (no recurrent snapshot then)
    snapped: bool = False  # its recurrent state was kept after its last cycle (alone)
    seed: int | None = None  # its draws' seed (None: `options.seed`, else a random one)
    speculate: bool | None = None  # False: the target alone (None: when the pair can)

    @property
    def generated(self) -> int:
        return len(self.req.generated) if self.req is not None else 0


def plan(
    rows: list[Row], policy: Policy | None, ahead: int = 0
) -> tuple[list, list[bool], Plan | None]:
    """Each row's `(W, L)` this cycle, whether its pass captures features for its draft, and
    the automatic rows' `Plan` (`ahead`: planned a cycle ahead, before the last one's token is
    committed). The policy is asked about the automatic rows and priced at every row."""
    auto = [r for r in rows if r.fixed is None and r.req.draft is not None]
    made = None
    if policy is not None and auto:
        made = policy.plan([ask(r, ahead) for r in auto], rows=len(rows))
        for r in auto:
            r.ticket.capture = made.capture
    chosen = {id(r): (w, n) for r, w, n in zip(auto, made.widths, made.blocks)} if made else {}
    out = []
    for r in rows:
        if r.req.draft is None:
            w, length = 1, 1
        elif r.fixed is not None:
            w, length = r.fixed
        else:
            w, length = chosen[id(r)]
        left = r.options.max_tokens - r.generated - ahead
        # A tree's budget may exceed the block; a chain's is cut to it when drafted.
        block = length if length > 1 and not r.req.trees else w
        out.append((max(1, min(w, left, block)), length))
    captures = [
        r.req.draft is not None and (r.fixed is not None or made is None or made.capture)
        for r in rows
    ]
    return out, captures, made


def ask(r: Row, ahead: int = 0) -> Ask:
    """What the policy is told of row `r` (`ahead`: a cycle before its last token commits)."""
    n, z = behind(r.req)
    depth = len(r.prompt) + r.generated - 1 + ahead  # the anchor's
    return Ask(r.ticket, depth, r.options.max_tokens - r.generated - ahead, n, z)


def behind(req: Request) -> tuple[int, int]:
    """What a speculative cycle would first catch the draft's context up on: the rows of
    positions decoded plainly, and a dormant prefill's lazy window ((0, 0): up to date)."""
    if req.draft is None or req.speculating:
        return (0, 0)
    return (req.pending_rows, req.lazy_rows)


def catch_up(rows: list[Row], widths: list, captures: list[bool], emit=None) -> tuple[int, int]:
    """Rows about to speculate after plain cycles feed their drafts' context first (all in
    one pass, `batch_draft.feed_rows`), apart from the cycle (so it is not taken for what
    every cycle of the width costs): the `(rows, lazy)` caught up, summed over the rows
    (`emit` is told of the pass)."""
    late = []
    for b, (r, (w, _)) in enumerate(zip(rows, widths)):
        if r.req.draft is None:
            continue
        follow_capture(r.req, captures[b], len(r.req.prompt) + r.generated - 1)
        if w > 1 and any(behind(r.req)):
            late.append(r)
    if not late:
        return (0, 0)
    done = [behind(r.req) for r in late]
    caught = (sum(n for n, _ in done), sum(z for _, z in done))
    if emit is not None:
        depth = max(len(r.prompt) + r.generated - 1 for r in late)
        emit(Event("catch-up", len(late), caught[0], depth, caught[1]))
    with mx.stream(generation_stream):
        batch_draft.feed_rows([r.req for r in late])
        mx.eval([a for r in late for a in r.req.state.arrays])
    for r in late:
        r.req.lazy_rows = 0
    return caught


def plain(target, rows: list[Row], widths: list) -> bool:
    """Whether the cycle `plan`ned is a plain pass that can be chained on the device (its
    inputs are the last pass's device tokens): every row decodes plainly (W = 1) without a
    grammar (whose masks must first see each token on the host). A row alone may also
    sample, keep recurrent states, or be processed; in a batch, rows are greedy without
    logits processors or recurrent state to keep."""
    if not all(w == 1 for w, _ in widths) or any(r.error is not None for r in rows):
        return False
    if any(r.req.controls is not None and r.req.controls.grammar is not None for r in rows):
        return False
    return len(rows) == 1 or (
        not target.recurrent
        and all(
            r.req.params.greedy and r.req.controls is None and not r.req.keep_snapshots
            for r in rows
        )
    )


def plain_pass(
    target, rows: list[Row], anchors: mx.array, cache: list, captures: list[bool], at: list[int]
) -> tuple[mx.array, mx.array | None, list | None]:
    """The target on each row's anchor `(B,)` (at generated index `at[b]`), launched: each
    row's next token `(B,)`, the anchors' features where `captures`, and each row's logprobs
    when asked for (None: no row asks)."""
    with mx.stream(generation_stream):
        for b, r in enumerate(rows):
            if r.req.draft is not None:  # dormant: its context stops at the last capture
                follow_capture(r.req, captures[b], len(r.req.prompt) + at[b])
        ids = next((r.req.ids for r, c in zip(rows, captures) if c), None)
        logits, feats = target.forward(anchors.reshape(-1, 1), cache, ids)
        lps = None
        if all(r.req.params.greedy and r.req.controls is None for r in rows):
            top = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        else:
            tokens, lps = [], []
            for b, r in enumerate(rows):
                _, out, lp = accept(r.req, NO_DRAFTS, None, logits[b], at[b])
                tokens.append(out.astype(mx.int32).reshape(1))
                lps.append(lp)
            top = mx.concatenate(tokens)
    mx.async_eval(top, *(a for lp in lps or () for a in lp or ()))
    return top, feats, lps


def draft(rows: list[Row], widths: list, captures: list[bool]) -> list:
    """Each row's `(drafts, q, masks, shape)`: rows whose cycle verifies a tree (SPEC 7)
    get its nodes after the anchor as `drafts` and `shape` `(tokens, parents, depths,
    seen)`; the others a chain (`shape` None). Rows of one draft block share one draft
    pass: trees and chains, DFlash 1 and 2, free or under penalties and grammars (each
    walks its own block's logits)."""
    for b, r in enumerate(rows):
        if r.req.draft is not None:
            follow_capture(r.req, captures[b], len(r.req.prompt) + r.generated - 1)
    shaped: dict[int, bool] = {}  # a shape chooser decides once a cycle for its rows
    trees = [False] * len(rows)
    for b, (r, (w, length)) in enumerate(zip(rows, widths)):
        mode = r.req.trees
        if isinstance(mode, ShapeChooser) and w >= 3 and id(mode) not in shaped:
            shaped[id(mode)] = mode.tree_next()
        if w >= 3 and (mode is True or shaped.get(id(mode), False)):
            trees[b] = True
        elif w > length > 1:  # a tree's budget asked for where this cycle verifies a chain
            widths[b] = (length, length)
    groups: dict[int, list[int]] = {}
    for b, (r, (w, length)) in enumerate(zip(rows, widths)):
        if w > 1 and batch_draft.batchable(r.req):
            groups.setdefault(length, []).append(b)
    blocks: list = [None] * len(rows)  # each row's (hidden, logits) from a shared pass
    for length, members in groups.items():
        if len(members) < 2:
            continue
        wide = any(trees[b] for b in members)
        most = length - 1 if wide else max(widths[b][0] for b in members) - 1
        anchors = [rows[b].anchor for b in members]
        hidden, logits = batch_draft.block_rows(
            [rows[b].req for b in members], anchors, length, most
        )
        for k, b in enumerate(members):
            blocks[b] = (hidden[k], logits[k])
    out: list = []
    for b, (r, (w, length)) in enumerate(zip(rows, widths)):
        block = blocks[b]
        try:
            if trees[b]:
                hidden, logits = block if block is not None else (None, None)
                masks = None
                if r.req.controls is not None:  # a grammar's: a mask at each node's path
                    room = r.options.max_tokens - r.generated - 1
                    got = grammar_tree(r.req, r.anchor, w, length, logits, hidden, room)
                    shape, masks = got
                else:
                    shape = propose_tree(r.req, r.anchor, w, length, logits, hidden=hidden)
                out.append((shape[0][1:], None, masks, shape))
            else:
                room = r.options.max_tokens - r.generated - 1  # the cycle's own token after
                got = make_drafts(r.req, r.anchor, r.generated - 1, w, length, block, room)
                out.append((*got, None))
        except Exception as e:  # noqa: BLE001 - this row ends; it rides along empty
            r.error = e
            out.append((mx.zeros((0,), dtype=mx.int32), None, None, None))
            widths[b] = (1, 1)
    return out


def verify(target, rows: list[Row], drafted: list, cache: list, captures: list[bool]):
    """One target pass over every row's `[anchor, drafts]`, padded to the widest (trees
    and chains together, each row masked as its shape says, `tree.batch_mask`):
    `(logits, feats, width, (snapshot, calls))`."""
    width = max(d.size + 1 for d, _, _, _ in drafted)
    tokens = []
    for r, (drafts, _, _, _) in zip(rows, drafted):
        seq = mx.concatenate([r.anchor, drafts])
        tokens.append(mx.pad(seq, [(0, width - seq.size)]) if width > seq.size else seq)
    ids = next((r.req.ids for r, c in zip(rows, captures) if c), None)
    before = target.snapshot(cache)
    shapes = [d[3] for d in drafted]
    if any(s is not None for s in shapes):
        first = cache[0]
        lengths = row_lengths(first)
        seen = [None if s is None else (s[3], s[2]) for s in shapes]
        mask, depths = batch_mask(seen, lengths, width)
        logits, feats = target.forward_tree(mx.stack(tokens), cache, mask, depths, ids)
    else:
        logits, feats = target.forward(mx.stack(tokens), cache, ids)
    return logits, feats, width, (before, target.recorded_calls())


def decide(rows: list[Row], drafted: list, logits, feats, width, saved, captures) -> tuple:
    """Each row's `_Step` and `(accepted, emitted tokens)`, read from the device once.
    Greedy rows without logits processors are accepted together (one argmax); the others
    as a request alone is (`decode.accept`)."""
    together = [
        b
        for b, r in enumerate(rows)
        if r.error is None
        and r.req.params.greedy
        and r.req.controls is None
        and drafted[b][3] is None
    ]
    if any(callable(d[2]) for d in drafted):
        # Grammar masks along free proposals (`walks.masks_along`) are the host's work:
        # the verify pass is launched first, and runs while the grammars compute them.
        mx.async_eval(logits, *([feats] if feats is not None else []))
    steps = []
    for b, (r, (drafts, q, masks, shape)) in enumerate(zip(rows, drafted)):
        w = drafts.size + 1
        f = feats[b : b + 1] if feats is not None and captures[b] else None
        if shape is not None and r.error is None:  # a tree: walked on the host (`result`)
            out = node_outputs(r.req, logits[b, :w], masks)
            steps.append(_Step(None, out, f, saved, w, 0.0, False, None, shape[:3], []))
            continue
        if b in together:
            steps.append(_Step(None, None, f, saved, w, 0.0, False))
            continue
        try:
            if r.error is not None:
                raise r.error
            if callable(masks):
                masks = masks()
            n, out, lp = accept(r.req, drafts, q, logits[b, :w], r.generated - 1, masks)
        except Exception as e:  # noqa: BLE001 - this row ends, the others go on
            r.error = e
            n, out, lp = mx.array(0), logits[b, :1].argmax(-1), None
        steps.append(_Step(n, out, f, saved, w, 0.0, False, lp))
    shown = [
        a
        for s in steps
        if s.n is not None or s.tree is not None
        for a in (s.n, s.out, *(s.logprobs or ()), *(s.tree or ()))
        if a is not None
    ]
    top = proposed = None
    if together:
        top = mx.argmax(logits, axis=-1)
        if width > 1:
            proposed = mx.stack(
                [mx.pad(drafted[b][0], [(0, width - 1 - drafted[b][0].size)]) for b in together]
            )
    mx.async_eval(*shown, *(a for a in (top, proposed) if a is not None))
    top = top.tolist() if top is not None else None
    proposed = proposed.tolist() if proposed is not None else None
    results = []
    for b, (r, s) in enumerate(zip(rows, steps)):
        if r.error is not None:
            results.append((0, [0]))
        elif s.n is None and s.tree is None:  # accepted with the others: the longest prefix
            got, n = top[b], 0
            if proposed is not None:
                mine = proposed[together.index(b)]
                while n < s.width - 1 and mine[n] == got[n]:
                    n += 1
            results.append((n, got[: n + 1]))
        else:
            results.append(result(r.req, s))
    return steps, results


def rewind(target, rows: list[Row], steps: list, results: list, cache: list, width: int):
    """Each row keeps what it accepted (`batch_cache.keep`, one row or many); the drafts
    get their features."""
    with mx.stream(generation_stream):
        keeps = [n + 1 for n, _ in results]
        paths = [s.path if s.tree is not None else None for s in steps]
        keep(target, cache, keeps, width, steps[0].saved, paths)
        for r, s, (n, _) in zip(rows, steps, results):
            if r.error is None:
                commit_draft(r.req, s, n)


def learn(
    policy: Policy | None,
    rows: list[Row],
    widths: list,
    results: list,
    spent: float | None,
    made: Plan | None = None,
    times: int = 1,
    caught: tuple[int, int, float] = (0, 0, 0.0),
    tree: bool = False,
):
    """The policy learns from the cycle: its automatic rows' acceptance, and (when it chose
    every row's width and every row may teach costs: not a seeded request's) its seconds,
    host sync to host sync (None: not measured), `times` plain steps `spent` each, after
    catching `caught` = (rows, lazy, seconds) of draft context up. `tree`: a row alone
    verified a tree, whose cost is not a chain's of its width."""
    auto = [b for b, r in enumerate(rows) if r.fixed is None and r.req.draft is not None]
    if policy is None or not auto:
        return None
    costs = all(r.fixed is None and r.learn for r in rows) and not tree
    accepted = []
    for b in auto:
        w, n = widths[b][0], results[b][0]
        ok = rows[b].error is None and w > 1
        accepted.append(min(n, w - 1) if ok else 0)  # a grammar's forced run can go past W
    depth = max(len(r.prompt) + r.generated - 1 for r in rows)
    record = Record(
        tuple(ask(rows[b]) for b in auto),
        tuple(widths[b][0] if rows[b].error is None else 1 for b in auto),
        tuple(accepted),
        depth,
        spent,
        block=max(widths[b][1] for b in auto),
        times=times,
        rows=len(rows),
        caught=caught[0],
        lazy=caught[1],
        caught_seconds=caught[2],
        probe=made is not None and made.probe,
        costs=costs,
    )
    policy.learn(record)
    return record
