"""A request's state and its prefill (SPEC 1, 5.2).

`Request` is everything one request's decoding reads and changes (target cache, `DraftState`,
committed tokens; the models hold none of it). `resume` takes what a previous request left in
a `PromptCache` up to the longest common prefix; `prefill_prompt` feeds the rest of the prompt
in chunks, growing the draft's context only where a block will read it. The cycle that
follows is `batch.py`'s (the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..cache.prompt_cache import CachedState, common_prefix
from ..models.draft import DFlashDraft, DraftState
from ..models.target import TargetAdapter
from .sampling import PositionKeys, SamplingParams

if TYPE_CHECKING:
    from ..pair import Pair
    from .controls import Controls

PREFILL_STEP = 512
# A dormant prefill leaves the prompt window's features unevaluated; when this many positions
# or more of the chunk the window starts in lie before it, the chunk is split at the window
# so that a probe computes the captured layers over the window alone (one more target pass
# in prefill); with fewer, the window is not kept (a probe would compute those layers over
# the whole chunk): the draft's context starts at the prompt's last token.
SPLIT_BEFORE_WINDOW = 256


@dataclass
class Request:
    """Everything one request's decoding reads and changes."""

    pair: Pair
    draft: DFlashDraft | None  # None: this request decodes plainly (no draft pass)
    params: SamplingParams
    keys: PositionKeys
    prompt: list[int]
    cache: list  # the target's cache
    state: DraftState | None  # the draft's context and conv rows
    reused: int  # prompt positions the caches held when the request started
    ids: list[int] | None  # target layers the draft reads
    keep_snapshots: bool  # recurrent target with a prompt cache: keep states to resume at
    # Penalties, bias, grammar and logprobs (None: the request asks for none of them).
    controls: Controls | None = None
    # A seeded sampled request: its token at each position is the target's Gumbel-max draw
    # keyed by (seed, position), and drafts are accepted when they equal it (SPEC 4 as
    # `sampling.coupled_accept` states it), so its reply is one however it is decoded.
    coupled: bool = False
    # Speculative cycles verify trees (SPEC 7): always (True), never (False), or as a
    # `tree.ShapeChooser` picks; where asked for but impossible, `tree_note` says why.
    trees: Any = False
    tree_note: str | None = None
    generated: list[int] = field(default_factory=list)
    pending: list[mx.array] = field(default_factory=list)  # committed features not yet fed
    # Positions whose captured target layers are still to be computed (a dormant prefill's
    # deferred window, with the chunk it was taken from; MLX computes them when the draft's
    # context is next evaluated, fed or not): the next draft pass pays for them.
    lazy_rows: int = 0
    # The draft's context of the prompt's last chunk, left unevaluated so that the first
    # token does not wait for it: the first cycle after the admission (whose time is mixed
    # with the prefill's, never learnt from) evaluates it before anything else.
    lazy_context: bool = False
    # Whether the latest committed cycle was speculative (its features are fed by the next
    # draft pass as part of it); else the next speculative cycle catches up first.
    speculating: bool = False
    # The draft's context fell behind (dormant: plain steps capture no features).
    stale: bool = False
    # Recurrent states: before the prompt's last token, and after the latest cycle.
    prompt_snapshot: tuple[int, dict] | None = None
    latest_snapshot: tuple[int, dict] | None = None

    @property
    def target(self) -> TargetAdapter:
        return self.pair.target

    @property
    def pending_rows(self) -> int:
        """Context rows the draft has yet to take (what feeding it now projects)."""
        return sum(p.shape[1] for p in self.pending)

    def feed_draft(self) -> None:
        """Give the draft the features of committed positions it has not seen yet."""
        if self.pending:
            self.draft.add_context(mx.concatenate(self.pending, axis=1), self.state)
            self.pending.clear()

    def saved(self) -> CachedState:
        """The state as of the last committed cycle, for the next request to resume from
        (the caches may hold positions after it: they are trimmed on reuse)."""
        end = len(self.prompt) + len(self.generated) - 1
        return CachedState(
            owner=(self.pair.model, self.draft),
            tokens=self.prompt + self.generated,
            target_cache=self.cache,
            draft=self.state,
            pending=list(self.pending),
            draft_end=end if self.stale else None,
            snapshots=[s for s in (self.prompt_snapshot, self.latest_snapshot) if s],
        )


def open_request(
    pair: Any,
    draft: DFlashDraft | None,
    prompt: list[int],
    options: Any,
    seed: int,
    saved: CachedState | None,
    grammar: Any,
    cached: bool,
) -> Request:
    """One request's state, its caches resumed from `saved` (a `PromptCache`'s) where they
    hold a prefix of `prompt`: what a request alone and a batch's row both start from.
    `cached`: the request has a prompt cache (a recurrent target then keeps snapshots)."""
    from mlx_lm.generate import generation_stream

    from .controls import Controls

    with mx.stream(generation_stream):
        cache, state, start = resume(
            pair, draft, prompt, saved, options.draft_window, options.draft_sink
        )
    return Request(
        pair,
        draft,
        options.sampling,
        PositionKeys(seed),
        list(prompt),
        cache,
        state,
        start,
        draft.config.target_layer_ids if draft is not None else None,
        # Whether the target is recurrent is known once it made a cache (in `resume`).
        keep_snapshots=cached and pair.target.recurrent,
        controls=Controls.of(options, pair.target.logits_width, prompt, grammar),
        coupled=options.seed is not None and not options.sampling.greedy,
    )


def resume(
    pair: Pair,
    draft: DFlashDraft | None,
    prompt: list[int],
    saved: CachedState | None,
    window: int | None = None,
    sink: int | None = None,
) -> tuple[list, DraftState | None, int]:
    """The target cache and draft state holding the first `start` prompt positions, and
    `start` (0: fresh ones), from what a previous request left in a `PromptCache`, or from
    its `PromptStore` when that holds a longer prefix of `prompt`; the draft state (None
    when `draft` is) sees `window` positions and `sink` (see `DFlashDraft.make_state`)."""
    link = saved.link if saved is not None else None
    if saved is not None and not saved.tokens:  # a store's placeholder: nothing of its own
        saved = None
    cache, state, start = None, None, 0
    if link is not None:
        fresh = pair.target.make_cache()
        start = link.restore(pair, prompt, fresh, _reach(pair, prompt, saved))
        if start:
            cache = fresh
            state = pair.draft_state(window, sink=sink) if draft is not None else None
            if state is not None:
                # No rows for the stored prefix: the draft's context starts where the
                # prefill does (measured: its tau barely changes, see docs/server.md).
                state.skip_to(start)
    if cache is None:
        cache, state, start = _resume(pair, draft, prompt, saved, window, sink)
    if link is not None:
        link.started(pair.target, prompt, cache, start)
    return cache, state, start


def _reach(pair: Pair, prompt: list[int], saved: CachedState | None) -> int:
    """At most how many prompt positions `_resume` could take from `saved`."""
    if saved is None:
        return 0
    start = min(common_prefix(saved.tokens[: len(saved.tokens) - 1], prompt), len(prompt) - 1)
    if pair.target.recurrent:
        return max((n for n, _ in saved.snapshots if n <= start), default=0)
    return start


def _resume(
    pair: Pair,
    draft: DFlashDraft | None,
    prompt: list[int],
    saved: CachedState | None,
    window: int | None,
    sink: int | None = None,
) -> tuple[list, DraftState | None, int]:
    """`resume` from the conversation's own cached state."""
    target = pair.target
    fresh = target.make_cache()
    new_state = pair.draft_state(window, sink=sink) if draft is not None else None
    if saved is None:
        return fresh, new_state, 0
    # Positions of all but the last known token are committed; one prompt token must be
    # left to prefill, for the logits of the first new token.
    start = min(common_prefix(saved.tokens[: len(saved.tokens) - 1], prompt), len(prompt) - 1)
    state = saved.draft
    if draft is not None:
        if saved.pending:
            draft.add_context(mx.concatenate(saved.pending, axis=1), state)
        if saved.draft_end is not None:
            # Nothing of the dormant stretch was captured: a gap up to the committed end.
            state.skip_to(saved.draft_end)
        state.commit(None)  # a new chain of blocks: no cross-block conv row
        start = min(start, state.context_end)
    cache = saved.target_cache
    if target.recurrent:
        usable = [(n, snap) for n, snap in saved.snapshots if n <= start]
        if not usable:
            return fresh, new_state, 0
        start, snap = max(usable, key=lambda x: x[0])
        target.restore(cache, snap)
    for i, c in enumerate(cache):
        if i not in target.replay_ids:
            c.trim(c.offset - start)
    if draft is not None:
        state.set_windows(draft.windows(window), draft.context_sink(sink))
        state.trim_to(start)
    return cache, state, start


def prefill(
    req: Request,
    lo: int,
    hi: int,
    step: int,
    progress: Callable[[int, int], None] | None,
    capture_from: int | None = None,
    defer: bool = False,
) -> mx.array | None:
    """Feed prompt[lo:hi] in chunks; the draft's context grows chunk by chunk, from
    position `capture_from` on (default `lo`): a chunk wholly before it takes no target
    features, one across it keeps the features from it on. With `defer` the features are
    kept unevaluated in `req.pending` instead: MLX computes them (and whatever target layers
    only they need) when a probe feeds the draft, or never. The context of the chunk that
    ends at the prompt's last token but one is left unevaluated (`Request.lazy_context`)."""
    total = len(req.prompt)
    start = lo if capture_from is None else capture_from
    tokens = mx.array(req.prompt[lo:hi], dtype=mx.int32)[None]
    logits, done = None, lo
    while done < hi:
        n = min(step, hi - done)
        ids = req.ids if done + n > start else None
        logits, feats = req.target.forward(tokens[:, done - lo : done - lo + n], req.cache, ids)
        if req.draft is not None and feats is not None:
            if start > done:
                feats = feats[:, start - done :]
            if defer:
                req.pending.append(feats)
                req.lazy_rows += n  # the captured layers run over the whole chunk
            else:
                req.draft.add_context(feats, req.state)
        done += n
        if done < total:
            arrays = [c.state for c in req.cache]
            if req.state is not None and done < total - 1:
                arrays += req.state.arrays
            elif req.state is not None:  # see `Request.lazy_context`
                req.lazy_context = True
            mx.eval(arrays)
            mx.clear_cache()
            if progress is not None:
                progress(done, total)
    return logits


def prefill_prompt(
    req: Request,
    step: int,
    progress: Callable[[int, int], None] | None,
    window: int | None = None,
) -> mx.array:
    """The prompt from where the reused caches end; logits of its last token.

    With a `window` (the width policy plans a plain first cycle: the draft is dormant), the
    draft's context gets only the prompt's last `window` positions (what a probe soon after
    reads; the rest
    is a gap, as in a dormant stretch), and even those are left unevaluated until a probe
    feeds them: prefill then costs what the target alone costs. The chunk the window starts
    in is split at it when `SPLIT_BEFORE_WINDOW` positions or more precede it there (a probe
    then computes the captured layers over the window alone); else the window is not kept,
    only the prompt's last token (the first probe would compute those layers over the whole
    chunk, which cost more than the probe itself on short prompts).
    Under a draft window, the positions no block will see are skipped the same way."""
    total = len(req.prompt)
    cut = req.reused
    dormant = False
    if req.draft is not None:
        if req.state.keep is not None:
            cut = max(cut, total - req.state.keep)
        if window is not None:
            cut = max(cut, total - 1 - window)
            dormant = True
    if dormant and (cut - req.reused) % step < SPLIT_BEFORE_WINDOW:
        # The window cannot be split off its chunk cheaply, and left in it, its features
        # would cost the captured layers over the whole chunk at the first probe: the
        # draft's context starts at the prompt's last token instead.
        cut = max(cut, total - 1)
    lo = req.reused
    if cut > lo:
        # A sink's rows (the context's first positions) are captured before the skip.
        lo = req.state.sink_end(lo, cut)
        prefill(req, req.reused, lo, step, progress)
        req.state.skip_to(cut)
    # All but the last token first, as mlx-lm does: only their caches are evaluated, so
    # the LM head never runs over the prompt (vocabulary x prompt logits).
    if dormant:
        prefill(req, lo, cut, step, progress, capture_from=cut)
        prefill(req, cut, total - 1, step, progress, defer=True)
    else:
        # Split at the cut: the target's layers the draft reads run only where it reads.
        prefill(req, lo, cut, step, progress, capture_from=cut)
        prefill(req, cut, total - 1, step, progress)
    if req.keep_snapshots:
        # Recurrent state cannot be trimmed later: keep it as it is before the last token.
        req.prompt_snapshot = (total - 1, req.target.snapshot(req.cache))
    logits = prefill(req, total - 1, total, step, progress, defer=dormant)
    if progress is not None:
        progress(total, total)
    return logits
