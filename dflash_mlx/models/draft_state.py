"""What one request keeps of a draft, and the draft's view of its target.

`DraftState` is a request's context (projected K/V of committed target features in one
`ContextCache` per layer, skipped positions, the DFlash 2 conv rows) and carries the
`TargetHead` of the `Pair` that made it: the target's embedding and LM head the draft
borrows. The draft model itself (`draft.py`) keeps only weights.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .conv import ConvRows


class TargetHead:
    """The draft's view of one target: its token embedding (scaled as the draft expects) and
    its LM head, borrowed, never part of the draft's parameters. Copies of a request's state
    share it (the target's weights are never copied)."""

    def __init__(
        self,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        scale: float = 1.0,
    ):
        self.embed_tokens = embed
        self.lm_head = lm_head
        self.scale = scale

    def embed(self, ids: mx.array) -> mx.array:
        x = self.embed_tokens(ids)
        return x if self.scale == 1.0 else x * self.scale

    def __deepcopy__(self, memo: dict) -> TargetHead:
        return self


# A windowed context keeps up to this many rows beyond its window before it drops the
# oldest ones, so that they are copied out once every so many cycles, not every cycle.
FORGET_SLACK = 256


class ContextCache(KVCache):
    """The draft's context cache at inference. `gap` target positions were skipped between
    its rows (decoded without capturing their features) or dropped in front of them (a
    window), so the next row's RoPE position is `offset + gap`: RoPE is relative, and the
    rows keep their true distances. `window`: the block sees at most its last `window - 1`
    rows (None: all; a sliding layer's own window applies as well), and under a window its
    first `sink` rows as well (an attention sink: the context's first positions)."""

    def __init__(self, window: int | None = None, sink: int = 0) -> None:
        super().__init__()
        self.gap = 0
        self.window = window
        self.sink = sink

    def forget(self, rows: int, at: int = 0) -> None:
        """Drop `rows` rows from row `at` on."""
        end = self.offset
        if at == 0:
            self.keys = self.keys[..., rows:end, :]
            self.values = self.values[..., rows:end, :]
        else:
            cut = (slice(None), slice(None))
            self.keys = mx.concatenate(
                [self.keys[(*cut, slice(0, at))], self.keys[(*cut, slice(at + rows, end))]], axis=2
            )
            self.values = mx.concatenate(
                [self.values[(*cut, slice(0, at))], self.values[(*cut, slice(at + rows, end))]],
                axis=2,
            )
        self.offset -= rows

    def visible(self, window: int | None) -> tuple[mx.array, mx.array]:
        """The rows a block sees under `window` (None: all): the first `sink` rows and the
        last `window - 1`, in order, at their true positions."""
        keys, values = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        if window is None or self.offset <= self.sink + window - 1:
            return keys, values
        tail = slice(self.offset - (window - 1), self.offset)
        if not self.sink:
            return keys[..., tail, :], values[..., tail, :]
        head = slice(0, self.sink)
        return (
            mx.concatenate([keys[..., head, :], keys[..., tail, :]], axis=2),
            mx.concatenate([values[..., head, :], values[..., tail, :]], axis=2),
        )

    @property
    def position(self) -> int:
        return self.offset + self.gap


class DraftState:
    """One request's state of a draft, passed in as mlx-lm models receive their `cache`.

    Holds the context cache of every layer (projected K/V of committed target features),
    `base` (the target position of the first row), `gaps` (`(row, positions)`: target
    positions skipped just before context row `row`, see `skip_to`) and the DFlash 2 conv
    rows. The draft itself keeps only weights, so one loaded draft serves any number of
    requests, each with its own `DraftState` (`DFlashDraft.make_state`).

    `windows`: per layer, how many positions a block sees (the anchor and `window - 1`
    context rows; None: all). When every layer has one, rows older than the widest are
    dropped (at most `FORGET_SLACK` rows late): memory stays bounded on long contexts.
    `sink`: under a window, the context's first `sink` rows are kept and seen as well (an
    attention sink; the rows dropped are those between it and the window).
    """

    def __init__(
        self,
        layers: int,
        convs: int,
        base: int = 0,
        windows: list[int | None] | None = None,
        head: TargetHead | None = None,
        sink: int = 0,
    ):
        self.head = head  # the target's embedding and head, as this request's pair sees them
        self.caches = [ContextCache() for _ in range(layers)]
        self.conv = [ConvRows() for _ in range(convs)]
        self.base = self.origin = base  # origin: the target position of RoPE position 0
        self.gaps: list[tuple[int, int]] = []
        self.set_windows(windows or [None] * layers, sink)

    def set_windows(self, windows: list[int | None], sink: int | None = None) -> None:
        """Each layer's window and the sink (see the class; None: as it was); a sink only
        matters under a window, so without one it is 0."""
        self.keep = None if None in windows or not windows else max(windows) - 1
        if sink is None:
            sink = getattr(self, "sink", 0)
        self.sink = sink if self.keep is not None else 0
        for c, w in zip(self.caches, windows, strict=True):
            c.window = w
            c.sink = self.sink if w is not None else 0

    @property
    def windows(self) -> list[int | None]:
        return [c.window for c in self.caches]

    @property
    def context_length(self) -> int:
        """Rows in the context cache (from target position `base`, see `gaps`)."""
        return self.caches[0].offset if self.caches else 0

    @property
    def context_end(self) -> int:
        """The target position the next context row stands for."""
        return self.base + self.context_length + sum(g for _, g in self.gaps)

    @property
    def arrays(self) -> list[mx.array]:
        """The context cache's arrays (to evaluate between prefill chunks)."""
        return [a for c in self.caches if c.keys is not None for a in (c.keys, c.values)]

    def _set_gap(self) -> None:
        total = self.base - self.origin + sum(g for _, g in self.gaps)
        for c in self.caches:
            c.gap = total

    def forget(self) -> None:
        """Drop the rows no window reaches any more (see `windows`); under a sink, those
        between it and the window: the positions they stood for become a gap after it."""
        rows, s = self.context_length, self.sink
        if self.keep is None or rows <= s + self.keep + FORGET_SLACK:
            return
        k = rows - s - self.keep
        if s:
            hole = k + sum(g for r, g in self.gaps if s <= r <= s + k)
            gaps = [(r, g) for r, g in self.gaps if r < s] + [(s, hole)]
            self.gaps = gaps + [(r - k, g) for r, g in self.gaps if r > s + k]
        else:
            self.base += k + sum(g for r, g in self.gaps if r <= k)
            self.gaps = [(r - k, g) for r, g in self.gaps if r > k]
        for c in self.caches:
            c.forget(k, at=s)
        self._set_gap()

    def sink_end(self, start: int, cut: int) -> int:
        """Where a prefill from `start` that skips to `cut` must capture up to first, so that
        the sink gets its rows: the context's first positions (`start` when there is no sink,
        it is full, or the context does not begin at `start`)."""
        if not self.sink or self.gaps or self.context_end != start:
            return start
        return min(cut, start + max(0, self.sink - self.context_length))

    def skip_to(self, position: int) -> None:
        """Positions from `context_end` up to `position` will have no row (their features
        were not captured); the next row added stands for `position`."""
        end = self.context_end
        if position < end:
            raise ValueError(f"cannot skip back from position {end} to {position}")
        if position == end:
            return
        rows = self.context_length
        if self.gaps and self.gaps[-1][0] == rows:
            self.gaps[-1] = (rows, self.gaps[-1][1] + position - end)
        else:
            self.gaps.append((rows, position - end))
        self._set_gap()

    def trim_to(self, position: int) -> None:
        """Drop rows and gaps so that the context ends at target position `position`."""
        end = self.context_end
        while end > position and end > self.base:
            rows = self.context_length
            if self.gaps and self.gaps[-1][0] == rows:  # a gap is the last thing
                row, skipped = self.gaps.pop()
                cut = min(skipped, end - position)
                if skipped > cut:
                    self.gaps.append((row, skipped - cut))
            else:
                cut = min(rows - (self.gaps[-1][0] if self.gaps else 0), end - position)
                for c in self.caches:
                    c.trim(cut)
            end -= cut
        self._set_gap()
        if position < self.base:
            self.__init__(
                len(self.caches), len(self.conv), position, self.windows, self.head, self.sink
            )
        elif position > end:
            self.skip_to(position)

    def commit(self, accepted: int | None) -> None:
        """After a verify: `accepted` drafts were kept (None: no draft pass this cycle)."""
        for rows in self.conv:
            rows.commit(accepted)
