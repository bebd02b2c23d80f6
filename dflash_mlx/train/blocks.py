"""The training step's fast path: many blocks of one sequence sharing its context.

`DFlashDraft.training_logits` gathers, for every block, its own copy of the context's keys
and values; `grouped_logits` lays the blocks out `m` per sequence (`grouped_blocks`) so that
one sequence's blocks share them: the same logits, about 23% less time a training step
(docs/training.md). Used by `train.block_loss` where `fast_path` says it is exact.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..models.draft import DFlashDraft, DraftMLP

LOG2E = 1.4426950408889634


def exp(x: mx.array) -> mx.array:
    """e**x computed as 2**(x log2 e): the same float32 values to a few ulps, and on a CPU
    about 3x faster with MLX 0.32 (its exp took ~14 ns an element on this machine, its
    power ~5 ns). A training step's transcendental work is the loss over the vocabulary,
    the attention's softmax and the MLP's SiLU, each forward and backward: with `exp` they
    were half of the step (docs/training.md)."""
    return mx.power(2.0, x * LOG2E)


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x) with `exp` (its argument capped: below x = -80, e**-x would overflow
    float32 and its gradient be nan; there SiLU and its slope are ~1e-33 either way)."""
    return x / (1.0 + exp(mx.minimum(-x, 80.0)))


def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    """Per-row cross-entropy over the last axis (float32), as `nn.losses.cross_entropy`."""
    logits = logits.astype(mx.float32)
    z = logits - mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    picked = mx.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    return mx.log(exp(z).sum(axis=-1)) - picked


def grouped_blocks(seq_index: np.ndarray, batch: int) -> tuple[int, np.ndarray]:
    """(m, slot): the blocks laid out `m` per sequence (the most any sequence has), block i
    at `slot[i]` of the `batch * m` slots; `seq_index` ascending, as `sample_batch` makes it."""
    counts = np.bincount(seq_index, minlength=batch)
    m = max(1, int(counts.max()) if counts.size else 1)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(len(seq_index)) - first[seq_index]
    return m, (seq_index * m + rank).astype(np.int32)


def fast_path(draft: DFlashDraft) -> bool:
    """A float32 draft (DFlash 1, or DFlash 2 with its convs): `grouped_logits` computes
    exactly its view. In half precision its products trained a markedly worse draft than the fused
    attention of `training_logits` (held-out loss 4.66 against 3.74 on the demo target in
    bfloat16, 40 steps; 3.93 with its scores in float32), so half-precision drafts take the
    fused path."""
    dtypes = {v.dtype for _, v in tree_flatten(draft.trainable_parameters())}
    return dtypes <= {mx.float32}


def grouped_logits(
    draft: DFlashDraft,
    features: mx.array,
    anchors: mx.array,
    block_ids: mx.array,
    head,
    m: int,
    rows: mx.array | None = None,
) -> mx.array:
    """`grouped_hidden` through the LM head: logits (B*m, L-1, V), float32; or only those of
    the slots `rows` (taken before the LM head, so that the backward pass scatters hidden
    states, not logits as wide as the vocabulary)."""
    h = grouped_hidden(draft, features, anchors, block_ids, head, m)
    if rows is not None:
        h = h[rows]
    return draft.logits(h[:, 1:], head).astype(mx.float32)


def grouped_hidden(
    draft: DFlashDraft,
    features: mx.array,
    anchors: mx.array,
    block_ids: mx.array,
    head,
    m: int,
) -> mx.array:
    """`DFlashDraft.training_logits` for blocks laid out `m` per sequence (slot b*m + j is
    sequence b's j-th block): the same view (a block sees the context rows before its
    anchor, within the layer's window, and its own rows), computed without a copy of the
    context per block. The blocks of one sequence share its keys and values, so the
    context scores are one matrix product per sequence and head group, not a gathered
    (blocks, S) copy of the keys and values per layer and its scatter in the backward
    pass (the time of a step went there: 32 anchors per sequence, 16 x 228 tokens, block 8:
    draft 2.3 s of a 3.8 s step). A DFlash 2 layer's convs wrap its sublayers as
    `DraftLayer` does (zero before block index 0, as in training). Returns the final normed
    hidden states of every block row (B*m, L, D)."""
    B, S = features.shape[0], features.shape[1]
    N, L = block_ids.shape
    c = draft.hidden_norm(draft.fc(features))
    x = head.embed(block_ids)
    cols = mx.arange(S)[None]
    causal_inner = mx.arange(L)[None] <= mx.arange(L)[:, None]
    for layer in draft.layers:
        attn = layer.self_attn
        H, Hkv = attn.n_heads, attn.n_kv_heads
        G = H // Hkv
        h = layer.input_layernorm(x)
        convs = layer.convs()
        if convs:
            d_attn = convs[0].deltas(h)
            h = convs[0].prepare(h, d_attn)
        q = attn.q_norm(attn.q_proj(h).reshape(N, L, H, -1))
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=anchors) * attn.scale  # (N, H, L, Dh)
        Dh = q.shape[-1]
        kb, vb = attn._kv(h, anchors)  # (N, Hkv, L, Dh)
        ck, cv = attn._kv(c, 0)  # (B, Hkv, S, Dh)
        qg = q.reshape(B, m, Hkv, G, L, Dh).transpose(0, 2, 1, 3, 4, 5)  # (B, Hkv, m, G, L, Dh)
        sc = (qg.reshape(B, Hkv, m * G * L, Dh) @ ck.swapaxes(-1, -2)).reshape(B, Hkv, m, G, L, S)
        seen = cols < anchors[:, None]  # (N, S)
        if attn.window is not None:
            seen = seen & (cols >= anchors[:, None] - (attn.window - 1))
        seen = seen.reshape(B, 1, m, 1, 1, S)
        sc = mx.where(seen, sc, -mx.inf)
        sb = q.reshape(N, Hkv, G, L, Dh) @ kb[:, :, None].swapaxes(-1, -2)  # (N, Hkv, G, L, L)
        if attn.causal:
            sb = mx.where(causal_inner, sb, -mx.inf)
        sb = sb.reshape(B, m, Hkv, G, L, L).transpose(0, 2, 1, 3, 4, 5)
        # softmax over the context's and the block's scores together, without joining them
        top = mx.stop_gradient(mx.maximum(sc.max(-1, keepdims=True), sb.max(-1, keepdims=True)))
        pc, pb = exp(sc - top), exp(sb - top)
        total = pc.sum(-1, keepdims=True) + pb.sum(-1, keepdims=True)
        pc, pb = pc / total, pb / total
        oc = (pc.reshape(B, Hkv, m * G * L, S) @ cv).reshape(B, Hkv, m, G, L, Dh)
        oc = oc.transpose(0, 2, 1, 3, 4, 5).reshape(N, Hkv, G, L, Dh)
        pb = pb.transpose(0, 2, 1, 3, 4, 5).reshape(N, Hkv, G, L, L)
        o = (oc + pb @ vb[:, :, None]).reshape(N, H, L, Dh)
        a = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(N, L, -1))
        if not convs:
            h = x + a
            x = h + _mlp(layer.mlp, layer.post_attention_layernorm(h))
            continue
        h = x + convs[0].finish(a, d_attn)
        v = layer.post_attention_layernorm(h)
        d_mlp = convs[1].deltas(v)
        x = h + convs[1].finish(_mlp(layer.mlp, convs[1].prepare(v, d_mlp)), d_mlp)
    return draft.norm(x)


def _mlp(mlp, x: mx.array) -> mx.array:
    if isinstance(mlp, DraftMLP):  # SwiGLU with the faster `exp`
        return mlp.down_proj(silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return mlp(x)
