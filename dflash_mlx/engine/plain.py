"""Plain passes chained on the device (`batch.BatchDecoder._plain_cycle`): the pass launched
before the cycle it belongs to (`Ahead`), and stretches of plain steps run within one
cycle, as mlx-lm's loop runs them: per token only the pass; the rest of a cycle's host
work (plan, learn, commit, reply) once a stretch, whose tokens go out together, as a
speculative cycle's do.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx

from .. import distributed
from . import batch_cycle as bc

if TYPE_CHECKING:
    from ..speed.port import Policy
    from .batch import BatchDecoder
    from .batch_cycle import Row

# A stretch runs at most this many tokens and seconds, so that a stream stays fine-grained
# (20 responses a second). Each stretch ends with a cycle's host work (commit, reply, plan:
# about 0.3 ms here), which a CPU backend pinned to one core cannot overlap with the next
# pass: at 25 ms that cost 1-3% of plain decoding against mlx-lm's loop, at 50 ms 0-1%.
STRETCH_TOKENS = 64
STRETCH_SECONDS = 0.05


class Ahead(NamedTuple):
    """A plain pass launched before the cycle it belongs to."""

    rows: list[Row]  # the rows it runs for, in the batch's order when launched
    top: mx.array  # each row's next token, on the device
    feats: mx.array | None  # the anchors' features (rows that capture for their draft)
    lps: list | None  # each row's logprobs, when one asks for them
    captures: list[bool]  # which rows' drafts get the features
    built: float  # seconds its launch took (charged to its own cycle, not the one before)


def stretches(dec: BatchDecoder, rows: list[Row], lps: list | None, policy: Policy | None) -> bool:
    """Whether `dec`'s plain cycle of `rows` may run on as a stretch (`stretch`): rows that
    decode with the target only, or whose width the `policy` plans, with no grammar (whose
    masks must see each token on the host), logprobs or recurrent snapshots to keep per
    token, none cancelled, nothing waiting, on one process (ranks would have to agree on
    where each stretch ends). Penalties follow each pass on the device; a stop string cuts
    the stretch's reply as it cuts a speculative cycle's."""
    if dec.waiting or distributed.current() is not None:
        return False
    if lps is not None and any(lp is not None for lp in lps):
        return False
    return all(
        (r.req.draft is None or (r.fixed is None and policy is not None))
        and (r.req.controls is None or r.req.controls.grammar is None)
        and not r.req.keep_snapshots
        and not r.cancelled
        for r in rows
    )


def stretch(
    dec: BatchDecoder, rows: list[Row], got: list[list[int]], policy: Policy | None
) -> None:
    """More plain steps of `rows` within `dec`'s cycle, appended to each row's tokens `got`
    (its cycle's own so far): each pass launched on the last one's device tokens before
    they are read (`dec._ahead`), and nothing else per token. A stretch ends at a row's EOS
    or budget, when a request arrives, a row is cancelled or `dec.interrupt` says so, and
    after `STRETCH_TOKENS` tokens or `STRETCH_SECONDS`.
    Rows whose width the `policy` plans run on while its last plan stands (`Plan.stands`
    plain steps, capturing as it said: each pass's features go to the drafts as it is
    read); then the stretch ends, so that the next plan is made on what its steps taught
    (a plan made inside it would not see them: the policy learns once a cycle). The pass
    launched last stays launched for the next cycle."""
    target = dec.pair.target
    cache = dec.cache if len(rows) > 1 else rows[0].req.cache
    coasts = any(r.req.draft is not None for r in rows)
    capture = all(c for r, c in zip(rows, dec._ahead.captures) if r.req.draft is not None)
    k = len(got[0])  # tokens each row has so far
    base = [r.generated for r in rows]  # the generated index of each row's first
    cap = min(STRETCH_TOKENS, *(r.options.max_tokens - g for r, g in zip(rows, base)))
    end = time.perf_counter() + STRETCH_SECONDS
    while (
        dec._ahead is not None
        and k < cap
        and not any(g[-1] in r.eos or r.cancelled for g, r in zip(got, rows))
        and not dec.waiting
        and time.perf_counter() < end
        and not (dec.interrupt is not None and dec.interrupt())
    ):
        ahead, nxt, caps = dec._ahead, None, [False] * len(rows)
        for b, r in enumerate(rows):
            if ahead.feats is not None and ahead.captures[b]:
                # Its anchor's features, committed before the next pass follows the capture
                # (`follow_capture`: a draft going dormant keeps them pending, before its gap).
                r.req.pending.append(ahead.feats[b : b + 1, :1])
            if r.req.controls is not None:  # penalties see its token in the next pass
                r.req.controls.commit(ahead.top[b : b + 1])
        at = [g + k for g in base]  # the generated index of what `ahead` computes
        if all(r.options.max_tokens - a >= 2 for r, a in zip(rows, at)):
            # The last plan stands, capture included; when it no longer does, the stretch
            # ends: the next cycle plans on what these steps taught (`learn` first).
            go = not coasts or dec._stands > 0
            if go and coasts:
                dec._stands -= 1
                caps = [r.req.draft is not None and capture for r in rows]
            if go:
                launch = dec._now()
                nxt = bc.plain_pass(target, rows, ahead.top, cache, caps, at)
                dec._emit_plain(rows, k + 1)
                built = dec._now() - launch
        for g, t in zip(got, ahead.top.tolist()):
            g.append(t)
        k += 1
        dec._ahead = Ahead(rows, *nxt, caps, built) if nxt is not None else None


def launch_first(dec: BatchDecoder, row: Row) -> None:
    """A request alone in `dec`, its first token just committed: the cycle after it planned,
    and when that cycle is a plain pass, launched on the token before it is handed out
    (`dec._ahead`), as mlx-lm's loop launches its next step before it yields a token. The
    decode then starts with a pass in flight, not with its launch. Launched before the
    token was read, the pass delayed it on a CPU (one core runs both: TTFT 1.04x mlx-lm's
    at 128-token prompts, 0.89x without it; 1.02x launched after). Where the first cycle
    speculates, its plan is kept for it (`dec._planned`)."""
    if distributed.current() is not None or row.req.keep_snapshots or row.cancelled:
        return
    if row.options.max_tokens < 2:
        return
    rows = [row]
    widths, caps, made = dec._plan(rows, dec._policy(rows))  # as the first cycle plans
    target = dec.pair.target
    if bc.plain(target, rows, widths):
        launch = dec._now()
        nxt = bc.plain_pass(target, rows, row.anchor, row.req.cache, caps, [0])
        dec._emit_plain(rows)
        dec._ahead = Ahead(rows, *nxt, caps, dec._now() - launch)
    else:
        dec._planned = ([id(row)], (widths, caps, made))
