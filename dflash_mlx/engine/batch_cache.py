"""The target's caches for a batch of requests (SPEC 8): each row its own length and rewind.

mlx-lm's `BatchKVCache` keeps the rows right-aligned (left padding), so rows that accept
different numbers of drafts would have to be shifted (`dynamic_roll`: the whole cache
copied) every cycle. `RowsKVCache` keeps the rows left-aligned instead, each with its own
length: a pass writes each row's tokens at that row's end (one scatter), the mask lets a
row see its own positions only, and a rewind is a per-row length change (nothing moves).
mlx-lm's models take it as they take `BatchKVCache` (an array `offset` for the rotary
embedding, `make_mask` for the attention). Recurrent layers keep mlx-lm's `ArraysCache`
with a batch axis; a per-row rewind replays each row over its own accepted prefix in one
call (`ArraysCache.lengths` and the layer's padding mask). Rows join and leave between
cycles: only those copy the cache. As mlx-lm's batch caches do, each batched cache kind
owns its batch operations (`merge`, `extend`, `extract`, `filter`; `trim_rows` for a
per-row rewind), so the functions here are loops over layers with no switch on cache kinds:
`BATCHED` says which kind holds a batch of each single-request kind.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, _BaseCache

from ..errors import BadArgument

STEP = 256  # positions a row's storage grows by


class RowsKVCache(_BaseCache):
    """One attention layer's keys and values for a batch: `(B, heads, capacity, dim)`, row
    `b` holding `lengths[b]` positions."""

    def __init__(self, keys: mx.array, values: mx.array, lengths: list[int]):
        self.keys, self.values = keys, values
        self.lengths = list(lengths)
        self.offset = mx.array(self.lengths)  # each row's next position (the RoPE offset)

    @classmethod
    def merge(cls, caches: list[KVCache]) -> RowsKVCache:
        """The rows of single-request caches, copied into one batch."""
        lengths = [c.offset for c in caches]
        cap = -(-max(max(lengths), 1) // STEP) * STEP
        keys, values = [], []
        for c in caches:
            if c.keys is not None:
                k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            else:
                k, v = _empty_like(caches)
            pad = [(0, 0), (0, 0), (0, cap - k.shape[2]), (0, 0)]
            keys.append(mx.pad(k, pad))
            values.append(mx.pad(v, pad))
        return cls(mx.concatenate(keys), mx.concatenate(values), lengths)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, n, _ = keys.shape
        end = max(self.lengths) + n
        if end > self.keys.shape[2]:
            grow = -(-(end - self.keys.shape[2]) // STEP) * STEP
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[..., start : start + n, :] = keys
            self.values[..., start : start + n, :] = values
        else:
            at = (self.offset[:, None] + mx.arange(n))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.lengths = [length + n for length in self.lengths]
        self.offset = self.offset + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """`(B, 1, n, max length + n)`: query `i` of row `b` (at position `lengths[b] + i`)
        sees that row's positions up to its own, nothing past them (another row's longer
        stretch, or this row's rewound positions)."""
        seen = mx.arange(max(self.lengths) + n)
        at = self.offset[:, None, None, None] + mx.arange(n)[:, None]
        mask = seen <= at
        if window_size is not None:
            mask = mask & (seen > at - window_size)
        return mask

    def trim_rows(self, drops: list[int]) -> None:
        """Forget the last `drops[b]` positions of each row `b`."""
        self.lengths = [length - d for length, d in zip(self.lengths, drops)]
        self.offset = mx.array(self.lengths)

    def move_paths(self, paths: list[list[int] | None], total: int) -> None:
        """After a pass of `total` tokens a row: the positions of the nodes on row `b`'s
        accepted tree path (`paths[b]`, node ids in pass order, root first) moved to the
        front of its block, in path order (None: a chain's, already in place). The rest is
        rewound after (`trim_rows`)."""
        if all(p is None or p == list(range(len(p))) for p in paths):
            return
        src, dst = [], []
        for length, path in zip(self.lengths, paths):
            start = length - total
            order = list(range(total)) if path is None else path + list(range(len(path), total))
            src.append([start + i for i in order])
            dst.append(list(range(start, start + total)))
        src_at, dst_at = mx.array(src)[:, None, :, None], mx.array(dst)[:, None, :, None]
        for name in ("keys", "values"):
            a = getattr(self, name)
            moved = mx.take_along_axis(a, src_at, axis=2)
            setattr(self, name, mx.put_along_axis(a, dst_at, moved, axis=2))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, *self.lengths)
        self.trim_rows([n] * len(self.lengths))
        return n

    def extract(self, b: int) -> KVCache:
        """Row `b` as a single request's cache (a copy)."""
        c = KVCache()
        n = self.lengths[b]
        c.keys = mx.contiguous(self.keys[b : b + 1, :, :n])
        c.values = mx.contiguous(self.values[b : b + 1, :, :n])
        c.offset = n
        return c

    def extend(self, other: KVCache) -> None:
        """A single request's cache added as the last row (the rows are copied)."""
        rows = [self.extract(b) for b in range(len(self.lengths))] + [other]
        merged = RowsKVCache.merge(rows)
        self.keys, self.values = merged.keys, merged.values
        self.lengths, self.offset = merged.lengths, merged.offset

    def filter(self, batch_indices: mx.array) -> None:
        """Keep only the rows `batch_indices`, in that order."""
        rows = batch_indices.tolist()
        lengths = [self.lengths[b] for b in rows]
        cap = -(-max(max(lengths), 1) // STEP) * STEP
        idx = mx.array(rows)
        self.keys, self.values = self.keys[idx, :, :cap], self.values[idx, :, :cap]
        self.lengths = lengths
        self.offset = mx.array(lengths)

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _empty_like(caches: list[KVCache]) -> tuple[mx.array, mx.array]:
    """Zero-length keys and values shaped as the other rows' (a row with no positions)."""
    ref = next(c for c in caches if c.keys is not None)
    return ref.keys[..., :0, :], ref.values[..., :0, :]


# The kind that holds a batch of each single-request cache kind (mlx-lm's `ArraysCache`
# holds its own batch).
BATCHED: dict[type, type] = {KVCache: RowsKVCache, ArraysCache: ArraysCache}


def batchable(cache: list[Any]) -> str | None:
    """None when a single request's `cache` can join a batch, else why not."""
    for i, c in enumerate(cache):
        if type(c) not in BATCHED:
            return f"layer {i} uses {type(c).__name__}, which a batch does not hold"
    return None


def row_lengths(c: Any) -> list[int]:
    """The positions each row of an attention layer's cache holds (one row alone: its
    `KVCache`'s)."""
    return list(c.lengths) if isinstance(c, RowsKVCache) else [c.offset]


def join(caches: list[list[Any]]) -> list[Any]:
    """One batch's caches from single requests' (layer by layer), rows in that order."""
    out = []
    for layer in zip(*caches):
        kind = BATCHED.get(type(layer[0]))
        if kind is None:
            raise BadArgument(f"a batch cannot hold a {type(layer[0]).__name__}")
        out.append(kind.merge(list(layer)))
    return out


def add_row(cache: list[Any], one: list[Any]) -> list[Any]:
    """A batch's caches with a single request's added as the last row."""
    for c, o in zip(cache, one):
        c.extend(o)
    return cache


def take_row(cache: list[Any], b: int) -> list[Any]:
    """Row `b` of a batch's caches as a single request's (copies)."""
    return [c.extract(b) for c in cache]


def keep_rows(cache: list[Any], rows: list[int]) -> None:
    """Only `rows` of the batch stay, in that order."""
    for c in cache:
        c.filter(mx.array(rows))


def keep(
    target: Any,
    cache: list[Any],
    keeps: list[int],
    total: int,
    saved: tuple[dict[int, tuple], dict[int, tuple]],
    paths: list[list[int] | None] | None = None,
) -> None:
    """After a pass of `total` tokens a row, keep the first `keeps[b]` of row `b` (SPEC 5.3,
    per row; one request alone is a batch of one): a tree's accepted path (`paths[b]`, node
    ids in pass order) first moved to the front of its block, then attention rows drop the
    rest, and recurrent layers go back to their snapshot and replay each row over its own
    first `keeps[b]` inputs (`replay_rows`). `saved`: the recurrent states before the pass
    and the pass's recorded inputs (`target.snapshot`, `target.recorded_calls`)."""
    if paths is not None and any(p is not None for p in paths):
        for c in cache:  # trees run on attention-only targets
            move_paths(c, paths, total)
    drops = [total - k for k in keeps]
    if not any(drops):
        return
    snapshot, calls = saved
    for i, c in enumerate(cache):
        if i not in snapshot:
            trim_rows(c, drops)
    if snapshot:
        replay_rows(target, cache, keeps, snapshot, calls)


def replay_rows(
    target: Any,
    cache: list[Any],
    keeps: list[int],
    snapshot: dict[int, tuple],
    calls: dict[int, tuple],
) -> None:
    """Recurrent layers back to `snapshot`, then each row replayed over its own first
    `keeps[b]` inputs of the pass (`calls`), all rows in one call (rows past their length
    are masked, and their state stops there)."""
    target.restore(cache, snapshot)
    most = max(keeps)
    if most == 0:
        return
    mask = mx.arange(most)[None] < mx.array(keeps)[:, None]
    for i in snapshot:
        c = cache[i]
        x, args, kwargs = calls[i]
        # The layer's padding mask (mlx-lm: `mask`, first after the input) becomes the
        # rows' lengths.
        if "mask" in kwargs:
            kwargs = {**kwargs, "mask": mask}
        elif args:
            args = (mask, *args[1:])
        else:
            kwargs = {**kwargs, "mask": mask}
        c.lengths = mx.array(keeps)  # its own: the layer subtracts from it in place
        try:
            layer = target.layers[i]
            type(layer).__mro__[1].__call__(layer, x[:, :most], *args, **kwargs)
        finally:
            c.lengths = None


def trim_rows(c: Any, drops: list[int]) -> None:
    """Row `b` of an attention layer's cache forgets its last `drops[b]` positions (a
    single request's cache: its one row)."""
    if isinstance(c, RowsKVCache):
        c.trim_rows(drops)
    else:
        (drop,) = drops
        c.trim(drop)


def move_paths(c: Any, paths: list[list[int] | None], total: int) -> None:
    """`RowsKVCache.move_paths` for any attention layer's cache (a single request's: its
    one row; a `QuantizedKVCache` stores its keys and values in parts)."""
    if isinstance(c, RowsKVCache):
        c.move_paths(paths, total)
        return
    (path,) = paths
    if path is None or path == list(range(len(path))):
        return
    rows = mx.array(path)
    start = c.offset - total
    end = start + len(path)
    parts = [*c.keys, *c.values] if isinstance(c.keys, (tuple, list)) else [c.keys, c.values]
    for a in parts:
        a[..., start:end, :] = a[..., start + rows, :]
