"""The DFlash draft model (SPEC 2): one forward pass drafts a whole block.

Owns the draft's layers, its KV-injection attention and the per-request `DraftState` it
reads and extends (context cache of projected K/V of committed target features, skipped
positions, DFlash 2 conv rows). Attribute names equal the checkpoint's weight names. Knows
nothing about tokenizers, sampling or the target beyond its `TargetHead`: the target's token
embedding and LM head, which a request's `DraftState` carries (a `Pair` makes both), so one
loaded draft can serve two targets at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import BadArgument
from .config import DraftConfig
from .conv import ConvRows, DynamicConv
from .draft_state import FORGET_SLACK, ContextCache, DraftState, TargetHead
from .selector import CandidateSelector

__all__ = ["FORGET_SLACK", "DFlashDraft", "DraftState", "TargetHead"]


class BlockContext:
    """One layer's view of the context for many training blocks at once.

    `keys`/`values` (n, Hkv, S, Dh): projected context rows of each block's sequence;
    `offset` (n,): each block's anchor position; `lengths`: rows 0..anchor-1 are visible.
    """

    def __init__(self, keys: mx.array, values: mx.array, anchors: mx.array):
        self.keys, self.values, self.offset = keys, values, anchors

    def visible(self, window: int | None) -> mx.array:
        cols = mx.arange(self.keys.shape[2])[None]
        seen = cols < self.offset[:, None]
        if window is not None:
            seen = seen & (cols >= self.offset[:, None] - (window - 1))
        return seen


class DraftAttention(nn.Module):
    """Queries from block rows; keys/values from `[context ; block]` with shared projections."""

    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scale = hd**-0.5
        self.causal = cfg.layer_is_causal(layer_idx)
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else None
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=cfg.rope_theta,
            traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1))
        k = self.rope(k.transpose(0, 2, 1, 3), offset=offset)  # (B, Hkv, L, Dh)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return k, v

    def add_context(self, ctx: mx.array, cache: ContextCache) -> None:
        """Project context rows (already `hidden_norm(fc(features))`) into the cache."""
        k, v = self._kv(ctx, cache.position)
        cache.update_and_fetch(k, v)

    def __call__(self, x: mx.array, cache: ContextCache | BlockContext) -> mx.array:
        """Block rows `x` (B, L, D) attend to the committed context and to each other.

        At inference `cache` holds the context of one sequence and the block starts right
        after it. In training it is a `BlockContext`: many blocks, each at its own anchor,
        each seeing only the context before its anchor (SPEC 2.3, the same view).
        """
        B, L, _ = x.shape
        # The block's first RoPE position (an array of anchors in training).
        offset = cache.offset if isinstance(cache, BlockContext) else cache.position
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        q = self.rope(q.transpose(0, 2, 1, 3), offset=offset)  # (B, H, L, Dh)
        k, v = self._kv(x, offset)
        visible = None  # (B, S) context columns each block may see; None: all
        n_ctx = 0
        if isinstance(cache, BlockContext):
            ck, cv = cache.keys, cache.values
            visible = cache.visible(self.window)
        elif cache.offset > 0:
            ck, cv = cache.visible(narrowest(self.window, cache.window))
        if isinstance(cache, BlockContext) or cache.offset > 0:
            n_ctx = ck.shape[2]
            k = mx.concatenate([ck, k], axis=2)
            v = mx.concatenate([cv, v], axis=2)
        mask = None
        if self.causal or visible is not None:
            rows = mx.arange(L)[:, None]
            inner = (mx.arange(L)[None] <= rows) if self.causal else mx.ones((L, L), mx.bool_)
            ctx = mx.ones((1, 1, L, n_ctx), mx.bool_)
            if visible is not None:
                ctx = mx.broadcast_to(visible[:, None, None, :], (B, 1, L, n_ctx))
            inner = mx.broadcast_to(inner, (ctx.shape[0], 1, L, L))
            mask = mx.concatenate([ctx, inner], axis=-1)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def narrowest(*windows: int | None) -> int | None:
    """The smallest of some attention windows (None: unlimited)."""
    limited = [w for w in windows if w is not None]
    return min(limited) if limited else None


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    """DFlash 1 layer; DFlash 2 wraps both sublayers in a dynamic conv (SPEC 3.1)."""

    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.is_dflash2:
            taps, g = cfg.conv_kernel_size, cfg.conv_group_size
            self.attention_conv = DynamicConv(cfg.hidden_size, taps, g)
            self.mlp_conv = DynamicConv(cfg.hidden_size, taps, g)

    def convs(self) -> list[DynamicConv]:
        return [self.attention_conv, self.mlp_conv] if "attention_conv" in self else []

    def __call__(
        self,
        x: mx.array,
        cache: ContextCache | BlockContext,
        rows: Sequence[ConvRows] | None = None,
    ) -> mx.array:
        """`rows`: the request's cross-block rows of this layer's two convs (DFlash 2)."""
        if "attention_conv" not in self:
            h = x + self.self_attn(self.input_layernorm(x), cache)
            return h + self.mlp(self.post_attention_layernorm(h))
        ac, mc = self.attention_conv, self.mlp_conv
        ar, mr = rows if rows is not None else (None, None)
        u = self.input_layernorm(x)
        d = ac.deltas(u)
        h = x + ac.finish(self.self_attn(ac.prepare(u, d, ar), cache), d, ar)
        v = self.post_attention_layernorm(h)
        d = mc.deltas(v)
        return h + mc.finish(self.mlp(mc.prepare(v, d, mr)), d, mr)


class DFlashDraft(nn.Module):
    """A DFlash draft (v1, or v2 when the config has the DFlash 2 fields).

    Weights and pure functions only: every call that reads or extends the context takes
    the request's `DraftState`, which also carries the target's embedding and head
    (`TargetHead`, from the `Pair` that made the state). Per cycle the engine calls
    `add_context`, runs the block (`block_logits`, or `block_hidden` + `logits`), then
    commits the state. Sampling the
    proposals is `sampling.propose`'s job.
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        n_feat = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.is_dflash2:
            self.candidate_selector = CandidateSelector(
                cfg.vocab_size, cfg.selector_rank, cfg.hidden_size, cfg.selector_top_k
            )
        if cfg.is_dflash2:
            self.conv_state = "carry" if cfg.conv_cross_block_state else "zero"

    def head_for(
        self,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        embed_scale: float = 1.0,
    ) -> TargetHead:
        """This draft's view of a target with that embedding (scaled by the target's
        `embed_scale`) and LM head (`Pair` checks the fit first)."""
        return TargetHead(embed, lm_head, embed_scale * self.config.input_embedding_scale)

    def make_state(
        self,
        base: int = 0,
        window: int | None = None,
        head: TargetHead | None = None,
        sink: int | None = None,
    ) -> DraftState:
        """An empty context whose first row will stand for target position `base`; blocks
        see at most `window` positions (the anchor and `window - 1` context rows; None: the
        checkpoint's own, a sliding layer's `sliding_window`, else the context it was
        trained on where its config says, else all) and, under a window, the context's first
        `sink` rows (None: the checkpoint's default, `context_sink`); `head`: the target
        it drafts for (`Pair.draft_state` passes it)."""
        return DraftState(
            len(self.layers),
            len(self._convs()),
            base,
            self.windows(window),
            head,
            self.context_sink(sink),
        )

    def windows(self, window: int | None = None) -> list[int | None]:
        """Each layer's window under a request's `window` (see `make_state`)."""
        if window is None:
            window = self.config.training_context
        return [narrowest(layer.self_attn.window, window) for layer in self.layers]

    def context_sink(self, sink: int | None = None) -> int:
        """The sink a request's `sink` means (None: the checkpoint's, see `DraftConfig`);
        it applies only where every layer has a window (`DraftState.set_windows`)."""
        return self.config.context_sink if sink is None else sink

    def _convs(self) -> list[DynamicConv]:
        return [c for layer in self.layers for c in layer.convs()]

    @property
    def conv_state(self) -> str:
        """DFlash 2 cross-block state: "carry" feeds the last accepted row as `x_{-1}`,
        "zero" keeps the training-time zero. Default: what the checkpoint declares."""
        convs = self._convs()
        return "carry" if convs and convs[0].carry_state else "zero"

    @conv_state.setter
    def conv_state(self, mode: str) -> None:
        if mode not in ("carry", "zero"):
            raise BadArgument(f"conv_state {mode!r}: expected 'carry' or 'zero'")
        if not self.config.is_dflash2:
            raise BadArgument("conv_state applies to DFlash 2 drafts only")
        for c in self._convs():
            c.carry_state = mode == "carry"

    def add_context(self, features: mx.array, state: DraftState) -> None:
        """Append target features `(1, m, len(target_layer_ids) * D)` of committed positions."""
        c = self.hidden_norm(self.fc(features))
        for layer, cache in zip(self.layers, state.caches):
            layer.self_attn.add_context(c, cache)
        state.forget()

    def hidden(self, block_ids: mx.array, state: DraftState) -> mx.array:
        """Final normed hidden states of the block rows, `(1, L, D)`."""
        x = _head(state.head).embed(block_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, state.caches)):
            rows = state.conv[2 * i : 2 * i + 2] if state.conv else None
            x = layer(x, cache, rows)
        return self.norm(x)

    def logits(self, h: mx.array, head: TargetHead) -> mx.array:
        """The target's LM head over draft hidden states, with the draft's output scaling."""
        out = _head(head).lm_head(h)
        if self.config.output_multiplier != 1.0:
            out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def training_logits(
        self,
        features: mx.array,
        seq_index: mx.array,
        anchors: mx.array,
        block_ids: mx.array,
        head: TargetHead,
    ) -> mx.array:
        """Many blocks in one pass, each seeing exactly what inference would show it.

        features (Bs, S, K*D): target features of whole sequences; block b holds
        `block_ids[b]` (L,) = [token at its anchor, MASK, ...], anchored at position
        `anchors[b]` of sequence `seq_index[b]`. Blocks never see each other, and a block
        sees only the context rows before its anchor. Returns logits (n, L-1, V), float32.
        """
        c = self.hidden_norm(self.fc(features))
        x = _head(head).embed(block_ids)
        for layer in self.layers:
            k, v = layer.self_attn._kv(c, 0)  # (Bs, Hkv, S, Dh)
            x = layer(x, BlockContext(k[seq_index], v[seq_index], anchors))
        return self.logits(self.norm(x)[:, 1:], head).astype(mx.float32)

    def block_hidden(self, anchor: mx.array, length: int, rows: int, state: DraftState) -> mx.array:
        """Final normed hidden states of block indices `1..rows`, `(rows, D)`."""
        mask = mx.full((length - 1,), self.config.mask_token_id, dtype=anchor.dtype)
        block = mx.concatenate([anchor.reshape(1), mask])[None]
        return self.hidden(block, state)[0, 1 : rows + 1]

    def block_logits(
        self, anchor: mx.array, length: int, rows: int | None, state: DraftState
    ) -> mx.array:
        """Logits for block indices `1..rows` (None: `length-1`), `(rows, V)`, float32.

        The draft attends over all `length` rows; only the rows the verifier will check
        go through the LM head, the draft's most expensive matmul on large vocabularies.
        """
        rows = length - 1 if rows is None else rows
        h = self.block_hidden(anchor, length, rows, state)
        return self.logits(h, state.head).astype(mx.float32)


def _head(head: TargetHead | None) -> TargetHead:
    if head is None:
        raise RuntimeError(
            "the draft has no target: make its state with Pair.draft_state() (or pass "
            "head=pair.head to make_state)"
        )
    return head


def embedding_scale_for(model_type: str, hidden_size: int) -> float:
    """Targets that scale their embeddings inside the model (the draft must do the same)."""
    if model_type.startswith("gemma"):
        return math.sqrt(hidden_size)
    return 1.0
