"""Quantized DFlash drafts: which layers, which settings, and the checkpoint they save to.

Quantizes the draft's linear layers (`fc`, attention and MLP projections) with MLX
quantization; norms, DFlash 2's conv (`kernel_projection`, `base_kernel`) and candidate
selector stay in floating point. The saved `config.json` records the settings under
`quantization`, which `dflash_mlx.load_draft` reads back.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.errors import BadArgument
from dflash_mlx.models.draft import DFlashDraft

# Supported (bits, group sizes) per MLX quantization mode.
MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128)),
    "mxfp4": ((4,), (32,)),
    "mxfp8": ((8,), (32,)),
    "nvfp4": ((4,), (16,)),
}


def keeps_float(path: str) -> bool:
    """Layers that stay in floating point whatever the bits: DFlash 2's conv and selector."""
    return "conv" in path or "candidate_selector" in path


def check_settings(bits: int, group_size: int, mode: str) -> None:
    if mode not in MODES:
        raise BadArgument(
            f"mode {mode!r} is not an MLX quantization mode; expected one of {', '.join(MODES)}"
        )
    allowed_bits, allowed_groups = MODES[mode]
    if bits not in allowed_bits:
        raise BadArgument(
            f"bits {bits} not supported in {mode} mode; expected one of "
            f"{', '.join(map(str, allowed_bits))}"
        )
    if group_size not in allowed_groups:
        raise BadArgument(
            f"group size {group_size} not supported in {mode} mode; expected one "
            f"of {', '.join(map(str, allowed_groups))}"
        )


def quantize_draft(
    draft: DFlashDraft, *, bits: int = 4, group_size: int = 64, mode: str = "affine"
) -> tuple[DFlashDraft, dict]:
    """A quantized copy of `draft` and the `config.json` dict that describes it."""
    check_settings(bits, group_size, mode)
    if draft.config.quantization:
        raise BadArgument(f"the draft is already quantized ({draft.config.quantization})")
    targets = sorted(
        (path, m)
        for path, m in draft.named_modules()
        if isinstance(m, nn.Linear) and not keeps_float(path)
    )
    for path, m in targets:
        in_dim = m.weight.shape[-1]
        if in_dim % group_size:
            raise BadArgument(
                f"group size {group_size} does not divide the input dimension {in_dim} of "
                f"layer {path}; pick a group size that divides it"
            )
    names = {path for path, _ in targets}
    model = DFlashDraft(draft.config)
    model.update(draft.parameters())
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        mode=mode,
        class_predicate=lambda path, m: path in names,
    )
    mx.eval(model.parameters())
    q = {"group_size": group_size, "bits": bits, "mode": mode}
    config = copy.deepcopy(draft.config.raw or {})
    config["quantization"] = q
    model.config = replace(draft.config, quantization=q)
    return model, config


def save_draft(model: DFlashDraft, config: dict, out: Path, source: Path | None = None) -> None:
    """Write `model` as a draft checkpoint folder, with the other files of `source`."""
    out.mkdir(parents=True, exist_ok=False)
    if source is not None:
        for f in source.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))


def parameter_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
