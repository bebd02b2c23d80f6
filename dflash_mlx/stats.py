"""`Stats`: one generation's numbers, defined once.

Tokens, cycles, tau, per-position acceptance, what ran at each verify width, and the prompt
and timing figures. The engine fills one per request (`stream_generate`); responses carry
a copy as of their cycle; the server's `usage` / `timings`, chat's `/stats` and session
totals, and the benchmark read it or `merge` several. "Drafted" and tau are defined here and
nowhere else:
- a verify pass of width W checks `W - 1` drafted tokens (positions 1..W-1 of the block) and
  commits `accepted + 1` tokens (the accepted drafts and the target's own);
- tau is the mean number of tokens committed per verify pass (plain steps included).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Stats:
    """One request's numbers (or, after `merge`, several requests' pooled)."""

    # Prompt and timing.
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from a PromptCache, not prefilled
    time_to_first_token: float = 0.0  # seconds (summed over merged requests)
    generation_tokens: int = 0  # tokens returned, the first one (sampled after prefill) included
    decode_seconds: float = 0.0  # from the first token to the last (summed when merged)
    peak_memory: float = 0.0  # GB, the MLX allocator's peak (0.0: not measured)
    requests: int = 1  # requests pooled here
    # The request's verify width W as asked; None: chosen per cycle.
    verify_width: int | None = None
    # Verify passes (plain steps included) and the tokens they committed (the sum of tau).
    cycles: int = 0
    committed: int = 0
    # Per block position i+1: cycles that drafted it, and that accepted it.
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # What ran: per verify width W (1: a plain step), [cycles, tokens committed]; the
    # speculative cycles the width chooser made as probes (trees among them, counted again
    # in `trees`); the draft at the end: "active",
    # "dormant" (plain steps capture nothing for it) or None (no draft).
    widths: dict[int, list[int]] = field(default_factory=dict)
    probes: int = 0
    draft: str | None = None
    # Tree verification (SPEC 7): per budget (tokens verified), [cycles, tokens committed];
    # and, when trees were asked for but chains ran, why.
    trees: dict[int, list[int]] = field(default_factory=dict)
    tree_note: str | None = None
    # Batched decoding (SPEC 8): per batch size (rows in the verify pass), the cycles of
    # this request that ran in a batch of that size (a request decoded alone: empty).
    batches: dict[int, int] = field(default_factory=dict)

    # -- filling ------------------------------------------------------------------------

    def add(
        self, width: int, accepted: int, tree: bool = False, batch: int = 0, times: int = 1
    ) -> None:
        """One verify pass of `width` tokens that accepted `accepted` drafts (a tree of
        `width` tokens: also counted in `trees`, and not per block position, which are a
        chain's), in a batch of `batch` rows (0: decoded alone, not counted); `times` such
        passes (a stretch of plain steps)."""
        self.cycles += times
        if batch:
            self.batches[batch] = self.batches.get(batch, 0) + times
        self.committed += (accepted + 1) * times
        for table in (self.widths, self.trees) if tree else (self.widths,):
            ran = table.setdefault(width, [0, 0])
            ran[0] += times
            ran[1] += (accepted + 1) * times
        if tree:
            return
        missing = width - 1 - len(self.drafted_per_position)
        if missing > 0:
            self.accepted_per_position += [0] * missing
            self.drafted_per_position += [0] * missing
        for i in range(width - 1):
            self.drafted_per_position[i] += times
            self.accepted_per_position[i] += int(accepted > i) * times

    def copy(self) -> Stats:
        """A snapshot (the lists and the width table copied)."""
        # Every cycle hands one out: a shallow copy, then the mutable fields (not a
        # constructor call per field, which cost a plain step ~40 us).
        out = object.__new__(Stats)
        out.__dict__.update(self.__dict__)
        out.drafted_per_position = list(self.drafted_per_position)
        out.accepted_per_position = list(self.accepted_per_position)
        out.widths = {w: list(v) for w, v in self.widths.items()}
        out.trees = {w: list(v) for w, v in self.trees.items()}
        out.batches = dict(self.batches)
        return out

    def merge(self, other: Stats) -> Stats:
        """Both pooled: counts and seconds summed, tau over all cycles, the later draft state
        and verify width, the higher memory peak."""
        out = self.copy()
        for name in (
            "prompt_tokens",
            "cached_tokens",
            "time_to_first_token",
            "generation_tokens",
            "decode_seconds",
            "requests",
            "cycles",
            "committed",
            "probes",
        ):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.peak_memory = max(self.peak_memory, other.peak_memory)
        out.draft = other.draft if other.cycles else self.draft
        out.verify_width = other.verify_width
        for table, theirs in ((out.widths, other.widths), (out.trees, other.trees)):
            for w, (c, t) in theirs.items():
                ran = table.setdefault(w, [0, 0])
                ran[0] += c
                ran[1] += t
        out.tree_note = other.tree_note or self.tree_note
        for b, c in other.batches.items():
            out.batches[b] = out.batches.get(b, 0) + c
        for i, (a, d) in enumerate(zip(other.accepted_per_position, other.drafted_per_position)):
            if i >= len(out.drafted_per_position):
                out.accepted_per_position.append(0)
                out.drafted_per_position.append(0)
            out.accepted_per_position[i] += a
            out.drafted_per_position[i] += d
        return out

    @classmethod
    def total(cls, many: list[Stats]) -> Stats:
        """All of `many` pooled (no request: zero of everything)."""
        out = cls(requests=0)
        for s in many:
            out = out.merge(s)
        return out

    # -- derived figures -------------------------------------------------------------------

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify pass (0 before the first)."""
        return self.committed / self.cycles if self.cycles else 0.0

    @property
    def drafted(self) -> int:
        """Drafted tokens the target checked: `W - 1` per verify pass."""
        return sum(self.drafted_per_position)

    @property
    def accepted(self) -> int:
        """Drafted tokens the target accepted."""
        return sum(self.accepted_per_position)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_rates(self) -> list[float]:
        """Per block position: the fraction of cycles that drafted it and accepted it."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prompt_tps(self) -> float:
        """Prefill speed over the tokens actually prefilled (to the first token)."""
        t = self.time_to_first_token
        return self.prefilled_tokens / t if t > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens per second after each request's first token (that one is prefill's)."""
        decoded = self.generation_tokens - self.requests
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0

    @property
    def plain_tokens(self) -> int:
        """Tokens committed by plain steps (W = 1)."""
        return self.widths.get(1, [0, 0])[1]

    @property
    def plain_fraction(self) -> float:
        """The fraction of committed tokens decoded plainly (W = 1)."""
        return self.plain_tokens / self.committed if self.committed else 0.0

    def what_ran(self) -> dict[str, Any]:
        """JSON-ready: cycles and tokens per width, plain fraction, probes, draft state."""
        return {
            "widths": {
                str(w): {"cycles": c, "tokens": t} for w, (c, t) in sorted(self.widths.items())
            },
            "plain_fraction": round(self.plain_fraction, 4),
            "probes": self.probes,
            "draft": self.draft,
            "trees": {
                str(b): {"cycles": c, "tokens": t} for b, (c, t) in sorted(self.trees.items())
            },
            "tree_note": self.tree_note,
            "batches": {str(b): c for b, c in sorted(self.batches.items())},
        }

    def to_dict(self) -> dict[str, Any]:
        """Every field and derived figure, JSON-ready."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("widths", "trees", "batches")
        }
        out.update(
            tau=self.tau,
            drafted=self.drafted,
            accepted=self.accepted,
            acceptance_rate=self.acceptance_rate,
            prefilled_tokens=self.prefilled_tokens,
            prompt_tps=self.prompt_tps,
            generation_tps=self.generation_tps,
            plain_tokens=self.plain_tokens,
            ran=self.what_ran(),
        )
        return out


# -- the stats line: one wording for generate, chat, the bench and the server log ---------

SEPARATOR = " · "
SHOWN_WIDTHS = 3  # speculative widths named in a stats line; the rest are counted


def count(n: int, noun: str) -> str:
    """`1 token`, `2 tokens`, `0 probes`."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def speed(tps: float) -> str:
    """Tokens per second as a report shows them: `231.6 tok/s`, `2801 tok/s`."""
    return f"{tps:.0f} tok/s" if tps >= 1000 else f"{tps:.1f} tok/s"


def memory(gb: float) -> str:
    """A memory size: `1.25 GB`, `12 MB`."""
    return f"{gb:.2f} GB" if gb >= 1 else f"{gb * 1000:.0f} MB"


def finish_words(reason: str | None, stop: str | None = None) -> str | None:
    """How a reply ended, in words: `hit max_tokens`, `stop string '\\n\\n'`, `end of text`."""
    if reason == "length":
        return "hit max_tokens"
    if reason == "stop":
        return f"stop string {stop!r}" if stop else "end of text"
    return None if reason is None else reason.replace("_", " ")


def most_used(table: dict[int, list[int]], name: str, noun: str) -> str:
    """The widths (or budgets) of `table` that ran most, `W=4×12, W=3×2` (`name` "W="), the
    rest counted: `(+2 widths)`."""
    ran = sorted(((w, c) for w, (c, _) in table.items()), key=lambda wc: (-wc[1], -wc[0]))
    shown = ", ".join(f"{name}{w}×{c}" for w, c in ran[:SHOWN_WIDTHS])
    more = len(ran) - SHOWN_WIDTHS
    return shown + (f" (+{count(more, noun)})" if more > 0 else "")


def chains_note(note: str) -> str:
    """Why trees were asked for and chains ran, short: `chains only: recurrent layers`
    (the engine's reason without its parenthesis)."""
    return "chains only: " + note.split(" (", 1)[0]


def what_ran(s: Stats) -> list[str]:
    """The mechanism: tau, acceptance, the widths that ran and the trees among them (or why
    chains ran where trees were asked for); `plain decoding` when no draft ran (none
    given, or a fixed width of 1)."""
    if s.draft is None or not s.cycles:
        return ["plain decoding"] if s.draft is None else []
    out = [f"τ {s.tau:.2f}"]
    if s.drafted:
        out.append(f"accepted {s.acceptance_rate:.0%} of drafts")
    spec = {w: ran for w, ran in s.widths.items() if w > 1}
    if not spec:
        out.append("all plain")
    else:
        if round(s.plain_fraction * 100):  # a share that rounds to 0% says nothing
            out.append(f"{s.plain_fraction:.0%} plain")
        out.append(most_used(spec, "W=", "width"))
    if s.trees:  # budget × cycles: the tree cycles among the widths above
        out.append("trees " + most_used(s.trees, "", "budget"))
    if s.tree_note:
        out.append(chains_note(s.tree_note))
    if s.probes:
        out.append(count(s.probes, "probe"))
    if s.batches:  # the largest batch this request's cycles ran in
        out.append(f"batched ≤{max(s.batches)}")
    if s.draft == "dormant" and s.plain_fraction >= 0.5:  # asleep, for most of the tokens
        out.append("draft dormant")
    return out


def short_fields(s: Stats, finish_reason: str | None = None, stop: str | None = None) -> list[str]:
    """The default stats line, in plain words: tokens, speed, τ (tokens per verify pass;
    `plain decoding` without a draft), time to first token and how it ended, e.g.
    `256 tokens · 221.3 tok/s · τ 1.52 · TTFT 24 ms · hit max_tokens` (the details:
    `stats_fields`)."""
    out = [count(s.generation_tokens, "token")]
    if s.generation_tokens > s.requests:  # a speed needs tokens after each first one
        out.append(speed(s.generation_tps))
    if s.draft is None:
        out.append("plain decoding")
    elif s.cycles:
        out.append(f"τ {s.tau:.2f}")
    out.append(f"TTFT {s.time_to_first_token * 1e3:.0f} ms")
    ended = finish_words(finish_reason, stop)
    if ended:
        out.append(ended)
    return out


def stats_fields(s: Stats, finish_reason: str | None = None, stop: str | None = None) -> list[str]:
    """One run's figures (or several pooled) as the detailed fields (`-v`, chat's `/stats`,
    the server log), in order: tokens and speed, the mechanism (tau, acceptance, widths),
    prefill, time to first token, peak memory and how it ended."""
    prefill = f"prefill {count(s.prefilled_tokens, 'token')} @ {speed(s.prompt_tps)}"
    if s.cached_tokens:
        prefill += f" ({s.cached_tokens} reused)"
    out = [count(s.generation_tokens, "token")]
    if s.generation_tokens > s.requests:  # a speed needs tokens after each first one
        out.append(speed(s.generation_tps))
    out += [*what_ran(s), prefill]
    out.append(f"TTFT {s.time_to_first_token * 1e3:.0f} ms")
    if s.peak_memory:
        out.append(f"peak {memory(s.peak_memory)}")
    ended = finish_words(finish_reason, stop)
    if ended:
        out.append(ended)
    return out


def fit(fields: list[str], width: int | None, sep: str = SEPARATOR) -> list[str]:
    """`fields` joined by `sep` into lines of at most `width` columns, broken between fields
    only (a field wider than `width` has a line of its own); `width` None: one line."""
    lines: list[str] = []
    for f in fields:
        if lines and (width is None or len(lines[-1]) + len(sep) + len(f) <= width):
            lines[-1] += sep + f
        else:
            lines.append(f)
    return lines
