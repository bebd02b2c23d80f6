"""The steps of the decode cycle (SPEC 1), in token ids, for one request's state:

    prefill -> (choose -> draft -> verify -> accept -> commit)*

Each step is a small function working on the request's own state (`prefill.Request`:
target cache, `DraftState`, committed tokens); the models hold none of it, and the `Pair`
holds what belongs to the pairing. One driver runs them, for one row or many:
`batch.BatchDecoder` (`batch_cycle.py` its cycle over rows; `speculative_decode` and
`stream_generate` are that engine with one row). Here: the first token after the prompt,
acceptance (`accept`), the host read of a cycle (`result`) and its commit (`commit`,
`commit_draft`). The prefill is `prefill.py`'s, the draft's proposals `walks.py`'s, a
tree's `tree.py`'s; bookkeeping (`cut_at_eos`, a dormant draft's context, recurrent
snapshots) is `bookkeeping.py`'s. Knows nothing about text, stop strings or statistics:
`generate.py` does that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from .controls import TokenLogprob
from .prefill import Request
from .sampling import (
    PositionKeys,
    coupled_accept,
    greedy_accept,
    probabilities,
    rejection_accept,
    sample,
)
from .tree import read_tree


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
    steps: int = 1  # verify passes it stands for (a stretch of plain steps: one per token)


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

NO_DRAFTS = mx.zeros((0,), dtype=mx.int32)
mx.eval(NO_DRAFTS)  # a value shared by every thread's requests: computed once, here


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


def commit_draft(req: Request, step: _Step, n: int) -> None:
    """A cycle's commit for the draft and the controls: the draft gets the features of
    the first `n + 1` verified positions and its conv rows at block index `n` (the target's
    cache is rewound per row by `batch_cache.keep`, SPEC 5.3)."""
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
