"""Everything the command line shows: spinners, progress, streamed text, stats and errors.

Streamed text and `--json` output go to stdout; everything else (spinners, notes, the stats
line, errors) goes to stderr, so `dflash-mlx generate ... > out.txt` captures only the
completion. Knows nothing about models: it renders what the library returns.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

if TYPE_CHECKING:  # the library imports mlx: only for type checkers, never at run time
    from dflash_mlx import GenerationResponse, GenerationResult

# Prompts longer than one prefill chunk (mlx-lm's and our default step) get a progress bar.
PROGRESS_MIN_TOKENS = 512


def _err() -> Console:
    # Built per call: sys.stderr may be swapped (test runners, redirection) after import.
    return Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def loading(what: str, source: str) -> Iterator[None]:
    """A spinner on stderr while `source` loads."""
    with _err().status(f"Loading {what} [bold]{escape(source)}[/bold]…"):
        yield


class PromptProgress:
    """`prompt_progress` callback: a bar for long prompts, nothing for short ones."""

    def __init__(self, min_tokens: int = PROGRESS_MIN_TOKENS):
        self.min_tokens = min_tokens
        self._bar: Progress | None = None
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        if total <= self.min_tokens:
            return
        if self._bar is None:
            self._bar = Progress(
                TextColumn("prompt"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tokens"),
                TimeElapsedColumn(),
                console=_err(),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("prompt", total=total)
        self._bar.update(self._task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


CALIBRATING = (
    "calibrating the verify width for this device: timing the pair's verify and draft "
    "passes (once per pair, device and BLAS; then cached)"
)


class CalibrationProgress:
    """`progress(done, total)` of the verify-width calibration: a bar on stderr in a
    terminal (elapsed time and an estimate of what is left), nothing more on a pipe (the
    line `calibrate` prints before it says what runs)."""

    def __init__(self, console: Console | None = None):
        self.console = console or _err()
        self._bar: Progress | None = None
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.console.is_terminal:
            return
        if self._bar is None:
            from rich.progress import TimeRemainingColumn

            self._bar = Progress(
                TextColumn("calibrating"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("passes"),
                TimeElapsedColumn(),
                TextColumn("· left"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("calibrate", total=total)
        self._bar.update(self._task, completed=done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def calibrate(pair, verify_width: int | None, console: Console | None = None) -> None:
    """Measure the pair's cost curves now, when a request with `verify_width` would (an
    automatic width and none cached for this device): a line saying what runs, a bar, then
    how long it took. Nothing when they are cached, fixed or without a draft. A cache that
    cannot be written is a note: requests then use the draft's default width. Later
    requests of the pair never measure (a chat's next turn, a bench's next prompt): they
    plan from the curves at hand, and the width policy learns from the passes it runs."""
    import time

    pair.calibrate_in_plan = False
    if pair.draft is None or verify_width is not None or not pair.calibration_due:
        return
    console = console or _err()
    console.print(Text(CALIBRATING + "…", style="yellow"))
    progress = CalibrationProgress(console)
    tic = time.perf_counter()
    try:
        pair.calibrate(progress=progress)
    except OSError as e:
        progress.close()
        console.print(
            Text(
                f"note: calibration skipped ({e.strerror or e}): the draft's default width runs",
                style="yellow",
            )
        )
        return
    finally:
        progress.close()
    seconds = time.perf_counter() - tic
    console.print(Text(f"calibrated in {seconds:.1f} s; cached for the next runs", style="dim"))


def version_report(info: dict[str, str]) -> None:
    """`dflash-mlx --version`: one `name: value` line each, on stdout, ready to paste."""
    width = max(len(k) for k in info)
    for name, value in info.items():
        print(f"{name + ':':<{width + 1}} {value}")


def note(message: str) -> None:
    _err().print(Text(message, style="yellow"))


def error(message: str) -> None:
    """One red line on stderr: `error: <message>`."""
    _err().print(Text("error: ", style="bold red") + Text(" ".join(message.split())))


def stream(
    responses: Generator[GenerationResponse, None, None],
) -> GenerationResponse | None:
    """Write each response's text to stdout as it arrives; return the last response."""
    last = None
    ends_with_newline = True
    try:
        for last in responses:
            if last.text:
                sys.stdout.write(last.text)
                sys.stdout.flush()
                ends_with_newline = last.text.endswith("\n")
    finally:
        responses.close()  # on Ctrl-C too: stops the decode loop, frees its caches
        if not ends_with_newline:
            sys.stdout.write("\n")
            sys.stdout.flush()
    return last


def interrupted() -> None:
    _err().print(Text("interrupted", style="yellow"))


def stats(r: GenerationResponse, verbose: bool = False, finish_reason: str | None = None) -> None:
    """The stats after a streamed completion, from the last GenerationResponse: one short
    line (tokens, speed, τ, TTFT, how it ended: `finish_reason` if given, e.g.
    `interrupted`), the details too with `verbose`; in a terminal fitted to its width
    (broken between fields, never inside one)."""
    from dflash_mlx.stats import short_fields, stats_fields

    shown = stats_fields if verbose else short_fields
    stats_lines(shown(r.stats, finish_reason or r.finish_reason, r.stop))


def stats_lines(fields: list[str], console: Console | None = None) -> None:
    """`fields` (from `dflash_mlx.stats.stats_fields`) on stderr, dimmed: fitted to the
    terminal's width, one line when stderr is no terminal (a log, a pipe)."""
    from dflash_mlx.stats import fit

    console = console or _err()
    width = console.width if console.is_terminal else None
    for line in fit(fields, width):
        console.print(Text(line, style="dim"), soft_wrap=True)


def comparison(plain: dict, tokens: int, tau: float = 0.0) -> None:
    """`generate --compare`: plain decoding's speed against DFlash's (`tau`: the DFlash
    run's), and whether the tokens matched (at temperature 0; a difference is an error:
    exit code 1). The figure is the one its interval is of, the verdict `verdict`'s."""
    from dflash_mlx.stats import SEPARATOR, count, speed

    fields = [f"plain decoding: {speed(plain['generation_tps'])}"]
    x, said = plain["speedup"], plain.get("verdict")
    if x is not None:
        measured = f"{x:.2f}×"
        if plain.get("interval"):
            low, high = plain["interval"]
            measured += f", 95% {low:.2f}–{high:.2f}×"
        else:
            measured += " by tok/s, unpaired"
        fields.append({
            "faster": f"DFlash {x:.2f}× faster (95% {measured.partition('95% ')[2]})",
            "slower": f"DFlash {1 / x:.2f}× slower (DFlash {measured})",
            "same speed within noise": f"same speed within noise (DFlash {measured})",
            "both decoded plainly": f"both decoded plainly: no verdict (DFlash {measured})",
            "barely speculated": f"barely speculated (τ {tau:.2f}): no verdict "
            f"(DFlash {measured})",
        }.get(said, f"not paired: no verdict (DFlash {measured})"))  # fmt: skip
    if plain["same_tokens"] is None:
        fields.append("sampled: tokens not compared (they match at --temp 0)")
    elif plain["same_tokens"]:
        fields.append(f"same {count(tokens, 'token')}")
    else:
        error(
            SEPARATOR.join(fields)
            + f"{SEPARATOR}the tokens differ from token {plain['first_difference']} on: "
            "DFlash is lossless at temperature 0, so this is a bug of ours (please report it)"
        )
        return
    _err().print(Text(SEPARATOR.join(fields), style="bold"))


def result_json(result: GenerationResult, plain: dict | None = None) -> None:
    """Exactly one JSON object on stdout for a `GenerationResult` (with `--compare`, the
    plain run's figures under "plain")."""
    s = result.stats
    payload = {
        "text": result.text,
        "tokens": result.tokens,
        "finish_reason": result.finish_reason,
        "stop": result.stop,
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
        "generation_tps": s.generation_tps,
        "prompt_tps": s.prompt_tps,
        "mean_acceptance": s.tau,
        "cycles": s.cycles,
        "verify_width": s.verify_width,
        "acceptance_rates": s.acceptance_rates,
        "peak_memory_gb": s.peak_memory,
        "time_to_first_token": s.time_to_first_token,
        "ran": s.what_ran(),  # cycles and tokens per width, plain share, probes
    }
    if plain is not None:
        payload["plain"] = plain
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()
