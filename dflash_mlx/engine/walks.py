"""The draft's proposals: `make_drafts` (the cycle's draft step, for a request alone and a
batch's row), and the walks it takes under a request's controls (`controls.Controls`).

`walk`: row by row on the device, each row processed with the proposals before it
(penalties see the block's own drafts). Under a grammar (`grammar_drafts`, SPEC 6) the
tokens it forces are carried without drafting: `walk_grammar` goes within the grammar
position by position on the host from one read of the draft's block, the matcher advanced
and rolled back; free proposals follow the forced run from the anchor, and `masks_along`
computes their masks while the verify pass runs.
Each returns what `make_drafts` returns: the proposals, their `q` when sampling, and
the masks of every verified row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .sampling import MaskedSelector, PositionKeys, probabilities, propose, sample

if TYPE_CHECKING:
    from .controls import Grammar
    from .prefill import Request


# Forced tokens a grammar row's block may carry past its `W - 1` drafted positions (SPEC
# 6): they need no draft row, and each is accepted with certainty where the grammar
# allows it alone, so a verify pass commits a long forced run (a JSON key, a tool call's
# envelope) at once.
FORCED_BEYOND = 16


def make_drafts(
    req: Request,
    anchor: mx.array,
    a: int,
    w: int,
    rows: int,
    block: tuple[mx.array, mx.array] | None = None,
    room: int | None = None,
) -> tuple[mx.array, mx.array | None, np.ndarray | Callable[[], np.ndarray] | None]:
    """The draft's `w - 1` proposals after the anchor at generated index `a` (none for
    W = 1), when sampling the distributions `q` they were drawn from, and under a grammar
    its masks at each verified row `(W', words)` (a block it ends early has W' < W rows),
    or for free proposals what computes them while the verify pass runs. `block`: this
    request's `(hidden, logits)` from a batch's draft pass (`batch_draft.block_rows`; at
    least `w - 1` rows), else its own pass runs now. Under a grammar the tokens it forces
    take their positions without being drafted (`grammar_drafts`); `room`: the most
    tokens the block may carry (the request's budget; None: no limit)."""
    controls = req.controls
    grammar = controls.grammar if controls is not None else None
    if w == 1 and grammar is not None:  # a plain cycle verifies what the grammar forces
        return forced_block(req, FORCED_BEYOND if room is None else min(room, FORCED_BEYOND))
    if w == 1:
        return mx.zeros((0,), dtype=mx.int32), None, None
    if grammar is not None:
        return grammar_drafts(req, anchor, a, w, rows, block, room)
    req.feed_draft()
    keys = None if req.params.greedy else req.keys(draft_keys(req), a + 1, w - 1)
    selector = "candidate_selector" in req.draft  # DFlash 2: proposals drawn all at once
    if controls is not None and controls.follows_history and not selector:
        logits = block[1][: w - 1] if block is not None else None
        drafts, q, masks = walk(req, anchor, rows, w - 1, keys, logits)
    else:
        process = controls.draft if controls is not None else None
        drafts, q = propose(
            req.draft, req.state, anchor, rows, w - 1, req.params, keys, process, block
        )
        masks = None
    req.lazy_rows = 0  # computed with this draft pass
    return drafts.astype(mx.int32), q, masks


def grammar_drafts(
    req: Request,
    anchor: mx.array,
    a: int,
    w: int,
    rows: int,
    block: tuple[mx.array, mx.array] | None,
    room: int | None,
) -> tuple[mx.array, mx.array | None, np.ndarray | Callable[[], np.ndarray]]:
    """A grammar row's block (SPEC 6): the tokens the grammar forces are carried as they
    are (`q` a point mass on each when sampling), the draft proposes at the positions where
    the grammar leaves a choice (its row for that position), and a forced run may go
    `FORCED_BEYOND` past the `w - 1` drafted positions (not for a draft with cross-block
    conv rows, which keep the inputs of an accepted row of its block).

    Drawn within the grammar (`Grammar.mask_drafts`; DFlash 2's selector among the allowed
    candidates, `sampling.MaskedSelector`): row by row on the host (`walk_grammar`), every
    forced run after a choice included. Else the forced
    run from the anchor on is read from the grammar alone, the draft's free proposals
    follow it on the device, and the masks are computed while the verify pass runs: no
    host read between the passes."""
    controls, grammar = req.controls, req.controls.grammar
    selector = "candidate_selector" in req.draft
    conv = bool(req.state.conv)
    most = w - 1 if conv else w - 1 + FORCED_BEYOND
    most = max(0, min(most, room)) if room is not None else most
    keys = None if req.params.greedy else req.keys(draft_keys(req), a + 1, w - 1)
    logits = block[1][: w - 1] if block is not None else None
    if grammar.mask_drafts:
        hidden = block[0][: w - 1] if block is not None else None
        return walk_grammar(req, anchor, rows, w - 1, keys, logits, most, hidden)
    lead = grammar.forced()[:most]
    if len(lead) >= min(w - 1, most) and not conv:  # nothing to draft: no draft pass
        lead = lead + forced_after(grammar, lead, most - len(lead))
        drafts = mx.array(lead, dtype=mx.int32)
        q = None if req.params.greedy else point_masses(lead, grammar.vocab)
        return drafts, q, masks_along(req, drafts)
    req.feed_draft()
    if controls.follows_history and not selector:
        free, q, _ = walk(req, anchor, rows, w - 1, keys, logits)
    else:
        free, q = propose(
            req.draft, req.state, anchor, rows, w - 1, req.params, keys, controls.draft, block
        )
    req.lazy_rows = 0  # computed with this draft pass
    f = min(len(lead), w - 1)
    if f:
        free = mx.concatenate([mx.array(lead[:f], dtype=mx.int32), free[f:].astype(mx.int32)])
        if q is not None:
            q = mx.concatenate([point_masses(lead[:f], grammar.vocab), q[f:]])
    drafts = free.astype(mx.int32)[:most]
    return drafts, q[:most] if q is not None else None, masks_along(req, drafts)


def forced_block(req: Request, most: int) -> tuple[mx.array, mx.array | None, np.ndarray]:
    """A plain cycle's block under a grammar: the run it forces from the anchor on (at most
    `most` tokens), with no draft pass, and its masks, read from the grammar alone."""
    grammar = req.controls.grammar
    masks, run = [grammar.mask()], []
    forced = grammar.forced()
    while forced and len(run) < most:
        tok = forced.pop(0)
        if tok in grammar.eos or not grammar.allows(masks[-1], tok):
            break
        grammar.consume([tok])
        run.append(tok)
        masks.append(grammar.mask())
        forced = forced or grammar.forced()  # a run can stop short of a token boundary
    grammar.rollback(len(run))
    q = None if req.params.greedy or not run else point_masses(run, grammar.vocab)
    return mx.array(run, dtype=mx.int32), q, np.stack(masks)


def forced_after(grammar: Grammar, lead: list[int], limit: int) -> list[int]:
    """The tokens the grammar forces once `lead` (forced) is consumed, at most `limit`
    (llguidance's forced run can stop short of a token boundary it later crosses)."""
    if limit <= 0 or not lead or lead[-1] in grammar.eos:
        return []
    grammar.consume(lead)
    more = grammar.forced()[:limit]
    grammar.rollback(len(lead))
    return more


def point_masses(tokens: list[int], vocab: int) -> mx.array:
    """`q` of forced tokens: each row a point mass on its token `(len, vocab)`."""
    q = np.zeros((len(tokens), vocab), dtype=np.float32)
    q[np.arange(len(tokens)), tokens] = 1.0
    return mx.array(q)


def draft_keys(req: Request) -> int:
    """Whose keys a request's draft proposes with: a seeded request's are the target's own
    at each position (`coupled_accept`), the others' a purpose of their own."""
    return PositionKeys.FINAL if req.coupled else PositionKeys.DRAFT


def walk(
    req: Request,
    anchor: mx.array,
    length: int,
    rows: int,
    keys: mx.array | None,
    logits: mx.array | None = None,
) -> tuple[mx.array, mx.array | None, np.ndarray | None]:
    """The draft's proposals row by row on the device, each from its processed distribution
    given the proposals before it (`Controls.walk`): the penalties see the block's own
    proposals. Returns the proposals, their `q` when sampling, and under a grammar that does
    not mask drafts its masks along them. `logits`: the draft's block logits when a batch's
    draft pass made them (else its own pass runs now)."""
    qs = []

    def pick(row: mx.array, i: int) -> mx.array:
        if req.params.greedy:
            return mx.argmax(row, axis=-1)[0].astype(mx.int32)
        qs.append(probabilities(row, req.params)[0])
        return sample(qs[-1], keys[i]).astype(mx.int32)

    if logits is None:
        logits = req.draft.block_logits(anchor, length, rows, req.state)
    drafts = mx.stack(req.controls.walk(logits, pick))
    return drafts, mx.stack(qs) if qs else None, masks_along(req, drafts)


def walk_grammar(
    req: Request,
    anchor: mx.array,
    length: int,
    rows: int,
    keys: mx.array | None,
    logits: mx.array | None = None,
    most: int | None = None,
    hidden: mx.array | None = None,
) -> tuple[mx.array, mx.array | None, np.ndarray]:
    """The block within the grammar, position by position on the host: a token the grammar
    forces is taken as it is (its `q` a point mass), any other is drawn from the draft's
    row for that position among the tokens the grammar allows after those before it:
    greedily, or from `softmax(row / temperature)` over them with the row's own key (its
    `q`). The draft's block (processed with the committed history) is read back once, when
    the first choice needs it (a block the grammar forces whole runs no draft pass). The
    matcher advances and is rolled back after; an EOS ends the block, and so does a choice
    past the draft's `rows`. `most`: the block's positions (default `rows`; a forced run
    from the anchor on may fill positions past `rows`: one after a choice is only as sure
    as the choice, and stops there). Returns the proposals, `q` when sampling, and the masks
    of every verified row.

    A DFlash 2 draft's choice is its selector's among the candidates the grammar allows,
    after the token before it, forced or chosen (`sampling.MaskedSelector`; its draft's
    row within the grammar where none is allowed); its pass runs every cycle (its conv
    rows of the block are committed)."""
    grammar, greedy = req.controls.grammar, req.params.greedy
    selector = "candidate_selector" in req.draft
    most = rows if most is None else most
    host = seeds = None
    masks, drafts, qs = [grammar.mask()], [], []
    forced = grammar.forced()
    certain = True  # no choice yet: a forced run may go on past `rows`
    while len(drafts) < most:
        i = len(drafts)
        if forced and grammar.allows(masks[-1], forced[0]) and (i < rows or certain):
            tok = forced.pop(0)
            forced = forced or None  # a run can stop short of a token boundary: ask again
            if not greedy:
                qs.append(np.zeros(grammar.vocab))
                qs[-1][tok] = 1.0
        elif i >= rows:
            break
        else:
            if host is None:  # the walk's one host sync
                host = draft_block(req, anchor, length, rows, logits, hidden)
                seeds = None if greedy else np.array(keys).astype(np.uint64)
            allowed = grammar.allowed(masks[-1])
            if selector:
                prev = drafts[-1] if drafts else None
                row = host.row(i, prev, allowed, 0.0 if greedy else req.params.temperature)
            else:
                row = np.where(allowed, host[i], -np.inf)
            if greedy:
                tok = int(np.argmax(row))
            else:
                q = np.exp(row - row.max())
                qs.append(q / q.sum())
                rng = np.random.default_rng(int(seeds[i, 0] << np.uint64(32) | seeds[i, 1]))
                tok = int(min(np.searchsorted(np.cumsum(qs[-1]), rng.random()), row.size - 1))
            forced, certain = None, False
        drafts.append(tok)
        if tok in grammar.eos:
            break
        grammar.consume([tok])
        masks.append(grammar.mask())
        if forced is None:
            forced = grammar.forced()
    if host is None and req.state.conv and logits is None:
        # A block forced whole: its conv rows still come from its pass, which runs (lazily,
        # evaluated with the next pass) but is not read back.
        req.feed_draft()
        req.draft.block_hidden(anchor, length, rows, req.state)
        req.lazy_rows = 0
    grammar.rollback(len(masks) - 1)
    if len(masks) == len(drafts):  # nothing follows a proposed EOS: its row is unread
        masks.append(np.full_like(masks[0], -1))
    q = mx.array(np.stack(qs), dtype=mx.float32) if qs else None
    return mx.array(drafts, dtype=mx.int32), q, np.stack(masks)


def draft_block(
    req: Request,
    anchor: mx.array,
    length: int,
    rows: int,
    logits: mx.array | None,
    hidden: mx.array | None = None,
) -> np.ndarray | MaskedSelector:
    """The draft's block logits `(rows, V)` on the host, processed with the committed
    history (and by the temperature when sampling): its pass runs now unless a batch's
    draft pass made `logits` (and `hidden`). A DFlash 2 draft's: its selector's
    `MaskedSelector` over the processed logits."""
    selector = "candidate_selector" in req.draft
    if logits is None or (selector and hidden is None):
        req.feed_draft()
        if selector:
            hidden = req.draft.block_hidden(anchor, length, rows, req.state)
            logits = req.draft.logits(hidden, req.state.head).astype(mx.float32)
        else:
            logits = req.draft.block_logits(anchor, length, rows, req.state)
        req.lazy_rows = 0  # computed with this draft pass
    logits = req.controls.draft(logits)
    if selector:
        return MaskedSelector(req.draft.candidate_selector, logits, hidden, anchor)
    if not req.params.greedy:
        logits = logits * (1.0 / req.params.temperature)
    return np.array(logits, dtype=np.float64)


def masks_along(req: Request, drafts: mx.array) -> Callable[[], np.ndarray] | None:
    """Under a grammar that does not mask the draft's proposals: what computes its masks at
    each verified row after the free `drafts` (called once the verify pass is launched).
    Rows past the first proposal it refuses are never accepted (left unmasked)."""
    grammar = req.controls.grammar if req.controls is not None else None
    return None if grammar is None else lambda: masks_after(grammar, drafts.tolist())


def masks_after(grammar: Grammar, drafts: list[int]) -> np.ndarray:
    masks, taken = [grammar.mask()], 0
    for tok in drafts:
        if not grammar.allows(masks[-1], tok) or tok in grammar.eos:
            break
        grammar.consume([tok])
        taken += 1
        masks.append(grammar.mask())
    grammar.rollback(taken)
    masks += [np.full_like(masks[0], -1)] * (len(drafts) + 1 - len(masks))
    return np.stack(masks)
