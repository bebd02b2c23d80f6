"""Tree verification (SPEC 7): more tokens per target pass from the same draft pass.

A DFlash draft gives a distribution at every block position in one pass; a chain verifies
only its top token at each. A tree verifies, in the same one target pass, the likeliest
continuations under the draft's per-position marginals: `build` picks the `budget - 1`
drafted nodes of highest path probability (best-first, vectorised per depth: the draft's
marginals do not depend on the parent, so every node's children are the same ranked tokens
of the next position). A DFlash 2 draft's tree comes from its candidate selector instead
(`selector_tree`): each node's children are the next slot's candidates scored given that
node's token, the paths the selector would walk, best first. Under a grammar (a request
whose only control is one) `grammar_tree` builds it on the host within the grammar, and
every node's target distribution is masked by the grammar at that node's path
(`node_outputs`): the argument below holds for the masked `p`. `attention_mask` lets each node
see the committed prefix and its own ancestors only, at position `prefix + depth`.
`accept_greedy` and `accept_sampled` walk the verified tree from the root (SPEC 7): greedy
follows the child equal to the target's argmax; sampling tests a node's children in rank
order with the rule for deterministically chosen children (accept child `c` with probability
`r(c)`; on rejection `r(c) = 0`, renormalise), which leaves the output distributed exactly
as the target's.

Why that rule is exact: at node `v` with target distribution `p`, the children `c_1..c_m`
are fixed before any draw. Accepting `c_1` with probability `p(c_1)` and otherwise drawing
from `p` without `c_1` is a draw from `p`: P(c_1) = p(c_1), and any other token `x`
comes out with probability `(1 - p(c_1)) * p(x) / (1 - p(c_1)) = p(x)`. Testing `c_2`
against that renormalised remainder repeats the argument, and so on; the final draw from the
remainder completes it. Descending into an accepted child continues with that child's `p`,
the target's distribution given the accepted prefix, so the whole path is a draw from the
target's autoregressive law.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .controls import bits_to_mask
from .sampling import PositionKeys, probabilities, sample_rows
from .walks import FORCED_BEYOND, draft_block

if TYPE_CHECKING:
    from ..options import GenerateOptions
    from .prefill import Request

# Children considered per node: the draft's ranked tokens at the next position.
BRANCH = 8


@dataclass(frozen=True)
class Tree:
    """A verified tree: node 0 is the anchor (the root, depth 0); nodes `1..` are drafted
    tokens, each after its parent (parents come first), children of a node in rank order."""

    tokens: np.ndarray  # (N,) int: the anchor, then each node's token
    parents: np.ndarray  # (N,) int: parent index (-1 for the root)
    depths: np.ndarray  # (N,) int

    @property
    def size(self) -> int:
        return int(self.tokens.size)

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def children(self, v: int) -> np.ndarray:
        return np.nonzero(self.parents == v)[0]

    def is_chain(self) -> bool:
        return bool((self.parents[1:] == np.arange(self.size - 1)).all())


def build(
    anchor: mx.array, logprobs: mx.array, ranked: mx.array, budget: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The `budget`-node tree (anchor included) of highest path log-probability, built on
    the device with no host sync, so that its verify pass is launched as a chain's is.

    `ranked` `(D, K)`: the draft's K likeliest tokens at each depth `1..D`, best first, and
    `logprobs` `(D, K)` theirs; or, for DFlash 2's selector (`selector_tree`), `ranked` its
    candidates `C_d` and `logprobs` `(D, K, K)`: `[d, i, j]` the log-probability of candidate
    `j` at depth `d + 1` after candidate `i` at depth `d` (row 0 after the anchor at `d = 0`),
    so a node's children depend on its token. A node's path score is the sum of its path's
    log-probs; every child scores at most its parent, so the `budget - 1` best nodes over all
    depths form a tree (each node's parent is among them): each depth keeps its best `budget -
    1` extensions of the depth before, and the best of all are kept, in depth order. Equal
    scores keep the shallower, lower-rank node first, so a node never comes without its parent.
    Returns `(tokens, parents, depths)`, `(N,)` each (the root's parent is -1), and `ancestors`
    `(N, N)` bool; shapes follow from `budget` and `ranked.shape` alone."""
    depth, k = ranked.shape
    keep_most = budget - 1
    scores, parents, ranks, levels = [], [], [], []
    frontier = mx.zeros((1,))
    frontier_ids = mx.zeros((1,), dtype=mx.int32)
    frontier_rank = mx.zeros((1,), dtype=mx.int32)  # each frontier node's candidate index
    pairs = logprobs.ndim == 3
    next_id = 1
    for d in range(depth):
        step = logprobs[d][frontier_rank] if pairs else logprobs[d][None, :]
        cand = (frontier[:, None] + step).reshape(-1)
        n = min(cand.size, keep_most)
        keep = mx.argsort(-cand)[:n]
        scores.append(cand[keep])
        parents.append(frontier_ids[keep // k])
        ranks.append(keep % k)
        levels.append(mx.full((n,), d + 1, dtype=mx.int32))
        frontier = cand[keep]
        frontier_rank = keep % k
        frontier_ids = mx.arange(next_id, next_id + n, dtype=mx.int32)
        next_id += n
    score, parent = mx.concatenate(scores), mx.concatenate(parents)
    rank, level = mx.concatenate(ranks), mx.concatenate(levels)
    total = score.size
    # Strictly below its parent: a child's key loses the depth and rank tie-breaks.
    key = score - 1e-6 * level.astype(mx.float32) - 1e-9 * rank.astype(mx.float32)
    best = mx.sort(mx.argsort(-key)[: min(keep_most, total)])  # candidate order: parents first
    n = best.size + 1
    new_index = (
        mx.zeros((total + 1,), dtype=mx.int32).at[best + 1].add(mx.arange(1, n, dtype=mx.int32))
    )
    level_b = level[best]
    tokens = mx.concatenate([anchor.reshape(1).astype(mx.int32), ranked[level_b - 1, rank[best]]])
    par = mx.concatenate([mx.array([0], dtype=mx.int32), new_index[parent[best]]])
    depths = mx.concatenate([mx.array([0], dtype=mx.int32), level_b])
    par = mx.concatenate([mx.array([-1], dtype=mx.int32), par[1:]])
    return tokens, par, depths, ancestors(par, depth)


def ancestors(parents: mx.array, depth: int) -> mx.array:
    """`(N, N)` bool: node `i` sees node `j` (itself or an ancestor), for a tree of the given
    `depth` whose `parents` come before their children (the root's is -1)."""
    n = parents.size
    up = mx.maximum(parents, 0)
    seen = mx.eye(n, dtype=mx.bool_)
    for _ in range(depth):  # each row takes its parent's ancestors
        seen = seen | seen[up]
    return seen


def chain(anchor: int, tokens: list[int]) -> Tree:
    n = len(tokens) + 1
    return Tree(np.array([anchor, *tokens]), np.arange(-1, n - 1), np.arange(n))


def attention_mask(seen: mx.array, prefix: int) -> mx.array:
    """`(N, prefix + N)` bool: node `i` sees the committed prefix, itself and its ancestors
    (`seen`, from `ancestors`)."""
    return mx.concatenate([mx.ones((seen.shape[0], prefix), dtype=mx.bool_), seen], axis=1)


def accept_greedy(tree: Tree, argmax: np.ndarray) -> tuple[list[int], int]:
    """The accepted path (node ids from the root, anchor included) and the target's token
    after it: from the root, follow the child equal to the target's argmax there."""
    path = [0]
    while True:
        v = path[-1]
        nxt = [c for c in tree.children(v) if tree.tokens[c] == argmax[v]]
        if not nxt:
            return path, int(argmax[v])
        path.append(int(nxt[0]))


def accept_sampled(tree: Tree, p: np.ndarray, uniforms: np.ndarray) -> tuple[list[int], int]:
    """Sampling acceptance over a tree whose children are the draft's ranked tokens (chosen
    deterministically): see the module docstring. `p` `(N, V)`: the target's distribution at
    each node; `uniforms` `(N, BRANCH + 1)`: node `v`'s draws (one per child test, the last
    for the final sample), a function of the seed and the node's position and rank only."""
    path = [0]
    while True:
        v = path[-1]
        r = p[v].astype(np.float64)
        for j, c in enumerate(tree.children(v)):
            tok = tree.tokens[c]
            if uniforms[v, j] < r[tok] / max(r.sum(), 1e-30):
                path.append(int(c))
                break
            r = r.copy()
            r[tok] = 0.0
        else:
            total = r.sum()
            if total <= 1e-12:  # every token the target allows was tested and refused
                r, total = p[v].astype(np.float64), float(p[v].sum())
            cdf = np.cumsum(r / total)
            return path, int(min(np.searchsorted(cdf, uniforms[v, -1]), r.size - 1))


class ShapeChooser:
    """Chain or tree, per speculative cycle, for `tree=None`: whichever has committed more
    tokens per second lately at the widths the width chooser picks (an average over each
    shape's recent cycles, from their measured wall time), trying the other shape every
    `EXPLORE` cycles so that a change (another text, a loaded device) is seen. Each shape
    is tried first: a tree before any is measured."""

    EXPLORE = 8
    KEEP = 0.8  # weight of the past in each shape's average

    def __init__(self) -> None:
        self.rate: dict[bool, float | None] = {False: None, True: None}
        self.cycles = 0

    def tree_next(self) -> bool:
        self.cycles += 1
        for shape in (True, False):
            if self.rate[shape] is None:
                return shape
        best = self.rate[True] > self.rate[False]
        return (not best) if self.cycles % self.EXPLORE == 0 else best

    def observe(self, tree: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate, old = tokens / seconds, self.rate[tree]
        self.rate[tree] = rate if old is None else self.KEEP * old + (1 - self.KEEP) * rate


# -- the tree cycle's steps (`decode` calls them) ------------------------------------------


def tree_mode(
    req: Request, options: GenerateOptions, shapes: ShapeChooser | None, learn_costs: bool
) -> bool | ShapeChooser:
    """Whether this request's speculative cycles verify trees: `options.tree` True (always;
    where a tree cannot be verified, chains, and `req.tree_note` says why), False (never), or
    None: `shapes` (the pair's `ShapeChooser`) picks per cycle from measured speed, where the
    width is chosen too and costs are learnt (a seeded request verifies chains: its shapes
    must not follow wall time)."""
    if options.tree is False or req.draft is None:
        return False
    if options.tree is None and (shapes is None or not learn_costs):
        return False
    why = req.target.tree_support(req.cache)
    if why is None and req.controls is not None and not req.controls.grammar_only:
        # A grammar alone verifies trees (`grammar_tree`: a mask at each node's path).
        why = "penalties, a bias or logprobs (their histories follow chains)"
    if options.tree:
        req.tree_note = why
    if why is not None:
        return False
    if options.tree:
        return True
    return shapes


def propose_tree(
    req: Request,
    anchor: mx.array,
    budget: int,
    rows: int,
    logits: mx.array | None = None,
    hidden: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The tree of `budget` tokens (anchor included), started on the device:
    `(tokens, parents, depths, seen)`. A DFlash 1 draft's from its ranked tokens at each
    block position (`build`); a DFlash 2 draft's from its selector (`selector_tree`).
    `logits` (and `hidden`): the draft's block logits `(rows - 1, V)` (and final hidden
    states) when a batch's draft pass made them (else its own pass runs now)."""
    selector = "candidate_selector" in req.draft
    if logits is None or (selector and hidden is None):
        req.feed_draft()
        if selector:
            hidden = req.draft.block_hidden(anchor, rows, rows - 1, req.state)
            logits = req.draft.logits(hidden, req.state.head).astype(mx.float32)
        else:
            logits = req.draft.block_logits(anchor, rows, rows - 1, req.state)
        req.lazy_rows = 0
    if selector:
        return selector_tree(req.draft.candidate_selector, logits, hidden, anchor, budget)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    k = min(BRANCH, lp.shape[-1])
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)  # best first
    top, vals = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    return build(anchor, vals, top, budget)


def selector_tree(
    selector, logits: mx.array, hidden: mx.array, anchor: mx.array, budget: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """DFlash 2's tree (SPEC 7): the paths its selector would walk, best first. Each node's
    children are the next slot's candidates `C_t` scored by the pair scores given the
    node's own token (`S_t(token, .)`, SPEC 3.2), a path's score the sum of its
    `log softmax_{C_t} S_t`; the `budget - 1` best nodes (`build`). The children are a
    deterministic function of the draft pass, so sampling accepts them with the rule for
    deterministically chosen children (`accept_sampled`): exact whatever the selector's
    subset distribution, which only decides which children are there."""
    cands, table = selector.pair_table(logits, hidden, anchor.reshape(1))
    logp = table - mx.logsumexp(table, axis=-1, keepdims=True)
    return build(anchor, logp, cands.astype(mx.int32), budget)


def grammar_tree(
    req: Request,
    anchor: mx.array,
    budget: int,
    rows: int,
    logits: mx.array | None = None,
    hidden: mx.array | None = None,
    room: int | None = None,
) -> tuple[tuple[mx.array, mx.array, mx.array, mx.array], np.ndarray]:
    """A grammar row's tree (SPEC 6, 7): `budget` nodes (anchor included), and the run the
    grammar forces from the anchor on, each node a token the grammar allows after its
    parent's path; with the grammar's mask at each node's own path `(N, words)`, which
    verification applies to the target's logits there (`node_outputs`). Returns `(tokens,
    parents, depths, seen)` as `propose_tree` does, and the masks.

    Best first on the host, paths scored as `build` scores them. Where the grammar forces a
    token (llguidance's fast-forward tokens, `Grammar.forced`) a node's one child is that
    token, at its parent's score: it needs no draft row and may go `walks.FORCED_BEYOND`
    past the block (not for a draft with cross-block conv rows), and, as a chain's forced
    run past its width, the run forced from the anchor on (before any choice) counts up to
    `FORCED_BEYOND` nodes outside the budget. Elsewhere its children are the draft's
    `BRANCH` likeliest allowed tokens at the next block position (a DFlash 2 draft's: its
    selector's candidates the grammar allows, scored after the node's own token,
    `sampling.MaskedSelector`), each scored by its log-probability among the allowed ones.
    No node is deeper than `room` (the tokens the request has left, but one).

    Each node's mask is computed once, as the node joins the tree: the matcher rolls back
    to the common ancestor of the last node and this one, consumes the rest of its path,
    and is rolled back to the committed tokens at the end. The draft's block is read back
    once, at the first choice (a tree the grammar forces whole runs no draft pass, but a
    conv draft's, whose conv rows are committed). The children are a function of the draft
    pass and the grammar alone, so `accept_sampled`'s rule stays exact on the masked
    target."""
    grammar = req.controls.grammar
    selector = "candidate_selector" in req.draft
    conv = bool(req.state.conv)
    deepest = rows - 1 if conv else rows - 1 + FORCED_BEYOND
    deepest = deepest if room is None else min(deepest, room)
    extra = 0 if conv else FORCED_BEYOND  # certain nodes outside the budget, left
    certain = [True]  # each node's path forced from the anchor on (no choice)
    tokens, parents, depths, scores = [int(anchor.reshape(-1)[0].item())], [-1], [0], [0.0]
    masks, runs = [grammar.mask()], [grammar.forced()]
    at: list[int] = []  # the path the matcher has consumed past the committed tokens
    host = None
    heap: list = []
    pushed = 0

    def path(v: int) -> list[int]:
        out = []
        while v > 0:
            out.append(tokens[v])
            v = parents[v]
        return out[::-1]

    def expand(v: int) -> None:
        nonlocal host, pushed
        if depths[v] >= deepest or (v and tokens[v] in grammar.eos):
            return
        run = runs[v]
        if run and grammar.allows(masks[v], run[0]):
            heapq.heappush(heap, (-scores[v], pushed, v, run[0], (run[1:],)))
            pushed += 1
            return
        if depths[v] >= rows - 1:  # a choice past the draft's rows
            return
        if host is None:  # the tree's one host read of the draft's block
            host = draft_block(req, anchor, rows, rows - 1, logits, hidden)
        allowed = grammar.allowed(masks[v])
        if selector:
            row = host.row(depths[v], tokens[v] if v else None, allowed)
        else:
            row = np.where(allowed, host[depths[v]], -np.inf)
        finite = np.isfinite(row)
        if not finite.any():
            return
        k = min(BRANCH, int(finite.sum()))
        top = np.argpartition(-row, k - 1)[:k]
        top = top[np.argsort(-row[top], kind="stable")]
        lp = row[top] - (row.max() + np.log(np.exp(row[finite] - row.max()).sum()))
        for tok, score in zip(top.tolist(), lp.tolist()):
            heapq.heappush(heap, (-(scores[v] + score), pushed, v, tok, None))
            pushed += 1

    expand(0)
    counted = 1  # nodes in the budget
    while heap and (counted < budget or extra):
        neg, _, parent, tok, forced = heapq.heappop(heap)
        free = extra > 0 and certain[parent] and forced is not None
        if not free and counted >= budget:
            continue
        extra -= free
        counted += not free
        certain.append(certain[parent] and forced is not None)
        rest = forced[0] if forced is not None else None
        v = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(-neg)
        if tok in grammar.eos:  # nothing follows it: its row is unread
            masks.append(np.full_like(masks[0], -1))
            runs.append([])
            continue
        want = path(v)
        common = 0
        while common < min(len(at), len(want)) and at[common] == want[common]:
            common += 1
        grammar.rollback(len(at) - common)
        grammar.consume(want[common:])
        at = want
        masks.append(grammar.mask())
        deeper = depths[v] < deepest
        runs.append(rest if rest else (grammar.forced() if deeper else []))
        expand(v)
    grammar.rollback(len(at))
    if host is None and conv and logits is None:
        # A tree forced whole: its conv rows still come from its pass, which runs (lazily,
        # evaluated with the next pass) but is not read back.
        req.feed_draft()
        req.draft.block_hidden(anchor, rows, rows - 1, req.state)
        req.lazy_rows = 0
    par = mx.array(parents, dtype=mx.int32)
    shape = (
        mx.array(tokens, dtype=mx.int32),
        par,
        mx.array(depths, dtype=mx.int32),
        ancestors(par, max(depths)),
    )
    return shape, np.stack(masks)


def node_outputs(req: Request, logits: mx.array, masks: np.ndarray | None = None) -> mx.array:
    """What a tree's acceptance reads at each node: the target's argmax (greedy) or its
    distribution; under a grammar (`masks` `(N, words)`, `grammar_tree`) of the target's
    logits masked by the grammar at that node's path."""
    if masks is not None:
        logits = mx.where(bits_to_mask(masks, logits.shape[-1]), logits, float("-inf"))
    if req.params.greedy:
        return mx.argmax(logits, axis=-1)
    return probabilities(logits, req.params)


def batch_mask(
    shapes: list[tuple[mx.array, mx.array] | None], lengths: list[int], width: int
) -> tuple[mx.array, mx.array]:
    """A batch's tree pass (SPEC 7, 8): `(B, 1, width, max length + width)` bool, each row's
    fed tokens seeing that row's committed positions and, of its block, what its shape's
    `(seen, depths)` says (a tree's ancestors; None: a chain's causal order), and each fed
    token's depth `(B, width)`. A row's padding (past its nodes) sees causally, so nothing
    it computes is NaN."""
    span = max(lengths) + width
    masks, depths = [], []
    causal = mx.tril(mx.ones((width, width), dtype=mx.bool_))
    for shape, length in zip(shapes, lengths):
        block, depth = causal, mx.arange(width, dtype=mx.int32)
        if shape is not None:
            seen, d = shape
            n = seen.shape[0]
            block = mx.concatenate([mx.pad(seen, [(0, 0), (0, width - n)]), causal[n:]])
            depth = mx.concatenate([d.astype(mx.int32), depth[n:]])
        row = [mx.ones((width, length), dtype=mx.bool_), block]
        if span > length + width:
            row.append(mx.zeros((width, span - length - width), dtype=mx.bool_))
        masks.append(mx.concatenate(row, axis=1))
        depths.append(depth)
    return mx.stack(masks)[:, None], mx.stack(depths)


def read_tree(
    req: Request, shape: tuple[mx.array, mx.array, mx.array], out: mx.array
) -> tuple[list[int], list[int]]:
    """The host sync of a tree cycle: the accepted path (node ids, root first) and the
    tokens it emits, walking the verified tree (`accept_greedy`, `accept_sampled`)."""
    tree = Tree(*(np.array(x) for x in shape))
    a = len(req.generated) - 1  # the anchor's generated index (it is committed by now)
    if req.coupled:
        # The target's own draw at each node, keyed by its position (`coupled_accept`):
        # the walk then follows the child equal to it, as greedy follows the argmax.
        keys = req.keys(PositionKeys.FINAL, a + 1, tree.depth + 1)
        draws = sample_rows(out, keys[mx.array(tree.depths)])
        path, final = accept_greedy(tree, np.array(draws))
    elif req.params.greedy:
        path, final = accept_greedy(tree, np.array(out))
    else:
        host = np.array(out)
        draws = [
            req.keys.uniforms(PositionKeys.ACCEPT, a + 1 + int(d), BRANCH + 1) for d in tree.depths
        ]
        path, final = accept_sampled(tree, host, np.stack(draws))
    return path, [int(t) for t in tree.tokens[path[1:]]] + [final]
