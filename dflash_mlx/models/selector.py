"""DFlash 2's candidate selector: bilinear pair scores and the walk (SPEC 3.2).

For mask slot t with draft logits `U_t`, candidates `C_t = top-k(U_t)` and the draft's final
normed hidden state `h_t`, a successor `b` following a predecessor `a` scores
`S_t(a, b) = U_t(b) + sum_r A(a)_r H(h_t)_r B(b)_r`. All k x k pair scores of every slot are
computed in one batched pass; only the walk over the table is sequential, and it lives with
the other draws in `sampling.selector_walk` (which returns the proposal distribution over
the full vocabulary, candidate indices mapped back to token ids, so rejection sampling
stays exact). Knows nothing about the draft's layers or caches.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, rank: int, hidden: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = mx.zeros((vocab, rank))
        self.successor_codebook = mx.zeros((vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def pair_table(
        self, logits: mx.array, hidden: mx.array, anchor: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Candidates `(T, k)` and scores `(T, k, k)`: `table[t, i, j] = S_t(pred_i, C_t[j])`.

        logits: (T, V) float32 for slots 1..T; hidden: (T, D); anchor: (1,) token id. The
        predecessors of slot 1 are all the anchor; those of slot t > 1 are `C_{t-1}`.
        """
        T, V = logits.shape
        k = min(self.top_k, V)
        cands = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]  # (T, k) token ids
        u = mx.take_along_axis(logits, cands, axis=-1)  # (T, k)
        preds = mx.concatenate([mx.broadcast_to(anchor.reshape(1, 1), (1, k)), cands[:-1]])
        a = self.predecessor_codebook[preds].astype(mx.float32)  # (T, k, r)
        b = self.successor_codebook[cands].astype(mx.float32)  # (T, k, r)
        h = self.hidden_projection(hidden).astype(mx.float32)  # (T, r)
        pair = (a * h[:, None]) @ b.transpose(0, 2, 1)  # (T, k, k)
        return cands, u[:, None, :] + pair
