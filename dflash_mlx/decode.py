"""The decode cycle (SPEC 1), in token ids:

    prefill -> (choose -> draft -> verify -> accept -> commit)*

`speculative_decode` is that loop and each step is one small function below, all of them
working on the request's own state (`prefill.Request`: target cache, `DraftState`, committed
tokens); the models hold none of it, and the `Pair` holds what belongs to the pairing. The
prefill (and resuming from a `PromptCache`) is `prefill.py`'s. Bookkeeping sits beside the
cycle, not inside it: `_Clock` charges each cycle its wall time for the width chooser,
`_follow_capture` moves a dormant draft's context, `resume` and `Request.saved` exchange
state with a `PromptCache`.
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

from .adaptive import WidthChooser
from .controls import Controls, Grammar, TokenLogprob, read_logprobs
from .options import GenerateOptions
from .pair import Pair
from .prefill import Request, prefill_prompt, resume
from .prompt_cache import PromptCache
from .sampling import (
    PositionKeys,
    greedy_accept,
    probabilities,
    propose,
    rejection_accept,
    sample,
)
from .tree import (
    BRANCH,
    ShapeChooser,
    Tree,
    accept_greedy,
    accept_sampled,
    attention_mask,
    build,
)

# MLX's buffer cache is cleared every this many generated tokens, as mlx-lm does: freed
# buffers of a long decode (growing caches, verify passes of every width) are returned.
CLEAR_CACHE_EVERY = 256


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
    with mx.stream(generation_stream):
        cache, state, start = resume(pair, draft, prompt, saved, options.draft_window)
    req = Request(
        pair,
        draft,
        options.sampling,
        PositionKeys(seed),
        list(prompt),
        cache,
        state,
        start,
        draft.config.target_layer_ids if draft is not None else None,
        keep_snapshots=prompt_cache is not None and pair.target.recurrent,
        controls=Controls.of(options, pair.target.logits_width, prompt, grammar),
    )
    req.trees = _trees(req, options, chooser, learn_costs)
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
            clock=_Clock(chooser if learn_costs else None),
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
    clock: _Clock,
    learn_costs: bool = True,
) -> Iterator[Cycle]:
    """The cycles after prefill. The next cycle is always launched before the current one
    is handed to the caller, so detokenizing and rendering overlap with device work."""
    n_prompt = len(req.prompt)
    grammar = req.controls.grammar if req.controls is not None else None
    # A plain step is chained on the device token of the one before it, unless a grammar's
    # masks must first see that token on the host.
    chain = grammar is None

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
                _follow_capture(req, capture, n_prompt + a)
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
                return _launch_tree(req, anchor, a, w, rows, capture, tic, chained)
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
            commit(req, step, 0)
            _snapshot(req, n_prompt + len(req.generated))  # before the next step feeds
            if len(req.generated) + 1 < max_tokens:
                nxt = launch(step.out[:1], len(req.generated), chained=True)
        n, new = result(req, step)  # the host sync
        spent = clock.charge(step, prev_w, nxt)
        if isinstance(req.trees, ShapeChooser) and spent is not None and step.width >= 3:
            req.trees.observe(step.tree is not None, n + 1, spent)
        if not (plain and chain):
            commit(req, step, n)
            if chooser is not None and not plain:
                # A tree's accepted path teaches the width chooser as a chain of its width
                # would (about as long at equal width): it keeps probing and waking on it.
                chooser.update(step.width, n)
        new, cut = _cut_at_eos(new, eos_ids)
        if grammar is not None:
            grammar.consume(new)
        _clear_cache_every(len(req.generated), len(new))
        req.generated.extend(new)
        if not (plain and chain) and not cut:
            # Everything but the last emitted token was fed (after an EOS cut, more was).
            _snapshot(req, n_prompt + len(req.generated) - 1)
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


def make_drafts(
    req: Request, anchor: mx.array, a: int, w: int, rows: int
) -> tuple[mx.array, mx.array | None, np.ndarray | Callable[[], np.ndarray] | None]:
    """The draft's `w - 1` proposals after the anchor at generated index `a` (none for
    W = 1), when sampling the distributions `q` they were drawn from, and under a grammar
    its masks at each verified row `(W', words)` (a block it ends early has W' < W rows),
    or for free proposals what computes them while the verify pass runs."""
    controls = req.controls
    grammar = controls.grammar if controls is not None else None
    if w == 1:
        masks = grammar.mask()[None] if grammar is not None else None
        return mx.zeros((0,), dtype=mx.int32), None, masks
    req.feed_draft()
    keys = None if req.params.greedy else req.keys(PositionKeys.DRAFT, a + 1, w - 1)
    selector = "candidate_selector" in req.draft  # DFlash 2: proposals drawn all at once
    if grammar is not None and grammar.mask_drafts and not selector:
        drafts, q, masks = _walk_grammar(req, anchor, rows, w - 1, keys)
    elif controls is not None and controls.follows_history and not selector:
        drafts, q, masks = _walk(req, anchor, rows, w - 1, keys)
    else:
        process = controls.draft if controls is not None else None
        drafts, q = propose(req.draft, req.state, anchor, rows, w - 1, req.params, keys, process)
        masks = _masks_along(req, drafts)
    req.lazy_rows = 0  # computed with this draft pass
    return drafts.astype(mx.int32), q, masks


def _walk(
    req: Request, anchor: mx.array, length: int, rows: int, keys: mx.array | None
) -> tuple[mx.array, mx.array | None, np.ndarray | None]:
    """The draft's proposals row by row on the device, each from its processed distribution
    given the proposals before it (`Controls.walk`): the penalties see the block's own
    proposals. Returns the proposals, their `q` when sampling, and under a grammar that does
    not mask drafts its masks along them."""
    qs = []

    def pick(row: mx.array, i: int) -> mx.array:
        if req.params.greedy:
            return mx.argmax(row, axis=-1)[0].astype(mx.int32)
        qs.append(probabilities(row, req.params)[0])
        return sample(qs[-1], keys[i]).astype(mx.int32)

    logits = req.draft.block_logits(anchor, length, rows, req.state)
    drafts = mx.stack(req.controls.walk(logits, pick))
    return drafts, mx.stack(qs) if qs else None, _masks_along(req, drafts)


def _walk_grammar(
    req: Request, anchor: mx.array, length: int, rows: int, keys: mx.array | None
) -> tuple[mx.array, mx.array | None, np.ndarray]:
    """The draft's proposals within the grammar, row by row on the host: the draft's block
    (processed with the committed history) is read back once, and each row is drawn from the
    tokens the grammar allows after the proposals before it: greedily, or from
    `softmax(row / temperature)` over them with the row's own key (that is its `q`). The
    matcher advances with each proposal and is rolled back after; a proposed EOS ends the
    block. Returns the proposals, `q` when sampling, and the masks of every verified row."""
    grammar, greedy = req.controls.grammar, req.params.greedy
    logits = req.controls.draft(req.draft.block_logits(anchor, length, rows, req.state))
    if not greedy:
        logits = logits * (1.0 / req.params.temperature)
    host = np.array(logits, dtype=np.float64)  # the one host sync of the walk
    seeds = None if greedy else np.array(keys).astype(np.uint64)
    masks, drafts, qs = [grammar.mask()], [], []
    for i in range(rows):
        row = np.where(grammar.allowed(masks[-1]), host[i], -np.inf)
        if greedy:
            tok = int(np.argmax(row))
        else:
            q = np.exp(row - row.max())
            qs.append(q / q.sum())
            rng = np.random.default_rng(int(seeds[i, 0] << np.uint64(32) | seeds[i, 1]))
            tok = int(min(np.searchsorted(np.cumsum(qs[-1]), rng.random()), row.size - 1))
        drafts.append(tok)
        if tok in grammar.eos:
            break
        grammar.consume([tok])
        masks.append(grammar.mask())
    grammar.rollback(len(masks) - 1)
    if len(masks) == len(drafts):  # nothing follows a proposed EOS: its row is unread
        masks.append(np.full_like(masks[0], -1))
    q = mx.array(np.stack(qs), dtype=mx.float32) if qs else None
    return mx.array(drafts, dtype=mx.int32), q, np.stack(masks)


def _masks_along(req: Request, drafts: mx.array) -> Callable[[], np.ndarray] | None:
    """Under a grammar that does not mask the draft's proposals: what computes its masks at
    each verified row after the free `drafts` (called once the verify pass is launched).
    Rows past the first proposal it refuses are never accepted (left unmasked)."""
    grammar = req.controls.grammar if req.controls is not None else None
    return None if grammar is None else lambda: _masks_after(grammar, drafts.tolist())


def _masks_after(grammar: Grammar, drafts: list[int]) -> np.ndarray:
    masks, taken = [grammar.mask()], 0
    for tok in drafts:
        if not grammar.allows(masks[-1], tok) or tok in grammar.eos:
            break
        grammar.consume([tok])
        taken += 1
        masks.append(grammar.mask())
    grammar.rollback(taken)
    masks += [np.full_like(masks[0], -1)] * (len(drafts) + 1 - len(masks))
    return np.stack(masks)


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
        return _tree_result(req, step)
    if step.width == 1:
        return 0, step.out.tolist()
    n, out = step.n.item(), step.out.tolist()
    return n, (out[: n + 1] if req.params.greedy else out[:n] + out[-1:])


def commit(req: Request, step: _Step, n: int) -> None:
    """Keep the first `n + 1` verified positions: the target rewinds the rest (SPEC 5.3), the
    draft gets their features and its conv rows at block index `n`."""
    with mx.stream(generation_stream):
        if step.tree is not None:
            req.target.keep_path(req.cache, step.path, step.width)
        elif step.width > 1:
            before, calls = step.saved
            req.target.rewind(req.cache, n + 1, step.width, before, calls)
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
    if step.width == 1 or req.params.greedy:
        return step.out[: n + 1]
    return mx.concatenate([step.out[:n], step.out[-1:]])


# -- bookkeeping beside the cycle ------------------------------------------------------------


def _cut_at_eos(new: list[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """The tokens up to the first EOS, and whether committed tokens followed it."""
    for j, t in enumerate(new):
        if t in eos_ids:
            return new[: j + 1], j + 1 < len(new)
    return new, False


def _snapshot(req: Request, fed: int) -> None:
    """Recurrent targets with a prompt cache: their state after `fed` tokens, to resume at."""
    if req.keep_snapshots:
        req.latest_snapshot = (fed, req.target.snapshot(req.cache))


def _clear_cache_every(generated: int, new: int) -> None:
    """Return MLX's cached buffers every `CLEAR_CACHE_EVERY` generated tokens."""
    if (generated + new) // CLEAR_CACHE_EVERY > generated // CLEAR_CACHE_EVERY:
        mx.clear_cache()


def _follow_capture(req: Request, capture: bool, position: int) -> None:
    """Dormancy: while plain steps capture no features the draft's context stays behind
    (the prompt, say); when capture resumes, at the anchor's `position`, the skipped
    stretch becomes a gap (`DraftState.skip_to`: RoPE keeps the true distances)."""
    if not capture:
        if not req.stale:
            req.feed_draft()
        req.stale = True
    elif req.stale:
        req.state.skip_to(position)
        req.stale = False


class _Clock:
    """What each cycle cost, host sync to host sync, with each launch counted for the cycle
    it built (a chained launch falls in the interval before its own), for the chooser."""

    def __init__(self, chooser: WidthChooser | None):
        self.chooser = chooser
        self.synced = 0.0

    def sync(self) -> None:
        self.synced = time.perf_counter()

    def charge(self, step: _Step, prev_w: int, nxt: _Step | None) -> float | None:
        """Charge `step` its seconds (returned; None when not measured). A tree's are not
        a chain's of its width: the width chooser learns chains only."""
        now, spent = time.perf_counter(), None
        if self.chooser is not None and prev_w:
            spent = now - self.synced + (step.built if step.chained else 0.0)
            spent -= nxt.built if nxt is not None else 0.0
            if step.tree is None:
                self.chooser.observe(step.width, spent)
        self.synced = now
        return spent


# -- trees (SPEC 7) --------------------------------------------------------------------------


def _trees(
    req: Request, options: GenerateOptions, chooser: WidthChooser | None, learn_costs: bool
) -> bool | ShapeChooser:
    """Whether this request's speculative cycles verify trees: `options.tree` True (always;
    where a tree cannot be verified, chains, and `req.tree_note` says why), False (never), or
    None: a `ShapeChooser` picks per cycle from measured speed, where the width is chosen
    too and costs are learnt (a seeded request verifies chains: its shapes must not follow
    wall time)."""
    if options.tree is False or req.draft is None:
        return False
    if options.tree is None and (chooser is None or not learn_costs):
        return False
    why = req.target.tree_support(req.cache)
    if why is None and req.controls is not None:
        why = "penalties, a bias, a grammar or logprobs (their histories follow chains)"
    if options.tree:
        req.tree_note = why
    if why is not None:
        return False
    if options.tree:
        return True
    return chooser.shapes


def _launch_tree(
    req: Request,
    anchor: mx.array,
    a: int,
    budget: int,
    rows: int,
    capture: bool,
    tic: float,
    chained: bool,
) -> _Step:
    """Draft, build the tree of `budget` tokens (anchor included) from the draft's ranked
    tokens at each block position (`tree.build`), and verify it in one target pass."""
    req.feed_draft()
    logits = req.draft.block_logits(anchor, rows, rows - 1, req.state)
    req.lazy_rows = 0
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    k = min(BRANCH, lp.shape[-1])
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)  # best first
    top, vals = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    tokens, parents, depths, seen = build(anchor, vals, top, budget)
    logits, feats = req.target.forward_tree(
        tokens[None],
        req.cache,
        attention_mask(seen, req.cache[0].offset),
        depths,
        req.ids if capture else None,
    )
    if req.params.greedy:
        out = mx.argmax(logits[0], axis=-1)
    else:
        out = probabilities(logits[0], req.params)
    mx.async_eval(out, tokens, parents, depths)
    built = time.perf_counter() - tic
    shape = (tokens, parents, depths)  # read with the result
    return _Step(None, out, feats, ({}, {}), tokens.size, built, chained, None, shape, [])


def _tree_result(req: Request, step: _Step) -> tuple[int, list[int]]:
    """The host sync of a tree cycle: walk the verified tree (`tree.accept_*`)."""
    tree, host = Tree(*(np.array(x) for x in step.tree)), np.array(step.out)
    if req.params.greedy:
        path, final = accept_greedy(tree, host)
    else:
        a = len(req.generated) - 1  # the anchor's generated index
        uniforms = np.stack(
            [
                req.keys.uniforms(PositionKeys.ACCEPT, a + 1 + int(d), BRANCH + 1)
                for d in tree.depths
            ]
        )
        path, final = accept_sampled(tree, host, uniforms)
    step.path.extend(path)
    return len(path) - 1, [int(t) for t in tree.tokens[path[1:]]] + [final]
