"""Training DFlash 2 drafts (SPEC 3): the two-tap conv and the candidate selector.

Owns: the DFlash 2 config of a draft (`dflash2_config`), turning a DFlash 1 draft into a
DFlash 2 draft that drafts exactly as it did (`upgrade`: identity convs, a selector whose
scores are the draft's own logits), and the DFlash 2 loss (`dflash2_loss`: the DFlash 1
block loss plus the selector's loss; the objective and its reasons: docs/training.md, "The
DFlash 2 objective"). The loop, data, checkpoints and held-out τ are `trainer.train`'s;
the CLI passes this loss to it. Never prints.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import BadArgument
from ..models.config import DraftConfig
from ..models.draft import BlockContext, DFlashDraft
from ..pair import Pair
from .blocks import fast_path, grouped_hidden

# The published checkpoints' shapes (SPEC 3): two taps, groups of 16 channels, rank 256,
# 16 candidates per slot.
CONV_KERNEL_SIZE = 2
CONV_GROUP_SIZE = 16
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
# The selector's loss weight against the draft's block loss (docs/training.md).
SELECTOR_WEIGHT = 1.0


def dflash2_config(
    config: dict,
    *,
    kernel_size: int = CONV_KERNEL_SIZE,
    group_size: int = CONV_GROUP_SIZE,
    rank: int = SELECTOR_RANK,
    top_k: int = SELECTOR_TOP_K,
) -> dict:
    """The DFlash 2 `config.json` of a DFlash 1 draft's config (a copy; SPEC 3's fields)."""
    hidden = config["hidden_size"]
    if group_size < 1 or hidden % group_size:
        raise BadArgument(
            f"conv group size {group_size} must divide the draft's hidden_size {hidden}"
        )
    for name, value in (("conv kernel size", kernel_size), ("rank", rank), ("top-k", top_k)):
        if value < 1:
            raise BadArgument(f"DFlash 2 {name} {value} must be >= 1")
    if top_k > config["vocab_size"]:
        raise BadArgument(f"selector top-k {top_k} exceeds the vocabulary ({config['vocab_size']})")
    out = copy.deepcopy(config)
    out["architectures"] = ["DFlash2DraftModel"]
    out["dflash_config"].update(
        conv_kernel_size=kernel_size,
        conv_group_size=group_size,
        selector_rank=rank,
        selector_top_k=top_k,
    )
    return out


def neutral_modules(draft: DFlashDraft, seed: int = 0) -> None:
    """Make `draft`'s DFlash 2 modules drafting-neutral: every conv the identity (tap 0 is
    1, the other taps 0, no dynamic part: `kernel_projection` 0) and the selector's pair
    scores 0 (`successor_codebook` 0), so `S_t(a, b) = U_t(b)` and its walk takes the
    draft's own argmax. Gradients still reach every new weight: a conv's earlier tap and
    its projection see nonzero inputs, and with random predecessor codes and hidden
    projection the successor codes get a nonzero gradient from the first step (all three
    zero would be a saddle with none)."""
    key = mx.random.key(seed)
    for layer in draft.layers:
        for conv in layer.convs():
            conv.base_kernel = mx.zeros(conv.base_kernel.shape).at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros(conv.kernel_projection.weight.shape)
    sel = draft.candidate_selector
    V, r = sel.predecessor_codebook.shape
    k1, k2 = mx.random.split(key)
    sel.predecessor_codebook = mx.random.normal((V, r), key=k1) / math.sqrt(r)
    sel.successor_codebook = mx.zeros((V, r))
    d = sel.hidden_projection.weight.shape[1]
    sel.hidden_projection.weight = mx.random.normal((r, d), key=k2) / math.sqrt(d)


def upgrade(draft: DFlashDraft, config: dict, seed: int = 0) -> DFlashDraft:
    """A DFlash 2 draft (`config`, from `dflash2_config`) with every weight of the DFlash 1
    `draft` and neutral new modules: it drafts exactly the tokens `draft` drafts (greedy)
    until it is trained. float32, as `trainer.init_draft` makes drafts."""
    if draft.config.is_dflash2:
        raise BadArgument("the draft is already DFlash 2: fine-tune it with --init instead")
    new = DFlashDraft(DraftConfig.from_dict(config))
    new.update(tree_unflatten(tree_flatten(draft.parameters())))
    neutral_modules(new, seed)
    new.set_dtype(mx.float32)
    mx.eval(new.parameters())
    return new


# -- the loss ----------------------------------------------------------------------------------


def block_outputs(
    draft: DFlashDraft,
    feats: mx.array,
    seq_index: mx.array,
    anchors: mx.array,
    block: mx.array,
    head,
    layout: tuple[int, mx.array] | None = None,
) -> tuple[mx.array, mx.array]:
    """Final normed hidden states `(n, L-1, D)` and float32 logits `(n, L-1, V)` of block
    indices 1..L-1 of every block: what `DFlashDraft.training_logits` computes (each block
    sees the context before its anchor and its own rows), with the hidden states the
    selector reads. `layout` (`grouped_blocks`'s m and slots): the shared-context path."""
    L = block.shape[1]
    if layout is not None and fast_path(draft):
        m, slot = layout
        n_slots = feats.shape[0] * m
        padded_anchors = mx.zeros((n_slots,), mx.int32).at[slot].add(anchors)
        padded = mx.full((n_slots, L), draft.config.mask_token_id, dtype=mx.int32)
        padded[slot] = block
        h = grouped_hidden(draft, feats, padded_anchors, padded, head, m)[slot]
    else:
        c = draft.hidden_norm(draft.fc(feats))
        x = head.embed(block)
        for layer in draft.layers:
            k, v = layer.self_attn._kv(c, 0)
            x = layer(x, BlockContext(k[seq_index], v[seq_index], anchors))
        h = draft.norm(x)
    h = h[:, 1:]
    return h, draft.logits(h, head).astype(mx.float32)


def selector_terms(
    selector, logits: mx.array, hidden: mx.array, prev: mx.array, labels: mx.array
) -> tuple[mx.array, mx.array]:
    """Per slot: the selector's cross-entropy of the label among the draft's candidates
    given the true predecessor, and whether the label is a candidate at all.

    logits (n, T, V), hidden (n, T, D), prev / labels (n, T) token ids. The candidate set
    `C_t = top-k(U_t)` is what inference would take (no gradient through the choice); the
    scores `S_t(prev, b) = U_t(b) + <A(prev) * H(h_t), B(b)>` carry gradient into the
    codebooks, the hidden projection and the draft's logits and hidden states."""
    k = min(selector.top_k, logits.shape[-1])
    cands = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])  # (n, T, k)
    u = mx.take_along_axis(logits, cands, axis=-1)
    a = selector.predecessor_codebook[prev]  # (n, T, r)
    hh = selector.hidden_projection(hidden)  # (n, T, r)
    b = selector.successor_codebook[cands]  # (n, T, k, r)
    scores = u + ((a * hh)[..., None, :] * b).sum(-1)  # (n, T, k)
    eq = cands == labels[..., None]
    hit = eq.any(axis=-1)
    chosen = (scores * eq).sum(-1)
    return mx.logsumexp(scores, axis=-1) - chosen, hit


def dflash2_loss(
    pair: Pair,
    feats: mx.array,
    nxt: mx.array,
    tokens: mx.array,
    seq_index: mx.array,
    anchors: mx.array,
    lengths: mx.array,
    gamma: float,
    layout: tuple[int, mx.array] | None = None,
    selector_weight: float = SELECTOR_WEIGHT,
) -> mx.array:
    """`trainer.block_loss` (weighted cross-entropy of each block index's prediction of the
    target's token) plus `selector_weight` times the selector's loss, each slot weighted as
    the block loss weighs it and counted where the target's token is a candidate.
    Same signature as `block_loss`: `trainer.train(..., loss_fn=dflash2_loss)`."""
    draft = pair.draft
    L = draft.config.block_size
    k = mx.arange(1, L)
    block = mx.full((anchors.size, L), draft.config.mask_token_id, dtype=mx.int32)
    block[:, 0] = tokens[seq_index, anchors]
    h, logits = block_outputs(draft, feats, seq_index, anchors, block, pair.head, layout)
    pos = anchors[:, None] + k[None] - 1  # label for index k: the target's token at anchor + k
    valid = (anchors[:, None] + k[None]) < lengths[seq_index][:, None]
    labels = nxt[seq_index[:, None], mx.minimum(pos, tokens.shape[1] - 1)]
    w = mx.exp(-(k - 1) / gamma)[None] * valid
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
    if selector_weight and "candidate_selector" in draft:
        # The true predecessor of slot k: the anchor for k = 1, else the label of k - 1.
        prev = mx.concatenate([block[:, :1], labels[:, :-1]], axis=1)
        sel, hit = selector_terms(draft.candidate_selector, logits, h, prev, labels)
        ws = w * hit
        loss = loss + selector_weight * (sel * ws).sum() / mx.maximum(ws.sum(), 1e-6)
    return loss
