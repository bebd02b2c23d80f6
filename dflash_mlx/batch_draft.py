"""The draft's blocks for several requests in one forward pass (SPEC 8).

Each request keeps its own `DraftState` (context rows, gaps, window). For one pass the rows'
context K/V of each draft layer are gathered side by side (padded, each row seeing its own
rows only), each block at its own RoPE position: the view `DFlashDraft` training already
takes (`BlockContext`: many blocks, each with its own context and anchor). What comes out
for row `b` is what `sampling.propose` gives for that request alone.

Batched here: DFlash 1 drafts, requests without logits processors (their drafts walk row
by row, `walks.py`). The others draft one by one (`decode.make_drafts`).
"""

from __future__ import annotations

import mlx.core as mx

from .draft import BlockContext, DFlashDraft, narrowest
from .prefill import Request
from .sampling import PositionKeys, probabilities, sample_rows


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
        and req.controls is None
        and not draft.config.is_dflash2
        and "candidate_selector" not in draft
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
    draft over blocks of `length` rows (`decode.make_drafts` for a batch)."""
    logits = block_logits_rows(reqs, anchors, length, max(widths) - 1)
    return [chain(req, logits[b], starts[b], widths[b]) for b, req in enumerate(reqs)]


def block_logits_rows(
    reqs: list[Request], anchors: list[mx.array], length: int, rows: int
) -> mx.array:
    """One pass of the draft over each request's block of `length` rows after its anchor:
    the logits of block indices `1..rows`, `(B, rows, V)` float32 (row `b` what
    `DFlashDraft.block_logits` gives that request alone)."""
    draft = reqs[0].draft
    for req in reqs:
        req.feed_draft()
    block = mx.full((len(reqs), length), draft.config.mask_token_id, dtype=mx.int32)
    block[:, 0] = mx.concatenate([a.reshape(1) for a in anchors]).astype(mx.int32)
    head = reqs[0].state.head
    x = head.embed(block)
    positions = mx.array([r.state.caches[0].position for r in reqs])
    for i, layer in enumerate(draft.layers):
        x = layer(x, _context(layer, [r.state.caches[i] for r in reqs], positions))
    for req in reqs:
        req.lazy_rows = 0
    return draft.logits(draft.norm(x)[:, 1 : rows + 1], head).astype(mx.float32)


def chain(
    req: Request, logits: mx.array, start: int, width: int
) -> tuple[mx.array, mx.array | None]:
    """A chain's `width - 1` proposals from one row's block `logits` (the anchor at
    generated index `start`), and their distributions `q` when it samples."""
    n = width - 1
    if req.params.greedy:
        return mx.argmax(logits[:n], axis=-1).astype(mx.int32), None
    q = probabilities(logits[:n], req.params)
    keys = req.keys(PositionKeys.DRAFT, start + 1, n)
    return sample_rows(q, keys).astype(mx.int32), q


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
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        window = narrowest(attn.window, c.window)
        if window is not None:
            k, v = k[..., -(window - 1) :, :], v[..., -(window - 1) :, :]
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
