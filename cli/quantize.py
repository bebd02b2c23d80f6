"""`dflash-mlx quantize draft|target`: options -> `quantize` package -> rich output.

Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from dflash_mlx.errors import BadArgument

from . import ui
from .errors import user_errors
from .paths import writable_folder

app = typer.Typer(
    help="Quantize a DFlash draft or a target (one tool for both halves of a pair).",
    no_args_is_help=True,
)

Bits = Annotated[int, typer.Option(help="Bits per weight: 2, 3, 4, 5, 6 or 8 (by mode).")]
Group = Annotated[int, typer.Option(help="Weights per quantization group: 32, 64 or 128.")]
Mode = Annotated[str, typer.Option(help="MLX quantization mode: affine, mxfp4, mxfp8, nvfp4.")]
Out = Annotated[Path, typer.Option("-o", "--out", help="Output folder (must not exist).")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")]


def _render_check(result, bits: int) -> None:
    """τ and size of both drafts, and what changed, as a table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"τ check: {result.prompts} built-in prompts, ≤ {result.max_tokens} tokens, "
        "greedy, full block"
    )
    timed = result.slowdown is not None
    for col in ("draft", "τ", "size") + (("draft pass",) if timed else ()):
        table.add_column(col, justify="right" if col != "draft" else "left")

    def ms(seconds: float | None) -> tuple[str, ...]:
        return (f"{seconds * 1e3:.2f} ms",) if timed else ()

    table.add_row(
        "original",
        f"{result.tau_original:.3f}",
        f"{result.bytes_original / 1e6:.2f} MB",
        *ms(result.draft_seconds_original),
    )
    table.add_row(
        f"{bits}-bit",
        f"{result.tau_quantized:.3f}",
        f"{result.bytes_quantized / 1e6:.2f} MB",
        *ms(result.draft_seconds_quantized),
    )
    table.add_row(
        "change",
        f"{result.tau_change:+.3f}",
        f"-{result.bytes_saved / 1e6:.2f} MB ({result.bytes_saved / result.bytes_original:.0%})",
        *((f"{result.slowdown:.2f}×",) if timed else ()),
    )
    Console().print(table)
    note = speed_note(result, bits)
    if note:
        ui.note(note)


SLOWER = 1.10  # a quantized draft pass this much slower (or more) gets a note


def speed_note(result, bits: int) -> str | None:
    """A note when the quantized draft keeps τ (within 0.05) but its pass is slower on this
    device: quantized kernels do not pay everywhere (a CPU's, say), and the smaller draft
    may then decode slower than the original."""
    x = result.slowdown
    if x is None or x < SLOWER or result.tau_change < -0.05:
        return None
    return (
        f"note: the {bits}-bit draft keeps τ ({result.tau_change:+.3f}) but its draft pass is "
        f"{x:.2f}× slower than the original's on this device: it saves memory, not time, "
        "here; compare both with dflash-mlx bench before choosing"
    )


def _prepare_out(out: Path, force: bool) -> None:
    writable_folder(out, "--out")  # before anything loads
    if out.exists():
        if not force:
            raise BadArgument(f"output folder {out} exists; pass --force to replace it")
        shutil.rmtree(out)


@app.command("draft")
def draft_command(
    source: Annotated[
        str, typer.Argument(metavar="SOURCE", help="DFlash draft: Hub id or local folder.")
    ],
    out: Out,
    bits: Bits = 4,
    group_size: Group = 64,
    mode: Mode = "affine",
    force: Force = False,
    check: Annotated[
        bool, typer.Option("--check", help="Compare τ of the original and quantized drafts.")
    ] = False,
    target: Annotated[
        str | None, typer.Option(help="Target for --check: Hub id or local folder.")
    ] = None,
) -> None:
    """Quantize a draft's linear layers; norms, DFlash 2 conv and selector stay float."""
    with user_errors():
        if check and target is None:
            raise BadArgument("--check needs --target (the model the draft was built for)")
        writable_folder(out, "--out")  # before anything loads
        import dflash_mlx
        from dflash_mlx.models.loading import resolve
        from dflash_mlx.quantize import compare_drafts, parameter_bytes, quantize_draft, save_draft
        from dflash_mlx.quantize.draft import check_settings

        check_settings(bits, group_size, mode)
        _prepare_out(out, force)
        with ui.loading("draft", source):
            original = dflash_mlx.load_draft(source)
        model, config = quantize_draft(original, bits=bits, group_size=group_size, mode=mode)
        save_draft(model, config, out, resolve(source, "draft"))
        ui.note(
            f"saved {out}: {parameter_bytes(original) / 1e6:.1f} MB → "
            f"{parameter_bytes(model) / 1e6:.1f} MB ({bits}-bit {mode}, group {group_size})"
        )
        if check:
            with ui.loading("target", target):
                t_model, tokenizer = dflash_mlx.load(target)
            with ui.loading("τ check", "original vs quantized draft"):
                result = compare_drafts(t_model, tokenizer, original, dflash_mlx.load_draft(out))
            _render_check(result, bits)


@app.command("target")
def target_command(
    source: Annotated[
        str, typer.Argument(metavar="SOURCE", help="Target: Hub id or local folder.")
    ],
    out: Out,
    bits: Bits = 4,
    group_size: Group = 64,
    mode: Mode = "affine",
    force: Force = False,
) -> None:
    """Quantize a target with mlx-lm's converter, into a folder `dflash_mlx.load` reads."""
    with user_errors():
        _prepare_out(out, force)
        from dflash_mlx.quantize import quantize_target

        with ui.loading("target", source):
            quantize_target(source, out, bits=bits, group_size=group_size, mode=mode)
        ui.note(f"saved {out} ({bits}-bit {mode}, group {group_size})")
