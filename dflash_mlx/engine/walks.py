"""The draft's proposals: `make_drafts` (the cycle's draft step, for a request alone and a
batch's row), and the walks it takes under a request's controls (`controls.Controls`).

`walk`: row by row on the device, each row processed with the proposals before it
(penalties see the block's own drafts). `walk_grammar`: within a grammar, row by row on the
host from one read of the draft's block, the matcher advanced and rolled back.
`masks_along`: a grammar's masks along free proposals, computed while the verify pass runs.
Each returns what `make_drafts` returns: the proposals, their `q` when sampling, and
the masks of every verified row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .sampling import PositionKeys, probabilities, propose, sample

if TYPE_CHECKING:
    from .controls import Grammar
    from .prefill import Request


def make_drafts(
    req: Request,
    anchor: mx.array,
    a: int,
    w: int,
    rows: int,
    block: tuple[mx.array, mx.array] | None = None,
) -> tuple[mx.array, mx.array | None, np.ndarray | Callable[[], np.ndarray] | None]:
    """The draft's `w - 1` proposals after the anchor at generated index `a` (none for
    W = 1), when sampling the distributions `q` they were drawn from, and under a grammar
    its masks at each verified row `(W', words)` (a block it ends early has W' < W rows),
    or for free proposals what computes them while the verify pass runs. `block`: this
    request's `(hidden, logits)` from a batch's draft pass (`batch_draft.block_rows`; at
    least `w - 1` rows), else its own pass runs now."""
    controls = req.controls
    grammar = controls.grammar if controls is not None else None
    if w == 1:
        masks = grammar.mask()[None] if grammar is not None else None
        return mx.zeros((0,), dtype=mx.int32), None, masks
    req.feed_draft()
    keys = None if req.params.greedy else req.keys(draft_keys(req), a + 1, w - 1)
    selector = "candidate_selector" in req.draft  # DFlash 2: proposals drawn all at once
    logits = block[1][: w - 1] if block is not None else None
    if grammar is not None and grammar.mask_drafts and not selector:
        drafts, q, masks = walk_grammar(req, anchor, rows, w - 1, keys, logits)
    elif controls is not None and controls.follows_history and not selector:
        drafts, q, masks = walk(req, anchor, rows, w - 1, keys, logits)
    else:
        process = controls.draft if controls is not None else None
        drafts, q = propose(
            req.draft, req.state, anchor, rows, w - 1, req.params, keys, process, block
        )
        masks = masks_along(req, drafts)
    req.lazy_rows = 0  # computed with this draft pass
    return drafts.astype(mx.int32), q, masks


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
) -> tuple[mx.array, mx.array | None, np.ndarray]:
    """The draft's proposals within the grammar, row by row on the host: the draft's block
    (processed with the committed history) is read back once, and each row is drawn from the
    tokens the grammar allows after the proposals before it: greedily, or from
    `softmax(row / temperature)` over them with the row's own key (that is its `q`). The
    matcher advances with each proposal and is rolled back after; a proposed EOS ends the
    block. Returns the proposals, `q` when sampling, and the masks of every verified row."""
    grammar, greedy = req.controls.grammar, req.params.greedy
    if logits is None:
        logits = req.draft.block_logits(anchor, length, rows, req.state)
    logits = req.controls.draft(logits)
    if not greedy:
        logits = logits * (1.0 / req.params.temperature)
    host = np.array(logits, dtype=np.float64)  # the one host sync of the walk
    seeds = None if greedy else np.array(keys).astype(np.uint64)
    masks, drafts, qs = [grammar.mask()], [], []
    for i in range(rows):
        row = np.where(grammar.allowed(masks[-1]), host[i], -np.inf)
        if greedy:
            tok = int(np.argmax(row))
        else:
            q = np.exp(row - row.max())
            qs.append(q / q.sum())
            rng = np.random.default_rng(int(seeds[i, 0] << np.uint64(32) | seeds[i, 1]))
            tok = int(min(np.searchsorted(np.cumsum(qs[-1]), rng.random()), row.size - 1))
        drafts.append(tok)
        if tok in grammar.eos:
            break
        grammar.consume([tok])
        masks.append(grammar.mask())
    grammar.rollback(len(masks) - 1)
    if len(masks) == len(drafts):  # nothing follows a proposed EOS: its row is unread
        masks.append(np.full_like(masks[0], -1))
    q = mx.array(np.stack(qs), dtype=mx.float32) if qs else None
    return mx.array(drafts, dtype=mx.int32), q, np.stack(masks)


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
