"""The port between the engine and its speed policy (docs/cost-model.md#automatic-width).

The engine imports this module only. A policy `begin`s a request (a `Ticket`: that row's own
evidence), `plan`s a batch's next cycle from what each row asks (`Ask`) and answers a `Plan`
(each row's verify width W and draft block L, whether plain passes capture features for the
draft, and for how many plain steps the plan stands), `learn`s from what one cycle did
(`Record`: its shape, seconds and each row's acceptance) and `forget`s what requests taught.
`plan` changes nothing; only `learn` does. A request that fixes its width asks no policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(eq=False)
class Ticket:
    """One request's row in a policy: its text's acceptance per drafted position (decayed
    trials and hits), what the policy did with it (for the request's stats)."""

    trials: list[float]
    hits: list[float]
    tokens: int | None = None  # tokens the request may decode
    probes: int = 0  # speculative cycles made to look, not expected to pay
    capture: bool = True  # whether its latest plan kept the draft's context current


@dataclass(frozen=True)
class Ask:
    """What the policy is told of a row before a cycle: its context `depth`, the tokens it
    has `left`, and what a speculative cycle would first catch its draft's context up on
    (`behind`: rows decoded plainly, of which `lazy` were never computed for the draft)."""

    ticket: Ticket
    depth: int
    left: int
    behind: int = 0
    lazy: int = 0


@dataclass(frozen=True)
class Plan:
    """The next cycle: W and L per asked row (W = 1: a plain step), whether plain passes
    capture the draft's features, whether it is a probe, and how many plain steps after it
    the same plan stands (so that a stretch of plain steps pays for no decision)."""

    widths: tuple[int, ...]
    blocks: tuple[int, ...]
    capture: bool = True
    probe: bool = False
    stands: int = 0


@dataclass(frozen=True)
class Record:
    """What one cycle did: `asks` and the `widths` they ran (padded to the widest in one
    pass: `block` rows drafted each), `accepted` drafts per row, at `depth`, taking `seconds`
    sync to sync (None: not a measurement), `times` plain steps of that many seconds each, and
    the draft context caught up first (`caught` rows, `lazy` of them, in `caught_seconds`)."""

    asks: tuple[Ask, ...]
    widths: tuple[int, ...]
    accepted: tuple[int, ...]
    depth: int
    seconds: float | None
    block: int = 0
    times: int = 1
    rows: int = 0  # rows in the pass (fixed-width rows too; 0: len(asks))
    caught: int = 0
    lazy: int = 0
    caught_seconds: float = 0.0
    probe: bool = False
    costs: bool = True  # whether its seconds may teach costs (not a seeded request's)


class Policy(Protocol):
    block: int  # the widest W
    window: int  # draft context a dormant row keeps (what a probe soon after reads)

    def begin(self, tokens: int | None) -> Ticket: ...

    def plan(self, asks: list[Ask], rows: int = 0) -> Plan: ...

    def learn(self, record: Record) -> None: ...

    def forget(self) -> None: ...
