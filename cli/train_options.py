"""`train`'s options that need more than typer: the old names of `-m/--model` and
`--draft-block`, `TrainSettings`' messages in flag terms, and `--target-layer-ids`."""

from __future__ import annotations

from dflash_mlx.errors import BadArgument


def aliases(
    model: str | None, target: str | None, draft_block: int | None, block_size: int | None
) -> tuple[str, int, list[str]]:
    """The target and the draft's block from `-m/--model` and `--draft-block`, or their old
    names `--target` and `--block-size` (each with a note, said once the options are
    checked): `(target, block, notes)`."""
    for flag, value in (("--draft-block", draft_block), ("--block-size", block_size)):
        if value is not None and value < 1:
            raise BadArgument(f"{flag} {value} must be >= 1 (tokens a draft proposes per pass)")
    notes = []
    if target is not None:
        notes.append("--target is deprecated; use --model/-m (as every other command)")
        if model is not None and model != target:
            raise BadArgument(f"--target {target} and --model {model} disagree")
        model = target
    if model is None:
        raise BadArgument("missing option --model/-m: the target to distil a draft for")
    if block_size is not None:
        notes.append("train --block-size is deprecated; use --draft-block (elsewhere "
                     "--block-size is the old name of --verify-width)")  # fmt: skip
        if draft_block is not None and draft_block != block_size:
            raise BadArgument(f"--block-size {block_size} and --draft-block {draft_block} disagree")
        draft_block = block_size
    return model, 16 if draft_block is None else draft_block, notes


def flag_message(message: str) -> str:
    """A `TrainSettings` message (`steps 0 must be >= 1`) naming the flag (`--steps 0 ...`)."""
    name, sep, rest = message.partition(" ")
    return f"--{name.replace('_', '-')}{sep}{rest}"


def check_layer_ids(ids: str | None, layers: int) -> list[int] | None:
    """`--target-layer-ids` as a list of layers of a `layers`-layer target, or a
    `BadArgument` naming the value and the range."""
    if ids is None:
        return None
    try:
        out = [int(x) for x in ids.split(",")]
    except ValueError:
        raise BadArgument(
            f"--target-layer-ids {ids!r}: expected comma-separated layer numbers (e.g. 1,9,17)"
        ) from None
    bad = [i for i in out if not 0 <= i < layers]
    if bad:
        raise BadArgument(
            f"--target-layer-ids {ids}: layer {bad[0]} is not one of the target's "
            f"(0 to {layers - 1})"
        )
    return out
