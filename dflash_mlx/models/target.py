"""mlx-lm target adapter: hidden-state capture, caches and rewind (SPEC 5).

Owns how we look inside an mlx-lm model without changing it for anyone else: the decoder
layer *instances* of one model get a capturing subclass (no class-level patch), so plain
mlx-lm decoding of the same model is unaffected. Owns the one rewind helper
(`TargetAdapter.rewind`): trimmable caches are trimmed, recurrent caches (`ArraysCache`,
e.g. Qwen3.5 GatedDeltaNet) are restored and replayed over the accepted prefix. Knows
nothing about drafts, sampling or text.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .. import distributed
from ..errors import BadCheckpoint


class _Recorder:
    """Per-forward scratch the wrapped layers write into (references only, no compute)."""

    def __init__(self) -> None:
        self.capture_ids: frozenset[int] = frozenset()
        self.replay_ids: frozenset[int] = frozenset()
        self.outputs: dict[int, mx.array] = {}
        self.calls: dict[int, tuple[mx.array, tuple, dict]] = {}
        # A tree pass (SPEC 7): the attention mask every layer gets instead of the causal
        # one, and each fed token's depth (its position is the cache offset plus it).
        self.tree_mask: mx.array | None = None
        self.tree_depths: mx.array | None = None

    def clear(self) -> None:
        self.outputs = {}
        self.calls = {}


_CAPTURE_CLASSES: dict[type, type] = {}

# The recorder of the forward pass running in this thread (None: no adapter's pass, e.g.
# plain mlx-lm decoding of the same model). Each adapter has its own recorder, so two
# adapters of one model (one target paired with two drafts) never see each other's pass.
_ACTIVE: ContextVar[_Recorder | None] = ContextVar("dflash_mlx_recorder", default=None)


def _capturing_class(cls: type) -> type:
    """A subclass of a decoder-layer class whose instances report their input and output."""
    if cls in _CAPTURE_CLASSES:
        return _CAPTURE_CLASSES[cls]

    def __call__(self, x, *args, **kwargs):
        rec = _ACTIVE.get()
        if rec is not None and rec.tree_mask is not None:
            if args:
                args = (rec.tree_mask, *args[1:])
            else:
                kwargs["mask"] = rec.tree_mask
        out = cls.__call__(self, x, *args, **kwargs)
        if rec is not None:
            i = self._dflash_idx
            if i in rec.capture_ids:
                rec.outputs[i] = out
            if i in rec.replay_ids:
                rec.calls[i] = (x, args, kwargs)
        return out

    sub = type(f"DFlashCaptured{cls.__name__}", (cls,), {"__call__": __call__})
    _CAPTURE_CLASSES[cls] = sub
    return sub


def _inner_lm(model: nn.Module) -> nn.Module:
    """The text model holding `.model` and maybe `.lm_head` (VLM-style wrappers unwrapped)."""
    if "language_model" in model and isinstance(model["language_model"], nn.Module):
        return model["language_model"]
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(_inner_lm(model).model, "layers", None)
    if not layers:
        raise BadCheckpoint(
            f"cannot find the decoder layers of target {type(model).__module__}; "
            "expected an mlx-lm causal LM with `.layers`"
        )
    return list(layers)


class TargetAdapter:
    """Forward passes of an mlx-lm model that also return the features a draft reads.

    Made by a `Pair` (one per pairing: its recorder is its own). Its decoder layers get a
    capturing subclass that reports to whichever adapter's pass is running in the thread
    (their index in the model is the only thing a layer keeps: `_dflash_idx`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        inner = _inner_lm(model)
        backbone = inner.model
        self.embed_tokens = backbone.embed_tokens
        args = getattr(inner, "args", None) or getattr(model, "args", None)
        self.model_type = str(getattr(args, "model_type", getattr(model, "model_type", "")))
        self.hidden_size = int(getattr(args, "hidden_size", 0) or backbone.norm.weight.shape[-1])
        self.embed_rows = int(
            getattr(self.embed_tokens, "num_embeddings", 0) or self.embed_tokens.weight.shape[0]
        )
        self.vocab_size = getattr(args, "vocab_size", None)
        self._head = inner["lm_head"] if "lm_head" in inner else None
        self.layers = _decoder_layers(model)
        self.num_layers = len(self.layers)
        # A pipeline shard holds a run of the layers (`distributed.pipeline_span`): these are
        # its own, the first one's index in the whole model `first_layer` (None: all).
        self.first_layer, self.layers, self.num_layers = distributed.pipeline_span(
            backbone, args, self.layers
        )
        self._rec = _Recorder()
        for i, layer in enumerate(self.layers):
            if type(layer) not in _CAPTURE_CLASSES.values():
                layer.__class__ = _capturing_class(type(layer))
                layer._dflash_idx = i

    @property
    def logits_width(self) -> int:
        """Entries in a row of the target's logits: its LM head's rows (the embedding's when
        tied)."""
        head = self._head if self._head is not None else self.embed_tokens
        return int(head.weight.shape[0])

    @classmethod
    def of(cls, model: nn.Module) -> TargetAdapter:
        """Deprecated: a `Pair` owns its adapter (`pair.target`); this makes a new one."""
        import warnings

        warnings.warn(
            "TargetAdapter.of(model) is deprecated: use Pair(model, draft).target",
            DeprecationWarning,
            stacklevel=2,
        )
        return cls(model)

    @property
    def context_limit(self) -> int | None:
        """The target's `max_position_embeddings` (top level or in `text_config`), if any."""
        inner = _inner_lm(self.model)
        args = getattr(inner, "args", None) or getattr(self.model, "args", None)
        n = getattr(args, "max_position_embeddings", None)
        if n is None:
            text = getattr(args, "text_config", None)
            n = text.get("max_position_embeddings") if isinstance(text, dict) else None
        return int(n) if isinstance(n, int) and n > 0 else None

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size) if self.model_type.startswith("gemma") else 1.0

    def lm_head(self, h: mx.array) -> mx.array:
        if self._head is not None:
            return self._head(h)
        return self.embed_tokens.as_linear(h)

    # -- caches ---------------------------------------------------------------------------

    def make_cache(self) -> list[Any]:
        """A prompt cache every entry of which we can rewind; refuses targets we cannot."""
        cache = make_prompt_cache(self.model)
        if len(cache) != len(self.layers):
            raise BadCheckpoint(
                f"target {self.model_type!r} has {self.num_layers} layers but "
                f"{len(cache)} cache entries; speculative decoding needs one per layer"
            )
        for i, c in enumerate(cache):
            if isinstance(c, RotatingKVCache):
                # A rotating cache stops being trimmable once it wraps; a full cache with
                # the layer's own window mask computes the same attention.
                cache[i] = c = KVCache()
            if not (isinstance(c, ArraysCache) or c.is_trimmable()):
                raise BadCheckpoint(
                    f"target {self.model_type!r}: layer {i} uses {type(c).__name__}, which "
                    "can be neither trimmed nor replayed, so drafts could not be rewound"
                )
        self._rec.replay_ids = frozenset(
            i for i, c in enumerate(cache) if isinstance(c, ArraysCache)
        )
        return cache

    def forward(
        self, tokens: mx.array, cache: list[Any], capture_ids: list[int] | None
    ) -> tuple[mx.array, mx.array | None]:
        """Logits `(1, n, V)` and features `(1, n, len(capture_ids) * D)` (or None)."""
        rec = self._rec
        rec.clear()
        rec.capture_ids = frozenset(capture_ids or ())
        if self.first_layer is not None:  # a pipeline shard: its own layers' indices
            rec.capture_ids = frozenset(i - self.first_layer for i in capture_ids or ())
        token = _ACTIVE.set(rec)
        try:
            logits = self.model(tokens, cache=cache)
        finally:
            _ACTIVE.reset(token)
        feats = None
        if capture_ids and self.first_layer is not None:  # each rank's layers, summed over
            logits, feats = distributed.pipeline_features(rec.outputs, capture_ids, self, logits)
        elif capture_ids:
            feats = mx.concatenate([rec.outputs[i] for i in capture_ids], axis=-1)
        return logits, feats

    # -- trees (SPEC 7) -----------------------------------------------------------------------

    def tree_support(self, cache: list[Any]) -> str | None:
        """None when this target can verify a tree in one pass with `cache`, else why not
        (then the engine verifies chains)."""
        if self.recurrent:
            return "recurrent layers (their state steps token by token, not along a tree)"
        if any(not isinstance(c, (KVCache, QuantizedKVCache)) for c in cache):
            return "a cache whose rows cannot be gathered"
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None)
            rope = getattr(attn, "rope", None)
            if rope is None:
                return f"layer {i} has no rotary embedding the engine can position"
            if not isinstance(rope, _TreeRoPE):
                attn.rope = _TreeRoPE(rope)
        return None

    def forward_tree(
        self,
        tokens: mx.array,
        cache: list[Any],
        mask: mx.array,
        depths: mx.array,
        capture_ids: list[int] | None,
    ) -> tuple[mx.array, mx.array | None]:
        """`forward` over a tree's nodes (`tree_support` first): each node attends as `mask`
        says, at position `cache offset + depth`."""
        rec = self._rec
        rec.tree_mask, rec.tree_depths = mask, depths
        try:
            return self.forward(tokens, cache, capture_ids)
        finally:
            rec.tree_mask, rec.tree_depths = None, None

    @property
    def replay_ids(self) -> frozenset[int]:
        """Layers whose cache is replayed rather than trimmed (known after make_cache)."""
        return self._rec.replay_ids

    @property
    def recurrent(self) -> bool:
        """Whether some layer's cache is replayed rather than trimmed (known after make_cache)."""
        return bool(self._rec.replay_ids)

    def restore(self, cache: list[Any], snapshot: dict[int, tuple]) -> None:
        """Put recurrent states back as `snapshot` saved them."""
        for i, saved in snapshot.items():
            cache[i].state = (list(saved[0]), *saved[1:])

    def snapshot(self, cache: list[Any]) -> dict[int, tuple]:
        """Recurrent states before a verify pass (array references: MLX arrays are values)."""
        return {i: (list(cache[i].cache), *cache[i].state[1:]) for i in self._rec.replay_ids}

    def recorded_calls(self) -> dict[int, tuple]:
        """The recurrent layers' inputs in the latest forward pass (kept by a cycle for its
        rewind, so that another request's pass in between cannot replace them)."""
        return dict(self._rec.calls)


class _TreeRoPE(nn.Module):
    """An attention layer's rotary embedding that, in a tree pass, puts each fed token at
    its row's cache offset plus its depth (siblings share a position): the layer's own
    embedding, with the tokens moved to the batch axis and one offset each. Otherwise
    unchanged. A batch's pass (`offset` `(B,)`, depths `(B, n)`) puts each row's tokens
    after its own offset."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        rec = _ACTIVE.get()
        depths = rec.tree_depths if rec is not None else None
        if depths is None:
            return self.inner(x, offset=offset)
        b, h, n, d = x.shape
        depths = depths.reshape(-1, n)  # one row of depths per sequence (or one for all)
        if isinstance(offset, mx.array) and offset.ndim == 1:
            offset = offset[:, None]
        positions = mx.broadcast_to(depths + offset, (b, n)).reshape(-1)
        xs = x.transpose(0, 2, 1, 3).reshape(b * n, h, 1, d)  # (B*N, H, 1, D): a token a row
        xs = self.inner(xs, offset=positions)
        return xs.reshape(b, n, h, d).transpose(0, 2, 1, 3)
