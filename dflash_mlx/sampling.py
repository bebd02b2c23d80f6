"""Target/draft distributions and the acceptance rules (SPEC 4).

Owns: turning logits into the exact distribution a request samples from (top-k / top-p /
min-p truncation with mlx-lm's own filters, then temperature), greedy prefix matching, and
speculative rejection sampling. Everything stays on the device; callers read back only the
accepted count and the tokens. Knows nothing about models or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature!r} must be a number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r} must be in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k {self.top_k!r} must be an integer >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p {self.min_p!r} must be in [0, 1]")

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


def rejection_accept(
    drafts: mx.array, q: mx.array, p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling over one verified block.

    `drafts` (W-1,) were drawn from `q` (W-1, V); `p` (W, V) is the target distribution at
    the anchor and at each draft. Accept `d_i` with probability `min(1, p_{i-1}(d_i) /
    q_i(d_i))`; at the first rejection draw from `normalize(max(0, p_{i-1} - q_i))` (or
    `p_{i-1}` when that has no mass); after W-1 acceptances draw a bonus from `p_{W-1}`.
    Returns `(n, token)`: emit `drafts[:n]` then `token`.
    """
    k_accept, k_final = mx.random.split(key)
    W = p.shape[0]
    if W == 1:
        return mx.array(0), sample(p[0], k_final)
    rows = mx.arange(W - 1)
    p_d = p[rows, drafts]
    q_d = q[rows, drafts]
    u = mx.random.uniform(shape=(W - 1,), key=k_accept)
    accept = (u * q_d < p_d).astype(mx.int32)  # u < p/q without dividing by q
    n = mx.cumprod(accept).sum()
    residual = mx.maximum(p[:-1] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 1e-9, residual / mx.maximum(mass, 1e-30), p[:-1])
    final = mx.concatenate([residual, p[-1:]], axis=0)  # row i: where we stop after i accepts
    return n, sample(final[n], k_final)
