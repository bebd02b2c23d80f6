"""What `dflash-mlx bench --concurrency` shows: one table per verify width (a row per N and
mode: serial, then batched), what the columns mean, and the identity verdict of the batched
requests against their serial runs.

The report goes to stdout, notes to stderr (progress: `bench_ui.BenchProgress`). Renders a
`ConcurrencyResult` through its fields only; knows nothing about models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .bench_ui import _label, _out, _quant, _tps, count, mismatch_panel

if TYPE_CHECKING:  # the library imports mlx: only for type checkers, never at run time
    from dflash_mlx.bench.concurrency import ConcurrencyResult, ConcurrencyRow

COLUMNS = (
    "tok/s: every request's tokens over the time from their arrival (all N at once) to the "
    "last token · per req: each request's tokens over its own time from the arrival to its "
    "last token, mean over the N · TTFT: arrival to a request's first token (serial: "
    "after the requests before it) · batch: rows per decoder cycle, mean (largest) · "
    "vs serial: batched tok/s over serial's, same N, same repeat"
)
LATE = (
    "late: N - 1 requests at once, the last one when each of them has a quarter of its "
    "tokens (joining a running batch); late TTFT: that one's, from its own arrival"
)


def _header(result: ConcurrencyResult) -> Text:
    env, models, s = result.environment, result.models, result.settings
    device = ", ".join(str(x) for x in (env["device_info"].get("device_name"), env["machine"]) if x)
    draft = (
        f"draft  {models['draft']} (block {models['draft_block_size']})"
        if models["draft"]
        else "draft  none: the target decodes plainly"
    )
    repeats = s["repeats"]
    how = "one run each" if repeats == 1 else f"median of {repeats} runs each"
    suites = ", ".join(dict.fromkeys(p["suite"] for p in result.prompts))
    most = s["max_batch"]
    batched = f"at most {most} rows at once" if most else "every request in one batch"
    lines = [
        f"{env['device_type']} ({device}) · mlx {env['mlx']} · mlx-lm {env['mlx_lm']}",
        f"target {models['target']} ({_quant(models['target_quantization'])})",
        draft,
        f"concurrency {', '.join(map(str, s['concurrency']))}: the first N of "
        f"{count(len(result.prompts), 'prompt')} ({suites}) arrive together · "
        f"≤ {s['max_tokens']} tokens · temp {s['temperature']:g} · {how} after a warm-up",
        f"serial: one after another (stream_generate) · batched: one BatchDecoder, {batched}",
    ]
    return Text("\n".join(lines), style="dim")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _batch(row: ConcurrencyRow) -> str:
    mean = row.mean_batch
    return "–" if mean is None else f"{mean:.1f} (≤{max(row.batches)})"


def _ratio(row: ConcurrencyRow) -> Text:
    if row.vs_serial is None:
        return Text("–", style="dim")
    x = row.vs_serial.median
    return Text(f"{x:.2f}×", style="bold green" if x >= 1.0 else "red")


def table(result: ConcurrencyResult, run: str) -> Table:
    """One verify width: serial and batched at each N."""
    rows = [r for r in result.rows if r.run == run]
    out = Table(
        title=f"{_label(run)}: serial vs batched",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    spread = len(rows[0].aggregate_tps.values) > 1
    late = any(r.late_ttft is not None for r in rows)
    names = ["N", "mode", "tok/s"] + (["min–max"] if spread else [])
    names += ["per req", "TTFT mean", "TTFT max"] + (["late TTFT"] if late else [])
    names += ["τ", "batch", "vs serial"]
    for name in names:
        out.add_column(name, justify="left" if name == "mode" else "right", no_wrap=True)
    for i, r in enumerate(rows):
        t = r.aggregate_tps
        last = i + 1 == len(rows) or rows[i + 1].concurrency != r.concurrency
        shown = "–" if r.late_ttft is None else _ms(r.late_ttft.median)
        out.add_row(
            str(r.concurrency),
            r.mode,
            _tps(t.median),
            *([f"{_tps(t.min)}–{_tps(t.max)}"] if spread else []),
            _tps(r.per_request_tps.median),
            _ms(r.ttft_mean.median),
            _ms(r.ttft_max.median),
            *([shown] if late else []),
            f"{r.tau:.2f}",
            _batch(r),
            _ratio(r),
            end_section=last,
        )
    return out


def _verdict(result: ConcurrencyResult) -> Text | Panel:
    batched = sum(len(r.requests) for r in result.runs if r.mode != "serial")
    if result.lossless is None:
        return Text(
            "temperature > 0: outputs are sampled, so tokens are not compared "
            "(identity is checked at temperature 0)",
            style="dim",
        )
    if result.lossless:
        return Text(
            f"✓ identical: all {batched} batched requests reproduced their serial tokens exactly",
            style="green",
        )
    return mismatch_panel(
        result.mismatches,
        f"{batched} batched requests differ from the same request decoded alone (serial, "
        "same prompt, same process)",
        lambda m: (
            f"{_label(m.run)} · N={m.concurrency}{' (late)' if m.mode == 'late' else ''}"
            f" · request {m.slot + 1} ({m.suite} #{m.prompt_index + 1})"
        ),
        "BATCHED ≠ SERIAL",
    )


def report(result: ConcurrencyResult) -> None:
    """The whole report on stdout: header, a table per width, the columns, the verdict."""
    runs = list(dict.fromkeys(r.run for r in result.rows))
    tables = [table(result, run) for run in runs]
    parts = [_header(result), Text(""), *tables, Text(COLUMNS, style="dim")]
    if result.settings.get("late"):
        parts.append(Text(LATE, style="dim"))
    parts.append(_verdict(result))
    out = _out()
    if not out.is_terminal:  # a file or a pipe: whole tables, never cut to 80 columns
        unbounded = out.options.update_width(10_000)
        out.width = max(out.width, *(out.measure(t, options=unbounded).maximum for t in tables))
    out.print(Group(*parts))
