"""Quantized targets: a thin wrapper over mlx-lm's own converter (not a rewrite of it)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from dflash_mlx.errors import BadCheckpoint

from .draft import check_settings


def quantize_target(
    source: str, out: Path, *, bits: int = 4, group_size: int = 64, mode: str = "affine"
) -> str:
    """Convert and quantize a target (Hub id or folder) into `out` with `mlx_lm.convert`.

    Returns what mlx-lm printed (the library itself prints nothing).
    """
    from mlx_lm import convert

    check_settings(bits, group_size, mode)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            convert(
                str(source),
                mlx_path=str(out),
                quantize=True,
                q_bits=bits,
                q_group_size=group_size,
                q_mode=mode,
            )
    except (ValueError, FileNotFoundError) as e:
        raise BadCheckpoint(f"target {source!r}: {e}") from e
    except RuntimeError as e:
        # MLX's loaders say "[load_safetensors] ... incomplete download or corrupt file":
        # the checkpoint's fault, not ours.
        if not str(e).startswith(("[load", "[safetensors", "[gguf")):
            raise
        raise BadCheckpoint(f"target {source!r} has unreadable weights: {e}") from e
    return log.getvalue()
