"""What a prompt-store block read from disk must be before it is used: the claims its file
makes (model, previous block, first position, tokens) against what the request expects,
and its layers against the layout this target's own cache has (layer count and kinds, each
array's shape and dtype). A forged or mismatched block is refused, never used."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

if TYPE_CHECKING:
    from ...models.target import TargetAdapter


def tokens_text(tokens: list[int]) -> str:
    """A block's tokens as its file records them."""
    return ",".join(str(int(t)) for t in tokens)


def arrays(c: Any) -> list[mx.array]:
    """The arrays one layer's cache holds (KV or recurrent)."""
    held = (c.keys, c.values) if isinstance(c, KVCache) else c.cache
    return [a for a in held if a is not None]


def block_problem(
    layers: list[Any],
    meta: dict,
    claims: dict,
    tokens: list[int],
    fresh: list[Any],
    expected: list[Any],
    block: int,
) -> str | None:
    """Why a block read from disk cannot serve this request, or None. `claims`: the model
    fingerprint, the previous block's key (`parent`) and first position (`start`) the
    request expects; `tokens` its tokens; `fresh` the request's own cache (its kinds);
    `expected` the target's `cache_layout`; `block` the store's block size."""
    if meta.get("model") != claims["model"]:
        return "it was computed by another model"
    if meta.get("parent") != claims["parent"] or meta.get("start") != str(claims["start"]):
        return "it extends another prefix (its previous block or position differ)"
    if meta.get("tokens") != tokens_text(tokens):
        return "it holds other tokens than its key's"
    if len(layers) != len(fresh) or any(
        isinstance(c, KVCache) != isinstance(f, KVCache) for c, f in zip(layers, fresh)
    ):
        return "its layers do not match the target's"
    snapshot = meta.get("snapshot") == "1"
    for i, (c, want) in enumerate(zip(layers, expected)):
        if isinstance(c, KVCache):
            problem = _kv_problem(i, c, want, block)
        else:
            problem = _state_problem(i, c, want, snapshot)
        if problem is not None:
            return problem
    return None


def _kv_problem(i: int, c: KVCache, want: Any, block: int) -> str | None:
    (kshape, kdtype), (vshape, vdtype) = want
    keys = (kshape[0], kshape[1], block, kshape[3])
    values = (vshape[0], vshape[1], block, vshape[3])
    if c.offset != block or c.keys is None or c.values is None:
        return f"layer {i} holds {c.offset} positions, not {block}"
    got = ((tuple(c.keys.shape), c.keys.dtype), (tuple(c.values.shape), c.values.dtype))
    if got != ((keys, kdtype), (values, vdtype)):
        return (
            f"layer {i}'s keys/values are {got[0][0]} {got[0][1]} / {got[1][0]} {got[1][1]}, "
            f"not {keys} {kdtype} / {values} {vdtype}"
        )
    return None


def _state_problem(i: int, c: Any, want: Any, snapshot: bool) -> str | None:
    if len(c.cache) != len(want):
        return f"layer {i} holds {len(c.cache)} states, not {len(want)}"
    for a, shape_dtype in zip(c.cache, want):
        if a is None:
            if snapshot:
                return f"layer {i} lacks the recurrent state its block claims"
        elif shape_dtype is None or (tuple(a.shape), a.dtype) != shape_dtype:
            return f"layer {i}'s state is {tuple(a.shape)} {a.dtype}, not {shape_dtype}"
    return None


def cache_layout(target: TargetAdapter) -> list[Any]:
    """Each layer's arrays as this target's cache holds them after one token: a KV
    layer's (shape, dtype) of keys and of values, a recurrent layer's (shape, dtype) of
    each state (None where it holds none). One token's forward."""
    scratch = target.make_cache()
    target.model(mx.array([[0]]), cache=scratch)
    mx.eval([a for c in scratch for a in arrays(c)])
    layout: list[Any] = []
    for c in scratch:
        if isinstance(c, KVCache):
            layout.append(
                ((tuple(c.keys.shape), c.keys.dtype), (tuple(c.values.shape), c.values.dtype))
            )
        else:
            layout.append([None if a is None else (tuple(a.shape), a.dtype) for a in c.cache])
    return layout
