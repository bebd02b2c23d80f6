"""Draft and target quantization (`dflash-mlx quantize`).

`quantize_draft` quantizes a DFlash draft's linear layers (norms, DFlash 2 conv and
selector stay float) and `save_draft` writes a checkpoint `load_draft` reads back;
`quantize_target` wraps mlx-lm's converter; `compare_drafts` measures what quantizing a
draft costs in acceptance (tau) and saves in memory.
"""

from .check import DraftComparison, compare_drafts
from .draft import MODES, parameter_bytes, quantize_draft, save_draft
from .target import quantize_target

__all__ = [
    "MODES",
    "DraftComparison",
    "compare_drafts",
    "parameter_bytes",
    "quantize_draft",
    "quantize_target",
    "save_draft",
]
