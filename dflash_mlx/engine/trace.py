"""What the engine tells an optional sink (`BatchDecoder.trace`), and the clock it times
cycles by (`BatchDecoder.clock`): benchmarks and tests read events instead of patching
internals, and a simulated device charges each pass what its cost table says while tokens,
acceptance and decisions stay real (`dflash_mlx.bench.profiles`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Event:
    """One thing the engine did. Passes launched: `prefill` (`tokens` of a prompt), `plain`
    (a step of `rows` rows), `draft` (`rows` rows of a `block`-row block), `verify` (`rows`
    rows, `tokens` in all), `catch-up` (`tokens` context rows fed to dormant drafts). Then
    `plan` (`detail`: the policy's `Plan`) and `learn` (`detail`: the `Record` learnt).
    `depth`: the context depth the pass ran at."""

    kind: str
    rows: int = 0
    tokens: int = 0
    depth: int = 0
    block: int = 0
    detail: Any = None


class Clock(Protocol):
    def now(self) -> float: ...

    def charge(self, event: Event) -> None: ...
