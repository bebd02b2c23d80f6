"""What `bench --concurrency` produced: each request's times, each mode's runs, the rows of
its table, mismatches, and their JSON form.

Pure Python over what `bench_concurrency.run_concurrency` measured: no mlx, no models. A
row's figures are computed per repeat (over that run's N requests), then given as median and
range over the repeats, like `bench_results`' summaries.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..stats import Stats
from .results import Spread

SERIAL, BATCHED, LATE = "serial", "batched", "late"
MODES = (SERIAL, BATCHED)  # every N; LATE (one request joining a running batch) on request


@dataclass
class RequestRecord:
    """One request of one measured run: its tokens and its times from its arrival (with all
    N, or, the late one of a LATE run, when it came)."""

    slot: int  # its place among the N requests (their prompts, in order)
    suite: str
    prompt_index: int
    tokens: list[int] = field(repr=False)
    first: float  # seconds from the arrival to its first response (TTFT)
    last: float  # seconds from the arrival to its last response
    finish_reason: str | None
    stats: Stats = field(repr=False)

    @property
    def tps(self) -> float:
        """Its tokens over its own time from the arrival to its last token."""
        return len(self.tokens) / self.last if self.last > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "suite": self.suite,
            "prompt_index": self.prompt_index,
            "tokens": len(self.tokens),
            "ttft": self.first,
            "seconds": self.last,
            "tps": self.tps,
            "finish_reason": self.finish_reason,
            "ran": self.stats.what_ran(),
        }


@dataclass
class ModeRun:
    """One mode (serial, batched or late) at one concurrency N in one repeat."""

    run: str  # the width's name (`bench_results.run_name`): AUTO or "W=<width>"
    concurrency: int
    mode: str  # SERIAL, BATCHED or LATE
    repeat: int
    seconds: float  # from the arrival of the (first) requests to the last token of any
    requests: list[RequestRecord]
    batches: dict[int, int]  # batch size -> decoder cycles at it (serial: {})
    arrived: float | None = None  # LATE: seconds after the others that the last one came

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def aggregate_tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_request_tps(self) -> float:
        return statistics.fmean(r.tps for r in self.requests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "concurrency": self.concurrency,
            "mode": self.mode,
            "repeat": self.repeat,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "aggregate_tps": self.aggregate_tps,
            "per_request_tps": self.per_request_tps,
            "batches": {str(k): v for k, v in sorted(self.batches.items())},
            "arrived": self.arrived,
            "requests": [r.to_dict() for r in self.requests],
        }


@dataclass
class ConcurrencyRow:
    """One mode at one N over the repeats: each figure's median and range. TTFT and
    per-request tok/s run from each request's own arrival."""

    run: str
    concurrency: int
    mode: str
    max_batch: int | None  # the decoder's (None: serial)
    aggregate_tps: Spread
    per_request_tps: Spread
    ttft_mean: Spread  # seconds
    ttft_max: Spread  # seconds
    tau: float  # over every request of every repeat
    tokens: int  # over every repeat
    batches: dict[int, int]  # batch size -> decoder cycles, every repeat
    vs_serial: Spread | None  # aggregate tok/s over serial's, paired by repeat (batched only)
    late_ttft: Spread | None = None  # LATE: the late request's TTFT from its own arrival

    @property
    def mean_batch(self) -> float | None:
        """Rows per decoder cycle, over all cycles (None: serial)."""
        cycles = sum(self.batches.values())
        return sum(b * c for b, c in self.batches.items()) / cycles if cycles else None


@dataclass
class ConcurrencyMismatch:
    """A batched request at temperature 0 whose tokens differ from its serial run's."""

    run: str
    concurrency: int
    repeat: int
    slot: int
    suite: str
    prompt_index: int
    prompt: str
    position: int  # first differing generated token, from 0
    expected: int | None  # serial's token there (None: serial had ended)
    got: int | None  # batched's token there (None: batched had ended)
    expected_text: str
    got_text: str
    expected_tokens: int
    got_tokens: int
    mode: str = BATCHED  # BATCHED, or LATE: the request joined a running batch


@dataclass
class ConcurrencyResult:
    environment: dict[str, Any]
    models: dict[str, Any]
    settings: dict[str, Any]
    prompts: list[dict[str, Any]]
    rows: list[ConcurrencyRow]
    mismatches: list[ConcurrencyMismatch]
    runs: list[ModeRun]

    @property
    def lossless(self) -> bool | None:
        """Whether every batched request matched its serial run; None when sampling."""
        if self.settings["temperature"] > 0:
            return None
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["batches"] = {str(k): v for k, v in sorted(r.batches.items())}
            d["mean_batch"] = r.mean_batch
            rows.append(d)
        return {
            "environment": self.environment,
            "models": self.models,
            "settings": self.settings,
            "prompts": self.prompts,
            "rows": rows,
            "mismatches": [asdict(m) for m in self.mismatches],
            "lossless": self.lossless,
            "runs": [r.to_dict() for r in self.runs],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")


def summarise(runs: list[ModeRun], max_batch: int | None = None) -> list[ConcurrencyRow]:
    """One row per width, N and mode (serial first), each figure over the repeats."""
    keys = list(dict.fromkeys((r.run, r.concurrency) for r in runs))
    rows = []
    for name, n in keys:
        group = {
            m: [r for r in runs if (r.run, r.concurrency, r.mode) == (name, n, m)]
            for m in (*MODES, LATE)
        }
        serial = {r.repeat: r.aggregate_tps for r in group[SERIAL]}
        for mode in (*MODES, LATE):
            mine = group[mode]
            if not mine:
                continue
            sizes: dict[int, int] = {}
            for r in mine:
                for b, c in r.batches.items():
                    sizes[b] = sizes.get(b, 0) + c
            ratios = [
                r.aggregate_tps / serial[r.repeat] for r in mine if serial.get(r.repeat, 0) > 0
            ]
            rows.append(
                ConcurrencyRow(
                    run=name,
                    concurrency=n,
                    mode=mode,
                    max_batch=(max_batch or n) if mode != SERIAL else None,
                    aggregate_tps=Spread.of([r.aggregate_tps for r in mine]),
                    per_request_tps=Spread.of([r.per_request_tps for r in mine]),
                    ttft_mean=Spread.of(
                        [statistics.fmean(q.first for q in r.requests) for r in mine]
                    ),
                    ttft_max=Spread.of([max(q.first for q in r.requests) for r in mine]),
                    tau=Stats.total([q.stats for r in mine for q in r.requests]).tau,
                    tokens=sum(r.tokens for r in mine),
                    batches=dict(sorted(sizes.items(), reverse=True)),
                    vs_serial=Spread.of(ratios) if mode == BATCHED and ratios else None,
                    late_ttft=(
                        Spread.of([r.requests[-1].first for r in mine]) if mode == LATE else None
                    ),
                )
            )
    return rows
