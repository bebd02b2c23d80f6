"""What `dflash-mlx bench` shows: progress, the results table, the per-position acceptance
chart and the losslessness verdict.

The report goes to stdout; progress and notes go to stderr. Renders a `BenchResult` (read
through its fields only); knows nothing about models.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # the library imports mlx: only for type checkers, never at run time
    from dflash_mlx.bench.results import BenchResult, RunSummary, SuiteSummary

BAR = 32  # characters of a full acceptance bar
LISTED_MISMATCHES = 20


def _out() -> Console:
    # Built per call: sys.stdout may be swapped (test runners, redirection) after import.
    return Console(highlight=False)


def _err() -> Console:
    return Console(stderr=True, highlight=False)


def demo_note(notice: str, folder: Path) -> None:
    _err().print(Text.assemble(("demo: ", "bold yellow"), (f"{notice} ({folder})", "yellow")))


class BenchProgress:
    """The benchmark's `progress(done, total, what)` callback: one bar on stderr, or when
    stderr is no terminal (a log, a pipe) plain lines: the first run, about every 5% of the
    runs, and the last."""

    LINES = 20  # plain lines over a whole bench, about

    def __init__(self) -> None:
        self._bar: Progress | None = None
        self._task = None
        self._start = time.monotonic()

    def __call__(self, done: int, total: int, what: str) -> None:
        console = _err()
        if not console.is_terminal:
            step = max(1, -(-total // self.LINES))
            if done in (1, total) or done % step == 0:
                elapsed = time.monotonic() - self._start
                console.print(
                    f"bench: {done}/{total} runs · {what} · {elapsed:.0f} s", soft_wrap=True
                )
            return
        if self._bar is None:
            self._bar = Progress(
                TextColumn("bench"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("runs"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("[dim]{task.description}"),
                console=_err(),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(what, total=total)
        self._bar.update(self._task, completed=done, description=escape(what))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _quant(q: dict | None) -> str:
    if not q:
        return "unquantized"
    if "mixed" in q:
        return "mixed quantization"
    return f"{q['bits']}-bit, group {q['group_size']}"


def _header(result: BenchResult, quick: str | None) -> Text:
    env, models, s = result.environment, result.models, result.settings
    device = ", ".join(str(x) for x in (env["device_info"].get("device_name"), env["machine"]) if x)
    per_suite = ", ".join(f"{x.suite} {x.prompts}" for x in result.suites)
    repeats = s["repeats"]
    how = (
        "one run each after a warm-up"
        if repeats == 1
        else f"median of {repeats} runs each after a warm-up"
    )
    draft = (
        f"draft  {models['draft']} (block {models['draft_block_size']})"
        if models["draft"]
        else "draft  none: the target decodes plainly"
    )
    lines = [
        f"{env['device_type']} ({device}) · mlx {env['mlx']} · mlx-lm {env['mlx_lm']}",
        f"target {models['target']} ({_quant(models['target_quantization'])})",
        draft,
        f"{count(result.overall.prompts, 'prompt')} ({per_suite}) · ≤ {s['max_tokens']} tokens · "
        f"temp {s['temperature']:g} · {how}",
    ]
    if quick:
        lines.append(quick)
    return Text("\n".join(lines), style="dim")


def _run_label(r: RunSummary) -> str:
    return _label(r.run)


def _label(run: str) -> str:
    """A run's name (`bench_results.run_name`) as the report shows it: its shape, a chain
    of W tokens or a tree of B."""
    if run == "auto":
        return "W=auto"
    if run.startswith("tree="):
        return f"tree B={run[5:]}"
    return run + (" (no draft)" if run == "W=1" else "")


def _tree_share(r: RunSummary) -> str:
    """The trees column: the share of a run's verify passes that verified a tree."""
    if r.tree_fraction is None or (not r.tree and not r.tree_fraction):
        return "–"
    return f"{r.tree_fraction:.0%}"


def _speedup(x: float) -> Text:
    return Text(f"{x:.2f}×", style="bold green" if x >= 1.0 else "red")


def _tps(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def count(n: int, noun: str) -> str:
    from dflash_mlx.stats import count as counted  # the stats line's words

    return counted(n, noun)


def _memory(gb: float) -> str:
    from dflash_mlx.stats import memory  # the stats line's words

    return memory(gb)


def _table(suite: SuiteSummary) -> Table:
    """One suite: the target alone (mlx-lm) first, then DFlash at each verify width."""
    table = Table(
        title=f"{suite.suite} ({suite.prompts} prompts)",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,  # every column fits 80 columns, the trees column too
    )
    eff = any(r.efficiency is not None for r in suite.runs)
    spread = len(suite.runs[0].generation_tps.values) > 1  # one repeat: one figure, no range
    # The trees column: where trees were asked for (--trees) or chosen (auto).
    trees = any(r.tree or r.tree_fraction for r in suite.runs)
    names = ["run", "tok/s"] + (["min–max"] if spread else []) + ["× mlx-lm", "τ"]
    names += (["trees"] if trees else []) + (["eff."] if eff else [])
    for name in names + ["prefill tok/s", "TTFT", "peak"]:
        table.add_column(name, justify="left" if name == "run" else "right", no_wrap=True)
    # × mlx-lm: this row's tok/s over the mlx-lm row's, the figures shown beside it (the
    # paired, per-prompt comparison and its verdict are under the tables).
    base = next((r.generation_tps.median for r in suite.runs if r.width is None), None)
    for r in suite.runs:
        t = r.generation_tps
        ideal = [_efficiency(r.efficiency)] if eff else []
        table.add_row(
            _run_label(r),
            _tps(t.median),
            *([f"{_tps(t.min)}–{_tps(t.max)}"] if spread else []),
            _speedup(t.median / base) if r.width is not None and base else Text("1.00×", "dim"),
            f"{r.tau:.2f}",
            *([_tree_share(r)] if trees else []),
            *ideal,
            _tps(r.prompt_tps.median),
            f"{r.time_to_first_token.median * 1000:.0f} ms",
            _memory(r.peak_memory),
        )
    return table


def _efficiency(x: float | None) -> str:
    """eff. as a share; above 100% marked, for the note under the tables to explain."""
    if x is None:
        return ""
    return f"{x:.0%}" + (OVER if x > 1.005 else "")


OVER = "*"
OVER_NOTE = (
    f"{OVER} eff. above 100%: this run beat what the calibrated pass costs predict for its τ, "
    "so the costs measured at calibration differ from this run's (timing noise, or a "
    "machine busier then than now); `bench --calibrate` measures them again"
)


def _chains_note(result: BenchResult) -> Text | None:
    """Why tree runs verified chains (a recurrent target, say): the engine's own words."""
    notes = {_label(r.run): r.tree_note for r in result.overall.runs if r.tree and r.tree_note}
    if not notes:
        return None
    runs, note = ", ".join(notes), next(iter(notes.values()))
    return Text(f"{runs}: chains ran, not trees: {note}", style="yellow")


def _over_note(result: BenchResult) -> Text | None:
    runs = [r for x in [*result.suites, result.overall] for r in x.runs]
    if not any(r.efficiency is not None and r.efficiency > 1.005 for r in runs):
        return None
    return Text(OVER_NOTE, style="dim")


def _tables(result: BenchResult) -> list[Table]:
    suites = list(result.suites)
    return [_table(s) for s in suites + ([result.overall] if len(suites) > 1 else [])]


def _acceptance_chart(result: BenchResult) -> Text | None:
    """Bars of acceptance per block position, at the widest verify width, all prompts."""
    # Chains' positions: a tree run's are those of its few chain cycles.
    runs = [r for r in result.overall.runs if r.acceptance_rates and not r.tree]
    runs = runs or [r for r in result.overall.runs if r.acceptance_rates]
    if not runs:
        return None
    widest = max(runs, key=lambda r: len(r.acceptance_rates))
    out = Text(
        f"acceptance per block position ({_run_label(widest)}, all prompts, τ {widest.tau:.2f})\n",
        style="bold",
    )
    out.append(
        "  position k: the share of drafts reaching k that the target accepted there, given "
        "positions 1..k-1 were accepted (so later bars can be higher)\n",
        style="dim",
    )
    for i, rate in enumerate(widest.acceptance_rates, start=1):
        full = round(rate * BAR)
        out.append(f"{i:>4} ")
        out.append("█" * full, style="green")
        out.append("░" * (BAR - full), style="dim")
        out.append(f" {rate:6.1%}\n")
    return out


def verdict(low: float, high: float) -> str:
    """What a 95% interval of a speed ratio says: wholly above 1 faster, wholly below
    slower, else within the noise of the run. Decided on the interval as it is shown (two
    decimals), so that a printed `[1.00–1.09]` is never called faster."""
    low, high = round(low, 2), round(high, 2)
    if low > 1.0:
        return "faster"
    if high < 1.0:
        return "slower"
    return "within the noise"


def _auto_comparison(result: BenchResult) -> Text | None:
    """Automatic width against each fixed choice, paired prompt by prompt; each verdict
    follows its interval."""
    if not result.comparisons:
        return None
    style = {"faster": "green", "slower": "red", "within the noise": "yellow"}
    out = Text("W=auto against each fixed choice ", style="bold")
    out.append("(tok/s ratio paired by prompt and repeat, 95% interval)\n", style="dim")
    for c in result.comparisons:
        other = _label(c.other)
        said = verdict(c.low, c.high)
        out.append(f"  vs {other:<16}")
        out.append(f"{c.ratio:5.2f}×", style=style[said])
        out.append(f"  [{c.low:.2f}–{c.high:.2f}]  ", style="dim")
        out.append(said, style=style[said])
        out.append(f"  ({count(c.pairs, 'pair')})\n", style="dim")
    by = {
        v: [_label(c.other) for c in result.comparisons if verdict(c.low, c.high) == v]
        for v in style
    }
    if by["slower"]:
        said, line = "slower", f"W=auto is slower than {', '.join(by['slower'])}"
    elif by["within the noise"]:
        said = "within the noise"
        line = f"W=auto is as fast as {', '.join(by[said])} within the noise"
        if by["faster"]:
            line += f", faster than {', '.join(by['faster'])}"
    else:
        said, line = (
            "faster",
            "W=auto is faster than "
            + ("every fixed choice" if len(by["faster"]) > 1 else by["faster"][0]),
        )
    out.append(f"  {line} (this run, 95% intervals)\n", style=style[said])
    return out


def _verdict(result: BenchResult) -> Text | Panel:
    dflash_runs = sum(r.width is not None for r in result.records)
    if result.lossless is None:
        return Text(
            "temperature > 0: outputs are sampled, so tokens are not compared "
            "(losslessness is checked at temperature 0)",
            style="dim",
        )
    if result.lossless:
        return Text(
            f"✓ lossless: all {dflash_runs} DFlash runs reproduced the target's greedy "
            "tokens exactly",
            style="green",
        )
    return mismatch_panel(
        result.mismatches,
        f"{dflash_runs} DFlash runs differ from the target's own greedy decoding (mlx-lm, "
        "same prompt, same process)",
        lambda m: f"{m.suite} #{m.prompt_index + 1} · {_label(m.run or f'W={m.width}')}",
        "LOSSLESSNESS FAILURE",
    )


def mismatch_panel(bad: list, what: str, where, title: str) -> Panel:
    """The red panel listing runs whose tokens differ from their reference: `len(bad) of
    {what}`, then each (`where(m)` names it) with its first difference and prompt."""
    lines = Text(f"{len(bad)} of {what}:\n", style="bold red")
    for m in bad[:LISTED_MISMATCHES]:
        prompt = " ".join(m.prompt.split())
        prompt = prompt if len(prompt) <= 70 else prompt[:69] + "…"
        lines.append(
            f"• {where(m)} · repeat {m.repeat + 1} · "
            f"first difference at generated token {m.position}: expected {m.expected} "
            f"{m.expected_text!r}, got {m.got} {m.got_text!r} "
            f"({m.expected_tokens} vs {m.got_tokens} tokens)\n",
            style="red",
        )
        lines.append(f"    prompt: {prompt}\n", style="dim")
    if len(bad) > LISTED_MISMATCHES:
        lines.append(f"… and {len(bad) - LISTED_MISMATCHES} more (all in --json)\n", style="red")
    return Panel(lines, title=title, title_align="left", border_style="bold red")


def report(result: BenchResult, quick: str | None = None) -> None:
    """The whole report on stdout: header, tables, acceptance chart, losslessness verdict.

    tok/s is generation speed (tokens after the first over their time), median over repeats;
    × mlx-lm is that tok/s over the mlx-lm row's (the paired comparison, prompt by prompt,
    with its interval and verdict, is under the tables); trees (when any ran) is the share of verify
    passes that verified a tree (W=N: chains of N; tree B=N: trees of N tokens); eff. is the
    speedup as a share of what tau and the calibrated pass costs allow (tau * t_plain /
    (t_verify(W) + t_draft(L))); prefill is prompt tokens/s.
    """
    tables = _tables(result)
    parts = [_header(result, quick), Text(""), *tables]
    extras = (_chains_note(result), _over_note(result), _auto_comparison(result))
    for extra in (*extras, _acceptance_chart(result)):
        if extra is not None:
            parts.append(extra)
    parts.append(_verdict(result))
    out = _out()
    if not out.is_terminal:  # a file or a pipe: whole tables, never cut to 80 columns
        unbounded = out.options.update_width(10_000)
        out.width = max(out.width, *(out.measure(t, options=unbounded).maximum for t in tables))
    out.print(Group(*parts))


def json_written(path: Path) -> None:
    _err().print(Text(f"wrote {path}", style="dim"))


def calibration(curves, path: Path) -> None:
    """The measured cost curves: what the automatic verify width decides from."""
    table = Table(title="cost curves on this device (median of 3 after a warm-up)")
    table.add_column("width / block", justify="right")
    table.add_column("verify (ms)", justify="right")
    table.add_column("draft (ms)", justify="right")
    table.add_column("verify ÷ plain step", justify="right")
    plain = curves.verify[0]
    for i, (v, d) in enumerate(zip(curves.verify, curves.draft), start=1):
        table.add_row(
            str(i), f"{v * 1e3:.2f}", "–" if i == 1 else f"{d * 1e3:.2f}", f"{v / plain:.2f}×"
        )
    _out().print(table)
    _err().print(Text(f"cached in {path}", style="dim"))
