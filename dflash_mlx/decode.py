"""The decode cycle (SPEC 1): prefill -> draft -> verify -> accept -> rewind, in token ids.

Owns the order of operations and what each side's cache holds after every cycle. Yields one
`Cycle` per verify pass with the tokens it commits. Knows nothing about text, stop strings
or timing: `generate.py` does that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from .adaptive import WidthChooser
from .draft import DFlashDraft
from .prompt_cache import PromptCache, common_prefix
from .sampling import SamplingParams, greedy_accept, probabilities, rejection_accept, sample
from .target import TargetAdapter

PREFILL_STEP = 512

# Fallback verify-width cap for quantized targets, before anything is measured on the
# device (SPEC 5.4): wide verifies are slow with MLX's quantized matmul.
QUANTIZED_VERIFY_CAP = 5


@dataclass
class Cycle:
    """What one step of the decoder committed."""

    tokens: list[int]  # emitted tokens, in order (drafts accepted, then the target's own)
    accepted: int  # drafted tokens accepted (n); tau of this cycle = accepted + 1
    width: int  # verify width W of this cycle (0 for the token sampled after prefill)
    reused: int = 0  # prompt tokens taken from a PromptCache instead of prefilled (first only)


@dataclass
class _Context:
    """Whether the draft's context fell behind the committed positions.

    While the width chooser finds speculation not worth it, plain steps skip feature
    capture ("dormant"): the context keeps what it had (the prompt, say) and, a window of
    steps before the draft runs again, resumes at the current position, the skipped
    stretch left as a gap (`DFlashDraft.skip_to`: RoPE keeps the true distances).
    """

    stale: bool = False
    # Recurrent targets with a prompt cache: their state after the latest committed cycle.
    snapshot: tuple[int, dict[int, tuple]] | None = None


class _Step(NamedTuple):
    """One launched cycle, until its result reaches the host."""

    n: mx.array  # drafted tokens accepted
    out: mx.array  # tokens to emit (accepted drafts, then the target's own)
    feats: mx.array | None  # target features of the fed positions (None: not captured)
    saved: dict  # recurrent states before the pass (for rewind)
    width: int
    built: float  # seconds its launch took on the host
    chained: bool  # launched before the previous cycle's result reached the host


def is_quantized(model) -> bool:
    args = getattr(model, "args", None)
    if getattr(args, "quantization", None):
        return True
    from mlx.nn import QuantizedLinear

    return any(isinstance(m, QuantizedLinear) for _, m in model.named_modules())


def default_verify_width(model, draft: DFlashDraft | None) -> int:
    if draft is None:
        return 1
    width = draft.config.block_size
    if is_quantized(model):
        width = min(width, QUANTIZED_VERIFY_CAP)
    return width


def speculative_decode(
    target: TargetAdapter,
    draft: DFlashDraft | None,
    prompt: list[int],
    *,
    max_tokens: int,
    params: SamplingParams,
    key: mx.array,
    width: int,
    draft_block: int,
    eos_ids: frozenset[int] = frozenset(),
    chooser: WidthChooser | None = None,
    prefill_step: int = PREFILL_STEP,
    progress: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
) -> Iterator[Cycle]:
    """Decode up to `max_tokens` tokens after `prompt`, yielding each committed cycle.

    `width` is the verify width W (1 = plain decoding, no draft pass); `draft_block` is the
    number of rows L >= W the draft runs. With a `chooser`, (W, L) are chosen each cycle
    instead and the chooser learns from every verify. Stops after EOS or `max_tokens`.
    With a `prompt_cache`, the state of its previous request is reused from the longest
    common prefix on, and this request's state is left in it.
    """
    assert 1 <= width <= max(draft_block, 1)
    ids = draft.config.target_layer_ids if draft is not None else None
    cache, start = _reuse(prompt_cache, target, draft, prompt)
    ctx = _Context()
    keep = prompt_cache is not None and target.recurrent  # recurrent state snapshots
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    total = len(prompt)

    def prefill(lo: int, hi: int):
        """Feed prompt[lo:hi] in chunks; the draft's context grows chunk by chunk."""
        logits = None
        while lo < hi:
            n = min(prefill_step, hi - lo)
            logits, feats = target.forward(tokens[:, lo : lo + n], cache, ids)
            if draft is not None:
                draft.add_context(feats)
            lo += n
            if lo < total:
                mx.eval([c.state for c in cache] + (draft.state if draft is not None else []))
                mx.clear_cache()
                if progress is not None:
                    progress(lo, total)
        return logits

    generated: list[int] = []
    pending: list[mx.array] = []  # features of committed positions the draft has not seen
    try:
        # All but the last token first, as mlx-lm does: only their caches are evaluated,
        # so the LM head never runs over the prompt (vocabulary x prompt logits).
        prefill(start, total - 1)
        if keep:
            # Recurrent state cannot be trimmed later: keep it as it is before the last token.
            prompt_snapshot = (total - 1, target.snapshot(cache))
        logits = prefill(total - 1, total)
    except BaseException:
        # Interrupted mid-prefill: the reused caches no longer match any token history.
        if prompt_cache is not None:
            prompt_cache.clear()
        raise
    if progress is not None:
        progress(total, total)
    try:
        yield from _generate(
            target,
            draft,
            cache,
            logits,
            ids,
            generated,
            pending,
            ctx,
            start,
            total,
            max_tokens=max_tokens,
            params=params,
            key=key,
            width=width,
            draft_block=draft_block,
            eos_ids=eos_ids,
            chooser=chooser,
            keep_snapshots=keep,
        )
    finally:
        # Whatever ended generation, the caches hold at least the committed positions of
        # prompt + generated (extra ones are trimmed away on reuse).
        if prompt_cache is not None:
            if draft is not None and pending:
                draft.add_context(mx.concatenate(pending, axis=1))
            if draft is not None and ctx.stale:
                # Nothing of the dormant stretch was captured: it stays a gap up to where
                # the committed positions end.
                draft.skip_to(total + len(generated) - 1)
            prompt_cache.owner = (target.model, draft)
            prompt_cache.tokens = prompt + generated
            prompt_cache.target_cache = cache
            prompt_cache.draft_caches = draft._caches if draft is not None else None
            if keep:
                prompt_cache.snapshots = [prompt_snapshot] + (
                    [ctx.snapshot] if ctx.snapshot else []
                )
            if draft is not None:
                prompt_cache.draft_base = draft.context_base
                prompt_cache.draft_gaps = list(draft.gaps)


def _reuse(
    pc: PromptCache | None, target: TargetAdapter, draft: DFlashDraft | None, prompt: list[int]
) -> tuple[list, int]:
    """A cache holding the first `start` prompt positions, and `start` (0: a fresh cache);
    the draft's context is left ending at position `start` too."""
    fresh = target.make_cache()
    if draft is not None:
        draft.reset()
    if pc is None or pc.target_cache is None or pc.owner != (target.model, draft):
        return fresh, 0
    # Positions of all but the last known token are committed; one prompt token must be
    # left to prefill, for the logits of the first new token.
    start = min(common_prefix(pc.tokens[: len(pc.tokens) - 1], prompt), len(prompt) - 1)
    if draft is not None:
        draft.reset(pc.draft_caches, pc.draft_base, pc.draft_gaps)
        start = min(start, draft.context_end)
    cache = pc.target_cache
    if target.recurrent:
        usable = [(n, snap) for n, snap in pc.snapshots if n <= start]
        if not usable:
            if draft is not None:
                draft.reset()
            return fresh, 0
        start, snap = max(usable, key=lambda x: x[0])
        target.restore(cache, snap)
    for i, c in enumerate(cache):
        if i not in target.replay_ids:
            c.trim(c.offset - start)
    if draft is not None:
        draft.trim_to(start)
    return cache, start


def _generate(
    target: TargetAdapter,
    draft: DFlashDraft | None,
    cache: list,
    logits: mx.array,
    ids: list[int] | None,
    generated: list[int],
    pending: list[mx.array],
    ctx: _Context,
    reused: int,
    n_prompt: int,
    *,
    max_tokens: int,
    params: SamplingParams,
    key: mx.array,
    width: int,
    draft_block: int,
    eos_ids: frozenset[int],
    chooser: WidthChooser | None,
    keep_snapshots: bool = False,
) -> Iterator[Cycle]:
    """The cycles after prefill; every emitted token is appended to `generated`, the
    features the draft has not consumed yet stay in `pending`, `ctx` follows which
    positions the draft's context holds (and, with `keep_snapshots`, the recurrent state
    after the latest committed cycle)."""
    key, sub = mx.random.split(key)
    last = logits[0, -1:]
    first = mx.argmax(last, axis=-1) if params.greedy else sample(probabilities(last, params), sub)
    anchor = first.astype(mx.int32).reshape(1)

    def launch(anchor: mx.array, position: int, budget: int, chained: bool):
        """Build one cycle's draft + verify graph and start it on the device (`position`:
        the anchor's; `chained`: before the previous cycle's result reached the host)."""
        nonlocal key
        tic = time.perf_counter()
        w, rows = min(width, budget), draft_block
        capture = ids
        if chooser is not None:
            w, rows = chooser.choose(limit=budget)
            if not chooser.capture:
                capture = None
                if not ctx.stale and pending:
                    draft.add_context(mx.concatenate(pending, axis=1))
                    pending.clear()
                ctx.stale = True
            elif ctx.stale:
                # Waking from a dormant stretch: the context resumes at this position.
                draft.skip_to(position)
                ctx.stale = False
        k_draft = k_accept = None
        if not params.greedy:
            key, k_draft, k_accept = mx.random.split(key, 3)
        drafts = mx.zeros((0,), dtype=mx.int32)
        q = None
        if w > 1:
            if pending:
                draft.add_context(mx.concatenate(pending, axis=1))
                if len(pending) > 1:
                    # Catching up on the positions decoded plainly is paid once, when
                    # speculation resumes: run it apart so it is not taken for what
                    # every cycle of this width costs.
                    mx.async_eval(draft.state)
                    tic = time.perf_counter()
                pending.clear()
            drafts, q = draft.propose(anchor, rows, w - 1, params, k_draft)
            drafts = drafts.astype(mx.int32)
        saved = target.snapshot(cache)
        logits, feats = target.forward(mx.concatenate([anchor, drafts])[None], cache, capture)
        if params.greedy:
            n, out = greedy_accept(drafts, logits[0])
        else:
            n, final = rejection_accept(drafts, q, probabilities(logits[0], params), k_accept)
            out = mx.concatenate([drafts, final.reshape(1).astype(mx.int32)])
        mx.async_eval(n, out)
        # On a CPU much of the work runs inside async_eval: the launch time is part of
        # what the cycle costs, wherever it falls between host syncs.
        return _Step(n, out, feats, saved, w, time.perf_counter() - tic, chained)

    # The next cycle is always launched before the current one is handed to the caller,
    # so detokenizing and rendering overlap with device work.
    step = launch(anchor, n_prompt, max_tokens - 1, chained=True) if max_tokens > 1 else None
    tok = anchor.item()
    synced = time.perf_counter()
    generated.append(tok)
    yield Cycle([tok], 0, 0, reused)
    emitted = 1
    if tok in eos_ids or step is None:
        return
    prev_w = 0
    while True:
        n, out, feats, saved, w, built, chained = step
        nxt = None
        if w == 1:
            # A plain step accepts nothing, so its bookkeeping needs no host decision and
            # the next step can be chained on the device token before waiting, as mlx-lm's
            # own decoding loop does.
            n = 0
            if draft is not None:
                if feats is not None:
                    pending.append(feats)
                draft.commit(None)
            if keep_snapshots:  # before the next step feeds another token
                ctx.snapshot = (n_prompt + emitted, target.snapshot(cache))
            if emitted + 1 < max_tokens:
                nxt = launch(out[:1], n_prompt + emitted, max_tokens - emitted - 1, chained=True)
            new = out.tolist()
        else:
            n = n.item()  # the one host sync of the cycle
            new = out.tolist()
        now = time.perf_counter()
        if chooser is not None and prev_w:
            # What this cycle cost: the time from the previous sync to this one, with each
            # launch counted for the cycle it built (a chained launch falls in the interval
            # before its own).
            spent = now - synced + (built if chained else 0.0)
            chooser.observe(w, spent - (nxt.built if nxt is not None else 0.0))
        synced = now
        if w > 1:
            new = new[: n + 1] if params.greedy else new[:n] + new[-1:]
            target.rewind(cache, keep=n + 1, total=w, snapshot=saved)
            if draft is not None:
                pending.append(feats[:, : n + 1])
                draft.commit(n)
            if chooser is not None:
                chooser.update(w, n)
        cut = False
        for j, t in enumerate(new):
            if t in eos_ids:
                cut, new = j + 1 < len(new), new[: j + 1]
                break
        emitted += len(new)
        if keep_snapshots and w > 1 and not cut:
            # Everything but the last emitted token was fed (after an EOS cut, more was).
            ctx.snapshot = (n_prompt + emitted - 1, target.snapshot(cache))
        generated.extend(new)
        done = new[-1] in eos_ids or emitted >= max_tokens
        if not done and nxt is None:
            nxt = launch(
                mx.array(new[-1:], dtype=mx.int32),
                n_prompt + emitted - 1,
                max_tokens - emitted,
                chained=False,
            )
        yield Cycle(new, n, w)
        if done:
            return
        step, prev_w = nxt, w
