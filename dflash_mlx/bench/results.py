"""What a bench run produced: per-run records, mismatches, summaries and their JSON form.

Pure Python over the `Stats` `benchmark.run_benchmark` measured: no mlx, no models. Each
figure of a summary is computed over all prompts of one repeat (their `Stats` pooled),
then given as median and range over the repeats. The automatic width is also compared with
every fixed choice prompt by prompt (paired ratios, with a confidence interval), which is
how "as fast as the best fixed width" is judged against the noise of one machine.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..stats import Stats

BASELINE = "mlx-lm"  # the name of the plain-decoding run in results
AUTO = "auto"  # a verify width chosen per cycle by the engine


def run_name(width: int | str | None, tree: bool = False) -> str:
    """A run's name in results: BASELINE, AUTO, "W=<width>" (a chain) or "tree=<budget>"
    (trees of that many verified tokens)."""
    if width is None:
        return BASELINE
    if width == AUTO:
        return AUTO
    return f"tree={width}" if tree else f"W={width}"


@dataclass
class RunRecord:
    """One generation: one prompt, one repeat, the baseline or one verify width, and its
    `Stats` (the baseline's: its tokens, times and memory, one plain step per token after
    the first)."""

    suite: str
    prompt_index: int
    repeat: int
    run: str  # BASELINE, "W=<width>", "tree=<budget>" or AUTO
    width: int | str | None  # verify width (a tree's budget), AUTO, or None for the baseline
    stats: Stats
    finish_reason: str | None
    tree: bool = False  # the engine was asked for trees of `width` tokens (tree=True)

    @property
    def ran(self) -> dict[str, Any] | None:
        """What the engine ran (`Stats.what_ran`): cycles and tokens per width, the share
        decoded plainly, probes, the draft's state; None for the baseline."""
        return None if self.width is None else self.stats.what_ran()

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "suite": self.suite,
            "prompt_index": self.prompt_index,
            "repeat": self.repeat,
            "run": self.run,
            "width": self.width,
            "tree": self.tree,
            "prompt_tokens": s.prompt_tokens,
            "prompt_time": s.time_to_first_token,  # seconds from the start to the first token
            "generation_tokens": s.generation_tokens,
            "generation_time": s.decode_seconds,  # seconds from the first token to the last
            "peak_memory": s.peak_memory,  # GB
            "cycles": s.cycles,  # verify passes (the baseline: one per token after the first)
            "accepted_per_position": list(s.accepted_per_position),
            "drafted_per_position": list(s.drafted_per_position),
            "finish_reason": self.finish_reason,
            "ran": self.ran,
        }


@dataclass
class Mismatch:
    """A DFlash run at temperature 0 whose tokens differ from the baseline's."""

    suite: str
    prompt_index: int
    prompt: str
    width: int | str  # verify width (a tree's budget) or AUTO
    repeat: int
    position: int  # first differing generated token, from 0
    expected: int | None  # the baseline's token there (None: the baseline had ended)
    got: int | None  # DFlash's token there (None: DFlash had ended)
    expected_text: str
    got_text: str
    expected_tokens: int
    got_tokens: int
    run: str = ""  # the run's name (`run_name`): says a tree's budget from a chain's width


@dataclass
class Spread:
    """Median and range of one figure over repeats."""

    median: float
    min: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), list(values))


@dataclass
class RunSummary:
    """One run (baseline or width) over a set of prompts; tok/s figures are per repeat."""

    run: str
    width: int | str | None
    generation_tps: Spread  # generated tokens after the first / their time, all prompts
    speedup: Spread  # generation_tps / the baseline's, paired within each repeat
    tau: float  # mean tokens committed per verify pass
    acceptance_rates: list[float]  # per block position 1..W-1: accepted / drafted
    prompt_tps: Spread  # prompt tokens / prefill time, all prompts
    time_to_first_token: Spread  # mean over prompts, seconds
    peak_memory: float  # GB, the largest of any run
    generation_tokens: int  # over all prompts and repeats
    cycles: int
    # The speedup a width would give if the engine cost nothing beyond its passes:
    # tau * t_plain / (t_verify(W) + t_draft(L)) from the calibrated costs at the suite's
    # depth, and the measured speedup as a fraction of it (None: auto, or no costs).
    ideal_speedup: float | None = None
    efficiency: float | None = None
    # Over all its generations: the share of tokens decoded plainly (W = 1), probes made.
    plain_fraction: float | None = None
    probes: int | None = None
    # Trees: whether the run asked for them, the share of its verify passes that verified
    # one (None: the baseline), and why chains ran where trees were asked for.
    tree: bool = False
    tree_fraction: float | None = None
    tree_note: str | None = None


@dataclass
class SuiteSummary:
    suite: str  # a suite name, or "overall"
    prompts: int
    runs: list[RunSummary]


@dataclass
class Comparison:
    """`run` against `other` on the same prompts in the same repeats (adjacent in time):
    the geometric mean of the paired tok/s ratios and its 95% confidence interval."""

    run: str
    other: str
    ratio: float
    low: float
    high: float
    pairs: int


# Two-sided 95% Student t quantiles by degrees of freedom (larger: the next one below).
_T95 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    12: 2.18,
    15: 2.13,
    20: 2.09,
    25: 2.06,
    30: 2.04,
    40: 2.02,
    60: 2.00,
    120: 1.98,
}


def _t95(df: int) -> float:
    return _T95[max(k for k in _T95 if k <= df)] if df < 1000 else 1.96


def compare(records: list[RunRecord], run: str, other: str) -> Comparison | None:
    """Paired comparison of two runs' generation speed; None with fewer than 2 pairs."""
    theirs = {(r.suite, r.prompt_index, r.repeat): r for r in records if r.run == other}
    logs = []
    for r in records:
        o = theirs.get((r.suite, r.prompt_index, r.repeat)) if r.run == run else None
        if o is None:
            continue
        a, b = r.stats.generation_tps, o.stats.generation_tps
        if a > 0 and b > 0:
            logs.append(math.log(a / b))
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = _t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Comparison(
        run, other, math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs)
    )


def auto_comparisons(runs: list[str], records: list[RunRecord]) -> list[Comparison]:
    """The automatic width against every fixed choice (plain mlx-lm included), best first."""
    if AUTO not in runs:
        return []
    found = [compare(records, AUTO, other) for other in runs if other != AUTO]
    return sorted((c for c in found if c is not None), key=lambda c: c.ratio)


@dataclass
class BenchResult:
    environment: dict[str, Any]
    models: dict[str, Any]
    settings: dict[str, Any]
    prompts: list[dict[str, Any]]
    suites: list[SuiteSummary]
    overall: SuiteSummary
    mismatches: list[Mismatch]
    records: list[RunRecord]
    # `auto` against every other run, best other run first (empty without auto).
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def lossless(self) -> bool | None:
        """Whether every DFlash run matched the baseline; None when sampling (temp > 0)."""
        if self.settings["temperature"] > 0:
            return None
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, records=[]))
        out["records"] = [r.to_dict() for r in self.records]
        return {**out, "lossless": self.lossless}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _tree_cycles(s: Stats) -> int:
    return sum(c for c, _ in s.trees.values())


def summarise(
    name: str,
    runs: list[str],
    records: list[RunRecord],
    n_prompts: int,
    cost_ratios: dict[str, float] | None = None,
) -> SuiteSummary:
    """Per run: each figure computed over all prompts of one repeat (their `Stats` pooled),
    then spread over repeats.

    `cost_ratios[run]`: t_plain / (t_verify(W) + t_draft(L)) for a fixed-width run, from which
    its ideal speedup and efficiency are given."""
    repeats = sorted({r.repeat for r in records})
    by_run = {
        run: [[r for r in records if r.run == run and r.repeat == k] for k in repeats]
        for run in runs
    }
    pooled = {
        run: [Stats.total([r.stats for r in g]) for g in groups] for run, groups in by_run.items()
    }
    base = [s.generation_tps for s in pooled[BASELINE]]
    out = []
    for run, groups in by_run.items():
        width, tree = groups[0][0].width, groups[0][0].tree
        tps = [s.generation_tps for s in pooled[run]]
        total = Stats.total(pooled[run])
        speedup = Spread.of([_ratio(t, b) for t, b in zip(tps, base)])
        engine = width is not None  # what ran: this engine's runs only
        ideal = (cost_ratios or {}).get(run)
        ideal = total.tau * ideal if ideal is not None and total.tau > 0 else None
        out.append(
            RunSummary(
                run=run,
                width=width,
                generation_tps=Spread.of(tps),
                speedup=speedup,
                tau=total.tau,
                acceptance_rates=total.acceptance_rates,
                prompt_tps=Spread.of([s.prompt_tps for s in pooled[run]]),
                time_to_first_token=Spread.of(
                    [statistics.mean(r.stats.time_to_first_token for r in g) for g in groups]
                ),
                peak_memory=total.peak_memory,
                generation_tokens=total.generation_tokens,
                cycles=total.cycles,
                ideal_speedup=ideal,
                efficiency=_ratio(speedup.median, ideal) if ideal else None,
                plain_fraction=total.plain_fraction if engine else None,
                probes=total.probes if engine else None,
                tree=tree,
                tree_fraction=_ratio(_tree_cycles(total), total.cycles) if engine else None,
                tree_note=total.tree_note,
            )
        )
    return SuiteSummary(name, n_prompts, out)
