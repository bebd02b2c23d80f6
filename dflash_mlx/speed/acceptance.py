"""The width chooser's acceptance (SPEC 5.4): running, exponentially decayed per-position
statistics of drafted tokens accepted, and `E[accepted + 1 | W]` from them. A mixin of
`WidthChooser` (`adaptive.py`), whose constructor sets the fields it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .adaptive import WidthChooser

# Cycles' worth of acceptance evidence a new request starts from (`Acceptance.as_prior`).
REQUEST_MEMORY = 4.0


class Acceptance:
    """What the chooser knows of the draft's acceptance, and how each cycle teaches it."""

    def read_acceptance(self, base: WidthChooser) -> None:
        """Take the acceptance `base` has learnt as this chooser's (a batch's chooser prices
        its own costs, but acceptance belongs to the draft and the texts, not to the batch
        size): pooled over several texts, so no row's first cycle drops it (`pooled`)."""
        self.trials, self.hits = list(base.trials), list(base.hits)
        self.pooled()
        self._acc_version += 1
        self._coast = 0

    def pooled(self) -> None:
        """What `update` is taught next comes from several texts at once (a batch's rows):
        one of them falling short of what earlier texts promised says that its text
        differs, not that the others' evidence is stale, so nothing carried is dropped."""
        self.carried = False

    def acceptance(self) -> list[float]:
        """alpha_j = P(position j accepted | positions < j accepted), j = 1..block-1.

        Each position is smoothed towards the estimate of the position before it, or the
        pooled estimate of all positions when that is higher: positions little tried
        borrow the evidence optimistically, so that one unlucky estimate does not keep the
        width below them forever (wider cycles then try them, and their own evidence wins).
        """
        s = self.prior_strength
        pooled = (sum(self.hits) + s * self.prior) / (sum(self.trials) + s)
        alphas, prev = [], self.prior
        for j in range(1, self.block):
            anchor = prev if j == 1 else max(prev, pooled)
            a = (self.hits[j] + s * anchor) / (self.trials[j] + s)
            alphas.append(a)
            prev = a
        return alphas

    def expected_tokens(self) -> list[float]:
        """`E[accepted + 1 | W]` for W = 1..block."""
        out, reach, total = [1.0], 1.0, 1.0
        for a in self.acceptance():
            reach *= a
            total += reach
            out.append(total)
        return out

    def update(self, width: int, accepted: int) -> None:
        """Learn from a cycle that verified `width` tokens and accepted `accepted` drafts."""
        if width <= 1:
            return
        self._coast = 0  # new evidence of acceptance: decided anew
        if self.carried:
            # The request's first speculative cycle: when it falls well short of what
            # earlier requests' texts promised, this text is not theirs; what they taught
            # goes (the prior remains), instead of a cycle of loss at a time.
            self.carried = False
            if accepted < 0.5 * (self.expected_tokens()[width - 1] - 1.0):
                self.trials, self.hits = [0.0] * self.block, [0.0] * self.block
        self._acc_version += 1
        self.trials, self.hits = teach(
            (self.trials, self.hits), width, accepted, self.block, self.decay
        )
        if accepted < width - 1:
            self.follow_up = 0  # a rejected draft since: no follow-up promised
        if self.probing:
            self._probed(width, accepted == width - 1)

    def resume_rows(self, taught: list[tuple[list[float], list[float]]]) -> None:
        """A batch lost rows: from now on its acceptance is what the texts of the rows left
        taught (`teach`, each row's own `(trials, hits)`, summed) on top of the pool of
        every text as a prior worth `REQUEST_MEMORY` cycles (as a request alone starts
        from, `begin_request`). The rows that draft well end first, and the pool they made
        would go on promising their acceptance to the rows left (a wave's last row alone,
        on the demo pair, verified 16 tokens a cycle for 0-1 each, 12 cycles). Rows that
        taught nothing yet leave the pool as it is."""
        taught = [t for t in taught if t is not None and t[0][1] > 0]
        if not taught:
            return
        self.as_prior()
        self.trials = [x + sum(t[0][j] for t in taught) for j, x in enumerate(self.trials)]
        self.hits = [x + sum(t[1][j] for t in taught) for j, x in enumerate(self.hits)]
        self._acc_version += 1
        self._coast = 0

    def as_prior(self) -> None:
        """What earlier texts taught, kept only as a prior worth `REQUEST_MEMORY` cycles."""
        seen = self.trials[1] if self.block > 1 else 0.0
        if seen > REQUEST_MEMORY:
            keep = REQUEST_MEMORY / seen
            self.trials = [t * keep for t in self.trials]
            self.hits = [h * keep for h in self.hits]
            self._acc_version += 1

    def update_rows(self, cycles: list[tuple[int, int]], chose: bool = True) -> None:
        """Learn from one cycle of several rows, `(width, accepted)` each: every row's
        acceptance, and (when this chooser `chose` the cycle's width) the probe's outcome
        once, for the cycle: a follow-up only when every row's drafts were all accepted."""
        probing, self.probing = self.probing, False
        for width, accepted in cycles:
            self.update(width, accepted)
        self.probing = probing
        if probing and chose and cycles:
            self._probed(max(w for w, _ in cycles), all(n == w - 1 for w, n in cycles))


def teach(
    taught: tuple[list[float], list[float]] | None,
    width: int,
    accepted: int,
    block: int,
    decay: float,
) -> tuple[list[float], list[float]]:
    """One row's own acceptance `(trials, hits)` per position (as `Acceptance.update` keeps
    the chooser's), after a cycle that verified `width` tokens and accepted `accepted`."""
    trials, hits = taught if taught is not None else ([0.0] * block, [0.0] * block)
    trials = [t * decay for t in trials]
    hits = [h * decay for h in hits]
    for j in range(1, min(accepted + 1, width - 1) + 1):
        trials[j] += 1.0
        if j <= accepted:
            hits[j] += 1.0
    return trials, hits
