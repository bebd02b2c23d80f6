"""Target/draft distributions and the acceptance rules (SPEC 4).

Owns: turning logits into the exact distribution a request samples from (top-k / top-p /
min-p truncation with mlx-lm's own filters, then temperature), the random keys of a seeded
request (one per generated position and purpose: `PositionKeys`), drawing the draft's
proposals (`propose`, including DFlash 2's selector walk), greedy prefix matching, and
speculative rejection sampling. Everything stays on the device; callers read back only the
accepted count and the tokens. Models are called, never changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    """The sampling part of a request's `GenerateOptions` (`options.sampling`), which
    checked these values once; not checked again here."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution `p` a request samples from, rows over the last axis, float32.

    Truncation runs on the untempered log-probabilities in mlx-lm's order (top-p, min-p,
    top-k), then the temperature, so a token drawn here is distributed exactly as mlx-lm's
    own sampler with the same settings would draw it.
    """
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    vocab = logprobs.shape[-1]
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    return mx.softmax(logprobs * (1.0 / params.temperature), axis=-1)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One draw per row of `probs`."""
    return mx.random.categorical(mx.log(probs), key=key)


def sample_rows(probs: mx.array, keys: mx.array) -> mx.array:
    """One draw from each row `i` of `probs` `(n, V)` with its own key `keys[i]`."""
    if probs.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.int32)
    return mx.stack([sample(probs[i], keys[i]) for i in range(probs.shape[0])])


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PositionKeys:
    """The random keys of one seeded request, one per (generated position, purpose).

    The draw that decides generated position `i` (the draft's proposal for it, the
    acceptance test of that proposal, or the target's own token there) uses a key that is
    a function of the seed, `i` and the purpose alone: never of which cycle, width or
    earlier draw it falls in (SPEC 4). Keys are threefry keys (two uint32) built on the host.
    """

    DRAFT, ACCEPT, FINAL = 1, 2, 3

    def __init__(self, seed: int):
        self.seed = seed
        self._base = _mix(int(seed) & _MASK64)

    def uniforms(self, purpose: int, position: int, n: int) -> np.ndarray:
        """`n` draws in [0, 1) on the host for generated `position` and `purpose` (a tree
        node's child tests), a function of the seed, the position and the draw's index."""
        x = _mix(self._base ^ _mix(4 * position + purpose))
        return np.array([(_mix(x ^ _mix(j + 1)) >> 11) / float(1 << 53) for j in range(n)])

    def __call__(self, purpose: int, start: int, n: int) -> mx.array:
        """Keys `(n, 2)` for positions `start .. start + n - 1`."""
        out = []
        for i in range(start, start + n):
            x = _mix(self._base ^ _mix(4 * i + purpose))
            out.append([x >> 32, x & 0xFFFFFFFF])
        return mx.array(out, dtype=mx.uint32).reshape(n, 2)


def propose(
    draft,
    state,
    anchor: mx.array,
    length: int,
    rows: int,
    params: SamplingParams,
    keys,
    process: Callable[[mx.array], mx.array] | None = None,
    block: tuple[mx.array, mx.array] | None = None,
) -> tuple[mx.array, mx.array | None]:
    """The draft's tokens for block indices `1..rows` and, when sampling, the distributions
    `q` `(rows, V)` they were drawn from (SPEC 4). `keys` `(rows, 2)`: one per row.
    `process` changes the draft's logits first (a request's penalties and bias). `block`:
    the block's `(hidden, logits)` from a batch's draft pass (at least `rows` rows), else
    the draft runs now."""
    if block is not None:
        h, logits = block[0][:rows], block[1][:rows]
    elif "candidate_selector" in draft:
        h = draft.block_hidden(anchor, length, rows, state)
        logits = draft.logits(h, state.head).astype(mx.float32)
    else:
        h, logits = None, draft.block_logits(anchor, length, rows, state)
    if process is not None:
        logits = process(logits)
    if "candidate_selector" in draft:
        return selector_walk(draft.candidate_selector, logits, h, anchor, params.temperature, keys)
    if params.greedy:
        return mx.argmax(logits, axis=-1), None
    q = probabilities(logits, params)
    return sample_rows(q, keys), q


def selector_walk(
    selector,
    logits: mx.array,
    hidden: mx.array,
    anchor: mx.array,
    temperature: float = 0.0,
    keys: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """DFlash 2's walk (SPEC 3.2): proposals `(T,)` and, when sampling, their `q` `(T, V)`.

    Greedy takes `argmax_b S_t(prev, b)`; sampling draws from
    `softmax_b(S_t(prev, b) / temperature)` over the candidates, slot `t` with `keys[t]`.
    """
    cands, table = selector.pair_table(logits, hidden, anchor)
    T, k = cands.shape
    idx = mx.array(0)  # slot 1's predecessor rows are all the anchor
    picks, probs = [], []
    for t in range(T):
        row = table[t, idx]  # (k,)
        if temperature > 0:
            scaled = row / temperature
            probs.append(mx.softmax(scaled))
            idx = mx.random.categorical(scaled, key=keys[t])
        else:
            idx = mx.argmax(row)
        picks.append(idx)
    picks = mx.stack(picks)
    tokens = mx.take_along_axis(cands, picks[:, None], axis=-1)[:, 0]
    if temperature == 0:
        return tokens, None
    q = mx.put_along_axis(
        mx.zeros((T, logits.shape[-1]), dtype=mx.float32), cands, mx.stack(probs), axis=-1
    )
    return tokens, q


class MaskedSelector:
    """DFlash 2's selector walked within a grammar, on the host (SPEC 3.2, 6).

    The grammar's walk (`walks.walk_grammar`) chooses the block's tokens one by one, the
    tokens a grammar forces among them, so a slot's predecessor may be any token, not only
    one of the previous slot's candidates: `row(t, prev, allowed)` scores slot `t`'s
    candidates after `prev` with the selector's own `S_t(prev, b) = U_t(b) + A(prev) .
    H(h_t) . B(b)` and keeps those the grammar `allows`; where none of them is allowed, the
    draft's own row `U_t` masked by the grammar. One host read of the block (candidates,
    their scores' factors and the logits) when built; a predecessor outside the candidates
    (a forced token) costs one small read of its codebook row, kept.

    The row is what the proposal is drawn from: greedily its argmax, sampling
    `softmax(row)` (the row is divided by the temperature), which is then the proposal's `q`
    in acceptance, a distribution on allowed tokens only (exact for any such `q`, SPEC 4)."""

    def __init__(self, selector, logits: mx.array, hidden: mx.array, anchor: mx.array):
        T, V = logits.shape
        k = min(selector.top_k, V)
        cands = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]  # (T, k)
        u = mx.take_along_axis(logits, cands, axis=-1)
        h = selector.hidden_projection(hidden).astype(mx.float32)  # (T, r)
        hb = h[:, None] * selector.successor_codebook[cands].astype(mx.float32)  # (T, k, r)
        codebook = selector.predecessor_codebook
        pred = codebook[mx.concatenate([anchor.reshape(-1)[:1], cands.reshape(-1)])]
        got = [cands, u, hb, pred.astype(mx.float32), logits, anchor.reshape(-1)[:1]]
        mx.eval(*got)
        cands, u, hb, pred, logits, first = (np.array(x) for x in got)
        self.cands, self.u, self.hb = cands, u.astype(np.float64), hb.astype(np.float64)
        self.logits = logits.astype(np.float64)
        self.codebook = codebook
        flat = [int(first[0])] + cands.reshape(-1).tolist()
        self.pred = dict(zip(flat, pred.astype(np.float64), strict=True))
        self.anchor = int(first[0])

    def _a(self, token: int) -> np.ndarray:
        a = self.pred.get(token)
        if a is None:
            a = self.pred[token] = np.array(self.codebook[token].astype(mx.float32), np.float64)
        return a

    def row(
        self, t: int, prev: int | None, allowed: np.ndarray, temperature: float = 0.0
    ) -> np.ndarray:
        """Slot `t`'s logits `(V,)` after `prev` (None: the anchor) over the `allowed`
        tokens (`(V,)` bool), -inf elsewhere; divided by `temperature` when sampling."""
        cands = self.cands[t]
        ok = allowed[cands]
        out = np.full(self.logits.shape[1], -np.inf)
        if ok.any():
            scores = self.u[t] + self.hb[t] @ self._a(self.anchor if prev is None else prev)
            out[cands[ok]] = scores[ok]
        else:  # none of the candidates is allowed: the draft's own row within the grammar
            out = np.where(allowed, self.logits[t], -np.inf)
        return out / temperature if temperature > 0 else out


def greedy_accept(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Longest prefix of `drafts` (W-1,) equal to the target's argmax (W, V).

    Returns `(n, tokens)`: the emitted tokens are `tokens[: n + 1]` (the accepted drafts equal
    the target's argmax, followed by the target's own token at index n).
    """
    tokens = mx.argmax(target_logits, axis=-1)
    if drafts.size == 0:
        return mx.array(0), tokens
    match = (drafts == tokens[:-1]).astype(mx.int32)
    return mx.cumprod(match).sum(), tokens


def coupled_accept(
    drafts: mx.array, p: mx.array, final_keys: mx.array
) -> tuple[mx.array, mx.array]:
    """A seeded request's acceptance: the token at each verified position is the target's
    own draw there, `sample(p_i, key)` (a Gumbel-max draw, `argmax(log p_i + g)`) with the
    key of that generated position, and drafts are accepted while they equal those draws.

    Each emitted token is a draw from the target's distribution given the tokens before it,
    with noise that depends on the seed and the position alone, so the reply is the one
    plain decoding with that seed gives, whatever the widths, trees, batch or draft (a
    draft proposing with the same keys, `argmax(log q_i + g)`, agrees with it more often).
    `p` `(W, V)`, `final_keys` `(W, 2)`. Returns `(n, tokens)`: emit `tokens[: n + 1]`."""
    tokens = sample_rows(p, final_keys).astype(mx.int32)
    if drafts.size == 0:
        return mx.array(0), tokens
    match = (drafts == tokens[:-1]).astype(mx.int32)
    return mx.cumprod(match).sum(), tokens


def rejection_accept(
    drafts: mx.array, q: mx.array, p: mx.array, accept_keys: mx.array, final_keys: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling over one verified block.

    `drafts` (W-1,) were drawn from `q` (W-1, V); `p` (W, V) is the target distribution at
    the anchor and at each draft. Accept `d_i` with probability `min(1, p_{i-1}(d_i) /
    q_i(d_i))`; at the first rejection draw from `normalize(max(0, p_{i-1} - q_i))` (or
    `p_{i-1}` when that has no mass); after W-1 acceptances draw a bonus from `p_{W-1}`.
    `accept_keys[i]` (W-1, 2) draws the test of `d_{i+1}`, `final_keys[n]` (W, 2) the token
    after `n` acceptances. Returns `(n, token)`: emit `drafts[:n]` then `token`.
    """
    W = p.shape[0]
    if W == 1:
        return mx.array(0), sample(p[0], final_keys[0])
    rows = mx.arange(W - 1)
    p_d = p[rows, drafts]
    q_d = q[rows, drafts]
    u = mx.stack([mx.random.uniform(key=accept_keys[i]) for i in range(W - 1)])
    accept = (u * q_d < p_d).astype(mx.int32)  # u < p/q without dividing by q
    n = mx.cumprod(accept).sum()
    residual = mx.maximum(p[:-1] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 1e-9, residual / mx.maximum(mass, 1e-30), p[:-1])
    final = mx.concatenate([residual, p[-1:]], axis=0)  # row i: where we stop after i accepts
    return n, sample(final[n], final_keys[n])
