"""Bookkeeping beside the decode cycle (`batch.BatchDecoder`): where a reply ends at EOS,
the recurrent states kept for a prompt cache, MLX's buffer cache, a dormant draft's
context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from .prefill import Request

# MLX's buffer cache is cleared every this many generated tokens, as mlx-lm does: freed
# buffers of a long decode (growing caches, verify passes of every width) are returned.
CLEAR_CACHE_EVERY = 256


def cut_at_eos(new: list[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """The tokens up to the first EOS, and whether committed tokens followed it."""
    for j, t in enumerate(new):
        if t in eos_ids:
            return new[: j + 1], j + 1 < len(new)
    return new, False


def snapshot(req: Request, fed: int) -> None:
    """Recurrent targets with a prompt cache: their state after `fed` tokens, to resume at."""
    if req.keep_snapshots:
        req.latest_snapshot = (fed, req.target.snapshot(req.cache))


def clear_cache_every(generated: int, new: int) -> None:
    """Return MLX's cached buffers every `CLEAR_CACHE_EVERY` generated tokens."""
    if (generated + new) // CLEAR_CACHE_EVERY > generated // CLEAR_CACHE_EVERY:
        mx.clear_cache()


def follow_capture(req: Request, capture: bool, position: int) -> None:
    """Dormancy: while plain steps capture no features the draft's context stays behind
    (the prompt, say); when capture resumes, at the anchor's `position`, the skipped
    stretch becomes a gap (`DraftState.skip_to`: RoPE keeps the true distances).
    Features committed before the draft went dormant stay pending, unevaluated (a dormant
    prefill's deferred window, say), until capture resumes: they are fed then, before the
    gap, and computed by the catch-up of the probe they are for, or never. Fed as the draft
    went dormant, they were computed by the next evaluation of its context: at 1k tokens
    the first cycle of every request paid 21 ms for a window no probe read (0.96x forced
    plain on the stock wheel, 128 tokens)."""
    if not capture:
        req.stale = True
    elif req.stale:
        req.feed_draft()
        req.state.skip_to(position)
        req.stale = False
