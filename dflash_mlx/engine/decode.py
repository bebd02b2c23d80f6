"""The decode cycle (SPEC 1), in token ids:

    prefill -> (choose -> draft -> verify -> accept -> commit)*

`speculative_decode` is that loop and each step is one small function below, all of them
working on the request's own state (`prefill.Request`: target cache, `DraftState`, committed
tokens); the models hold none of it, and the `Pair` holds what belongs to the pairing. The
prefill (and resuming from a `PromptCache`) is `prefill.py`'s; the draft's proposals under
penalties or a grammar are `walks.py`'s, a tree cycle's steps `tree.py`'s. Bookkeeping sits
beside the cycle, not inside it (`bookkeeping.py`): `Clock` charges each cycle its wall time
for the width chooser, `follow_capture` moves a dormant draft's context; `resume` and
`Request.saved` exchange state with a `PromptCache`.
Yields one `Cycle` per verify pass with the tokens it commits. Knows nothing about text,
stop strings or statistics: `generate.py` does that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from ..cache.prompt_cache import PromptCache
from ..options import GenerateOptions
from ..pair import Pair
from ..speed.adaptive import WidthChooser
from .bookkeeping import Clock, clear_cache_every, cut_at_eos, follow_capture, snapshot
from .controls import Grammar, TokenLogprob, read_logprobs
from .prefill import Request, open_request, prefill_prompt
from .sampling import (
    PositionKeys,
    coupled_accept,
    greedy_accept,
    probabilities,
    rejection_accept,
    sample,
)
from .tree import ShapeChooser, read_tree, tree_mode, verify_tree
from .walks import make_drafts


@dataclass
class Cycle:
    """What one step of the decoder committed."""

    tokens: list[int]  # emitted tokens, in order (drafts accepted, then the target's own)
    accepted: int  # drafted tokens accepted (n); tau of this cycle = accepted + 1
    width: int  # verify width W of this cycle (0 for the token sampled after prefill)
    reused: int = 0  # prompt tokens taken from a PromptCache instead of prefilled (first only)
    logprobs: list[TokenLogprob] | None = None  # with `options.logprobs`: one per token
    tree: bool = False  # a tree of `width` tokens was verified (SPEC 7), not a chain
    tree_note: str | None = None  # (first only) trees were asked for, chains run: why
    batch: int = 0  # rows in the verify pass that ran this cycle (0: decoded alone)


class _Step(NamedTuple):
    """One launched cycle, until its result reaches the host."""

    n: mx.array  # drafted tokens accepted
    out: mx.array  # tokens to emit (accepted drafts, then the target's own)
    feats: mx.array | None  # target features of the fed positions (None: not captured)
    saved: tuple[dict, dict]  # recurrent states before the pass, and its inputs (to rewind)
    width: int
    built: float  # seconds its launch took on the host
    chained: bool  # launched before the previous cycle's result reached the host
    logprobs: tuple[mx.array, ...] | None = None  # `Controls.logprobs` of the verified rows
    # A tree cycle's (tokens, parents, depths), on the device: `out` is then the target's
    # argmax (or its distribution) at each node.
    tree: tuple[mx.array, mx.array, mx.array] | None = None
    path: list[int] | None = None  # a tree cycle's accepted nodes, once `result` read them


def speculative_decode(
    pair: Pair,
    prompt: list[int],
    options: GenerateOptions,
    *,
    width: int | None = None,
    draft_block: int | None = None,
    chooser: WidthChooser | None = None,
    seed: int | None = None,
    eos_ids: frozenset[int] = frozenset(),
    learn_costs: bool = True,
    progress: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
    speculate: bool = True,
    grammar: Grammar | None = None,
) -> Iterator[Cycle]:
    """Decode up to `options.max_tokens` tokens after `prompt` with `pair`, yielding each
    committed cycle (`speculate=False`, or a pair without a draft: the target alone).

    The request's `options` arrive here unchanged. `width` is the verify width W (1 = plain
    decoding, no draft pass) and `draft_block` the rows L >= W the draft runs; with a
    `chooser`, (W, L) are chosen each cycle instead, and it learns acceptance from every
    verify and, with `learn_costs`, the wall time of every cycle (default: `pair.plan`).
    Random draws follow `seed` (default: `options.seed`, else 0) and the generated position
    (SPEC 4). Stops after EOS or `max_tokens`. With a `prompt_cache`, the state of its
    previous request is reused from the longest common prefix on; this request's state is
    committed back when it ends or is closed between cycles, and not at all when it fails.
    `options.draft_window` bounds the positions a draft block sees (`make_state`).
    Penalties, a logit bias and a `grammar` (compiled by `controls.compile_grammar` for
    `options`' constraint) process the target's logits at every verified position, and the
    draft's proposals (`controls.Controls`); `options.logprobs` reports log-probabilities.
    """
    if width is None:
        width, draft_block, chooser = pair.plan(options)
    assert 1 <= width and (options.tree or width <= max(draft_block, 1))
    seed = seed if seed is not None else options.seed if options.seed is not None else 0
    # Plain decoding throughout (W = 1 fixed): the draft would never run, so nothing is
    # built for it.
    draft = pair.draft if speculate and (width > 1 or chooser is not None) else None
    lease, saved = (0, None) if prompt_cache is None else prompt_cache.take(pair.model, draft)
    cached = prompt_cache is not None
    req = open_request(pair, draft, prompt, options, seed, saved, grammar, cached)
    req.trees = tree_mode(req, options, chooser, learn_costs)
    if chooser is not None:
        chooser.begin_request()
    try:
        with mx.stream(generation_stream):
            logits = prefill_prompt(req, options.prefill_step, progress, chooser)
        yield from _cycles(
            req,
            logits,
            max_tokens=options.max_tokens,
            width=width,
            draft_block=draft_block,
            eos_ids=eos_ids,
            chooser=chooser,
            clock=Clock(chooser if learn_costs else None),
            learn_costs=learn_costs,
        )
    except GeneratorExit:  # closed between two cycles: every committed position is known
        if prompt_cache is not None:
            prompt_cache.commit(lease, req.saved())
        raise
    if prompt_cache is not None:
        prompt_cache.commit(lease, req.saved())


def _cycles(
    req: Request,
    logits: mx.array,
    *,
    max_tokens: int,
    width: int,
    draft_block: int,
    eos_ids: frozenset[int],
    chooser: WidthChooser | None,
    clock: Clock,
    learn_costs: bool = True,
) -> Iterator[Cycle]:
    """The cycles after prefill. The next cycle is always launched before the current one
    is handed to the caller, so detokenizing and rendering overlap with device work."""
    n_prompt = len(req.prompt)
    grammar = req.controls.grammar if req.controls is not None else None
    # A plain step is chained on the device token of the one before it, unless a grammar's
    # masks must first see that token on the host.
    chain = grammar is None
    # Nothing to commit after a plain step but the token: no draft, no controls, no
    # recurrent snapshots (the step then costs what mlx-lm's does).
    lean = req.draft is None and req.controls is None and not req.keep_snapshots

    def launch(anchor: mx.array, a: int, chained: bool) -> _Step:
        """choose -> draft -> verify -> accept for the anchor at generated index `a`, started
        on the device (`chained`: before the previous cycle's result reached the host)."""
        tic = time.perf_counter()
        # What a speculative cycle would first have to catch the draft's context up on.
        behind = (
            (0, 0) if req.draft is None or req.speculating else (req.pending_rows, req.lazy_rows)
        )
        w, rows, capture = choose(
            chooser, width, draft_block, max_tokens - a - 1, n_prompt + a, behind
        )
        with mx.stream(generation_stream):
            if req.draft is not None:
                follow_capture(req, capture, n_prompt + a)
                if w > 1 and any(behind):
                    # Catching up on the positions decoded plainly (and a dormant prefill's
                    # window) is paid once, when speculation resumes: run it apart, so it
                    # is not taken for what every cycle of this width costs, and charge it
                    # to the catch-up, which the chooser prices probes with.
                    req.feed_draft()
                    mx.eval(req.state.arrays)
                    req.lazy_rows = 0
                    if chooser is not None and learn_costs:
                        chooser.observe_context(*behind, time.perf_counter() - tic)
                    tic = time.perf_counter()
            if w >= 3 and (req.trees is True or (req.trees and req.trees.tree_next())):
                out, feats, shape = verify_tree(req, anchor, w, rows, capture)
                built = time.perf_counter() - tic
                size = shape[0].size
                return _Step(None, out, feats, ({}, {}), size, built, chained, None, shape, [])
            if w == 1:
                out, feats, lp = plain_step(req, anchor, a, capture)
                mx.async_eval(out, *(lp or ()))
                built = time.perf_counter() - tic
                return _Step(None, out, feats, NOTHING_SAVED, 1, built, chained, lp)
            if w > rows > 1:  # a tree's budget asked for where chains run
                w = rows
            drafts, q, masks = make_drafts(req, anchor, a, w, rows)
            logits, feats, saved = verify(req, anchor, drafts, capture)
            if callable(masks):
                # Masks along free proposals: computed on the host while the target's
                # forward runs.
                mx.async_eval(logits)
                masks = masks()
            n, out, lp = accept(req, drafts, q, logits, a, masks)
            mx.async_eval(n, out, *(lp or ()))
        # On a CPU much of the work runs inside async_eval: the launch time is part of
        # what the cycle costs, wherever it falls between host syncs.
        return _Step(n, out, feats, saved, drafts.size + 1, time.perf_counter() - tic, chained, lp)

    with mx.stream(generation_stream):
        anchor, lp = first_token(req, logits)
        if req.controls is not None:
            req.controls.commit(anchor)
        # Started before the first cycle is built, as mlx-lm does: the prompt's last token
        # runs on the device while the host builds that cycle.
        mx.async_eval(anchor, *(lp or ()))
    step = launch(anchor, 0, chained=True) if max_tokens > 1 and chain else None
    tok = anchor.item()
    if grammar is not None:
        grammar.consume([tok])
    clock.sync()
    req.generated.append(tok)
    if step is None and max_tokens > 1 and tok not in eos_ids:
        step = launch(anchor, 0, chained=False)
    yield Cycle([tok], 0, 0, req.reused, read_logprobs(lp, [0], [tok]), tree_note=req.tree_note)
    if tok in eos_ids or step is None:
        return
    prev_w = 0
    while True:
        nxt = None
        plain = step.width == 1
        if plain and chain:
            # A plain step accepts nothing, so it commits with no host decision and the
            # next step is chained on the device token before waiting, as mlx-lm does.
            if not lean:
                commit(req, step, 0)
                snapshot(req, n_prompt + len(req.generated))  # before the next step feeds
            if len(req.generated) + 1 < max_tokens:
                nxt = launch(step.out, len(req.generated), chained=True)
        n, new = result(req, step)  # the host sync
        spent = clock.charge(step, prev_w, nxt)
        if chooser is not None and spent is not None and not plain:
            chooser.settle(n + 1, spent)  # against plain decoding as measured (the floor)
        if isinstance(req.trees, ShapeChooser) and spent is not None and step.width >= 3:
            req.trees.observe(step.tree is not None, n + 1, spent)
        if not (plain and chain):
            commit(req, step, n)
            if chooser is not None and not plain:
                # A tree's accepted path teaches the width chooser as a chain of its width
                # would (about as long at equal width): it keeps probing and waking on it.
                chooser.update(step.width, n)
        new, cut = cut_at_eos(new, eos_ids)
        if grammar is not None:
            grammar.consume(new)
        clear_cache_every(len(req.generated), len(new))
        req.generated.extend(new)
        if not (plain and chain) and not cut:
            # Everything but the last emitted token was fed (after an EOS cut, more was).
            snapshot(req, n_prompt + len(req.generated) - 1)
        done = new[-1] in eos_ids or len(req.generated) >= max_tokens
        if not done and nxt is None:
            last = mx.array(new[-1:], dtype=mx.int32)
            nxt = launch(last, len(req.generated) - 1, chained=False)
        lp = read_logprobs(step.logprobs, range(len(new)), new)
        yield Cycle(new, n, step.width, logprobs=lp, tree=step.tree is not None)
        if done:
            return
        step, prev_w = nxt, step.width


# -- the steps of the cycle -----------------------------------------------------------------


def first_token(req: Request, logits: mx.array) -> tuple[mx.array, tuple | None]:
    """The target's own token after the prompt (generated index 0), `(1,)` int32, and its
    logprobs when asked for."""
    last = logits[0, -1:]
    if req.controls is not None:
        grammar = req.controls.grammar
        masks = grammar.mask()[None] if grammar is not None else None
        last = req.controls.target(last, mx.zeros((0,), dtype=mx.int32), masks)
    if req.params.greedy:
        tok = mx.argmax(last, axis=-1)
    else:
        tok = sample(probabilities(last, req.params), req.keys(PositionKeys.FINAL, 0, 1)[0])
    tok = tok.astype(mx.int32).reshape(1)
    return tok, req.controls.logprobs(last, tok) if req.controls is not None else None


# A plain step's rewind state: it commits its one position, so nothing is ever rewound.
NOTHING_SAVED: tuple[dict, dict] = ({}, {})


def plain_step(
    req: Request, anchor: mx.array, a: int, capture: bool
) -> tuple[mx.array, mx.array | None, tuple | None]:
    """One plain decoding step (W = 1): the target on the anchor at generated index `a`
    alone; its token `(1,)`, the anchor's features when `capture`, and its logprobs when
    asked for. No drafts, no snapshot: nothing of it is rewound."""
    logits, feats = req.target.forward(anchor[None], req.cache, req.ids if capture else None)
    logits = logits[0]
    if req.controls is None and req.params.greedy:
        return mx.argmax(logits, axis=-1), feats, None
    masks = None
    if req.controls is not None and req.controls.grammar is not None:
        masks = req.controls.grammar.mask()[None]
    _, out, lp = accept(req, NO_DRAFTS, None, logits, a, masks)
    return out, feats, lp


NO_DRAFTS = mx.zeros((0,), dtype=mx.int32)
mx.eval(NO_DRAFTS)  # a value shared by every thread's requests: computed once, here


def choose(
    chooser: WidthChooser | None,
    width: int,
    draft_block: int,
    budget: int,
    depth: int = 0,
    behind: tuple[int, int] = (0, 0),
) -> tuple[int, int, bool]:
    """Verify width W, draft block L, and whether the pass captures features for the draft
    (`budget`: tokens left; `behind`: the draft's context catch-up, see `WidthChooser`)."""
    if chooser is None:
        return min(width, budget), draft_block, True
    w, rows = chooser.choose(limit=budget, depth=depth, context=behind)
    return w, rows, chooser.capture


def verify(
    req: Request, anchor: mx.array, drafts: mx.array, capture: bool
) -> tuple[mx.array, mx.array | None, tuple[dict, dict]]:
    """The target on `[anchor, drafts]`: logits `(W, V)`, the features the draft reads
    (when `capture`), and what a rewind needs (recurrent states before, inputs of the pass)."""
    before = req.target.snapshot(req.cache)
    tokens = mx.concatenate([anchor, drafts])[None]
    logits, feats = req.target.forward(tokens, req.cache, req.ids if capture else None)
    return logits[0], feats, (before, req.target.recorded_calls())


def accept(
    req: Request,
    drafts: mx.array,
    q: mx.array | None,
    logits: mx.array,
    a: int,
    masks: np.ndarray | None = None,
) -> tuple[mx.array, mx.array, tuple | None]:
    """`(n, out, logprobs)`: drafts accepted, the tokens to emit (`out[:n]` accepted drafts,
    then the target's own token, last), and the rows' logprobs when asked for. Greedy prefix
    matching or rejection sampling (SPEC 4), on the processed logits (`Controls.target`)."""
    controls = req.controls
    if controls is not None:
        logits = controls.target(logits, drafts, masks)
    if req.params.greedy:
        n, out = greedy_accept(drafts, logits)
        emitted = out  # row i emits out[i], for i <= n
    elif req.coupled:
        keys = req.keys(PositionKeys.FINAL, a + 1, logits.shape[0])
        n, out = coupled_accept(drafts, probabilities(logits, req.params), keys)
        emitted = out
    else:
        w = logits.shape[0]
        n, final = rejection_accept(
            drafts,
            q,
            probabilities(logits, req.params),
            req.keys(PositionKeys.ACCEPT, a + 1, w - 1),
            req.keys(PositionKeys.FINAL, a + 1, w),
        )
        out = mx.concatenate([drafts, final.reshape(1).astype(mx.int32)])
        emitted = mx.where(mx.arange(w) < n, out, final.astype(mx.int32))
    return n, out, controls.logprobs(logits, emitted) if controls is not None else None


def result(req: Request, step: _Step) -> tuple[int, list[int]]:
    """The host sync of a cycle: drafts accepted, and the tokens it emits."""
    if step.tree is not None:
        path, new = read_tree(req, step.tree, step.out)
        step.path.extend(path)
        return len(path) - 1, new
    if step.width == 1:
        return 0, step.out.tolist()
    n, out = step.n.item(), step.out.tolist()
    return n, (out[: n + 1] if req.params.greedy or req.coupled else out[:n] + out[-1:])


def commit(req: Request, step: _Step, n: int) -> None:
    """Keep the first `n + 1` verified positions: the target rewinds the rest (SPEC 5.3), the
    draft gets their features and its conv rows at block index `n`."""
    with mx.stream(generation_stream):
        if step.tree is not None:
            req.target.keep_path(req.cache, step.path, step.width)
        elif step.width > 1:
            before, calls = step.saved
            req.target.rewind(req.cache, n + 1, step.width, before, calls)
        commit_draft(req, step, n)


def commit_draft(req: Request, step: _Step, n: int) -> None:
    """`commit` but for the target's cache (a batch rewinds its rows at once)."""
    with mx.stream(generation_stream):
        if req.draft is not None:
            if step.feats is not None:
                rows = step.feats[:, mx.array(step.path)] if step.tree is not None else None
                req.pending.append(rows if rows is not None else step.feats[:, : n + 1])
            req.state.commit(n if step.width > 1 else None)
            req.speculating = step.width > 1
        if req.controls is not None:
            req.controls.commit(_emitted(req, step, n))


def _emitted(req: Request, step: _Step, n: int) -> mx.array:
    """The tokens a cycle emits, on the device (what `result` reads on the host)."""
    if step.width == 1 or req.params.greedy or req.coupled:
        return step.out[: n + 1]
    return mx.concatenate([step.out[:n], step.out[-1:]])
