"""The draft's blocks for several requests in one forward pass (SPEC 8).

Each request keeps its own `DraftState` (context rows, gaps, window). For one pass the rows'
context K/V of each draft layer are gathered side by side (padded, each row seeing its own
rows only), each block at its own RoPE position: the view `DFlashDraft` training already
takes (`BlockContext`: many blocks, each with its own context and anchor). What comes out
for row `b` is what `sampling.propose` gives for that request alone.

Every request of a DFlash 1 or DFlash 2 draft shares the pass (each row's conv rows carried
per row); what each does with its block's logits is its own (`walks.make_drafts`: its
selector walk, its penalties' and grammar's walks in `walks.py`). A draft class that
computes its blocks its own way drafts alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..models.conv import ConvRows
from ..models.draft import BlockContext, DFlashDraft, DraftAttention, narrowest
from .prefill import Request
from .walks import make_drafts


class RowsContext(BlockContext):
    """One draft layer's context for a batch of blocks: `keys`/`values` `(B, Hkv, S, Dh)`,
    row `b` holding `counts[b]` context rows (its window already applied), its block at
    RoPE position `positions[b]`."""

    def __init__(self, keys: mx.array, values: mx.array, positions: mx.array, counts: mx.array):
        super().__init__(keys, values, positions)
        self.counts = counts

    def visible(self, window: int | None) -> mx.array:
        return mx.arange(self.keys.shape[2])[None] < self.counts[:, None]


def batchable(req: Request) -> bool:
    """Whether this request's drafts can come from a batched draft pass (a draft class
    that computes its blocks its own way drafts alone)."""
    draft = req.draft
    return (
        draft is not None
        and type(draft).block_logits is DFlashDraft.block_logits
        and type(draft).hidden is DFlashDraft.hidden
    )


def propose_rows(
    reqs: list[Request],
    anchors: list[mx.array],
    starts: list[int],
    widths: list[int],
    length: int,
) -> list[tuple[mx.array, mx.array | None]]:
    """For each request `b`: its `widths[b] - 1` proposals after `anchors[b]` (at generated
    index `starts[b]`) and, when it samples, their distributions `q`, from one pass of the
    draft over blocks of `length` rows (`walks.make_drafts` for a batch)."""
    hidden, logits = block_rows(reqs, anchors, length, max(widths) - 1)
    out = []
    for b, req in enumerate(reqs):
        block = (hidden[b], logits[b])
        drafts, q, _ = make_drafts(req, anchors[b], starts[b], widths[b], length, block)
        out.append((drafts, q))
    return out


def block_rows(
    reqs: list[Request], anchors: list[mx.array], length: int, rows: int
) -> tuple[mx.array, mx.array]:
    """One pass of the draft over each request's block of `length` rows after its anchor:
    the final normed hidden states `(B, rows, D)` and logits `(B, rows, V)` float32 of
    block indices `1..rows` (row `b` what `DFlashDraft.block_hidden` / `block_logits`
    give that request alone; a DFlash 2 draft's conv rows are each request's own)."""
    draft = reqs[0].draft
    feed_rows(reqs)
    block = mx.full((len(reqs), length), draft.config.mask_token_id, dtype=mx.int32)
    block[:, 0] = mx.concatenate([a.reshape(1) for a in anchors]).astype(mx.int32)
    head = reqs[0].state.head
    x = head.embed(block)
    positions = mx.array([r.state.caches[0].position for r in reqs])
    convs = [_RowsConv([r.state.conv[k] for r in reqs]) for k in range(len(reqs[0].state.conv))]
    for i, layer in enumerate(draft.layers):
        context = _context(layer, [r.state.caches[i] for r in reqs], positions)
        x = layer(x, context, convs[2 * i : 2 * i + 2] or None)
    for c in convs:
        c.hand_back()
    for req in reqs:
        req.lazy_rows = 0
    h = draft.norm(x)[:, 1 : rows + 1]
    return h, draft.logits(h, head).astype(mx.float32)


def feed_rows(reqs: list[Request]) -> None:
    """Every request's committed features not yet fed (`Request.feed_draft`), projected in
    one pass for all of them: the draft's `fc`, norm and each layer's K/V on the rows side
    by side, each row at its own RoPE position, then appended to each request's context.
    What each context holds is what feeding it alone gives (per request: 20-odd small
    operations, which at 8 rows cost a batched cycle's draft pass a quarter of its time)."""
    todo = [r for r in reqs if r.pending]
    draft = todo[0].draft if todo else None
    if len(todo) < 2 or not _feeds_by_row(draft):
        for req in todo:
            req.feed_draft()
        return
    feats = [p for r in todo for p in r.pending]
    counts = [sum(p.shape[1] for p in r.pending) for r in todo]
    c = draft.hidden_norm(draft.fc(mx.concatenate(feats, axis=1)))[0]  # (M, D)
    for i, layer in enumerate(draft.layers):
        attn = layer.self_attn
        caches = [r.state.caches[i] for r in todo]
        positions = mx.concatenate(
            [mx.arange(ch.position, ch.position + n) for ch, n in zip(caches, counts)]
        )
        m = c.shape[0]
        k = attn.k_norm(attn.k_proj(c).reshape(m, attn.n_kv_heads, 1, -1))
        k = attn.rope(k, offset=positions)  # (M, Hkv, 1, Dh): each row at its own position
        v = attn.v_proj(c).reshape(m, attn.n_kv_heads, 1, -1)
        start = 0
        for ch, n in zip(caches, counts):
            rows = slice(start, start + n)
            ch.update_and_fetch(
                k[rows].transpose(2, 1, 0, 3), v[rows].transpose(2, 1, 0, 3)
            )  # (1, Hkv, n, Dh)
            start += n
    for r in todo:
        r.pending.clear()
        r.state.forget()


def _feeds_by_row(draft: DFlashDraft) -> bool:
    """Whether `draft` projects context as `DFlashDraft` does, with RoPE that takes one
    offset per batch row (MLX's own): else each request is fed on its own."""
    return type(draft).add_context is DFlashDraft.add_context and all(
        type(layer.self_attn).add_context is DraftAttention.add_context
        and type(layer.self_attn)._kv is DraftAttention._kv
        and type(layer.self_attn.rope) is nn.RoPE
        for layer in draft.layers
    )


class _RowsConv(ConvRows):
    """The cross-block rows of one DFlash 2 conv for a batch's pass: each request's
    `x_{-1}` side by side (zeros where it has none, which is what none means), and the
    pass's inputs handed back to each request's own rows after it."""

    def __init__(self, rows: list[ConvRows]):
        super().__init__()
        self.rows = rows
        for which in (0, 1):
            states = [r.state[which] for r in rows]
            ref = next((a for a in states if a is not None), None)
            if ref is not None:
                self.state[which] = mx.concatenate(
                    [a if a is not None else mx.zeros_like(ref) for a in states]
                )

    def hand_back(self) -> None:
        for which in (0, 1):
            if self.last[which] is not None:
                for b, r in enumerate(self.rows):
                    r.last[which] = self.last[which][b : b + 1]


def _context(layer, caches: list, positions: mx.array) -> RowsContext:
    """The rows' context of one draft layer, side by side (each within its windows)."""
    attn = layer.self_attn
    keys, values, counts = [], [], []
    for c in caches:
        if c.offset == 0:
            keys.append(None)
            values.append(None)
            counts.append(0)
            continue
        k, v = c.visible(narrowest(attn.window, c.window))  # its window and sink
        keys.append(k)
        values.append(v)
        counts.append(k.shape[2])
    most = max(counts)
    ref = next((k for k in keys if k is not None), None)
    if ref is None:
        empty = mx.zeros((len(caches), attn.n_kv_heads, 0, attn.k_norm.weight.shape[0]))
        return RowsContext(empty, empty, positions, mx.array(counts))

    def padded(a: mx.array | None) -> mx.array:
        if a is None:
            return mx.zeros((1, *ref.shape[1:2], most, ref.shape[3]), dtype=ref.dtype)
        return mx.pad(a, [(0, 0), (0, 0), (0, most - a.shape[2]), (0, 0)])

    return RowsContext(
        mx.concatenate([padded(k) for k in keys]),
        mx.concatenate([padded(v) for v in values]),
        positions,
        mx.array(counts),
    )
