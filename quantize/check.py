"""The acceptance cost of a quantized draft: tau of the original and quantized drafts,
measured with the real decode engine on a few built-in prompts against one target."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from dflash_mlx import Pair
from dflash_mlx.bench.prompts import load_suite
from dflash_mlx.engine.text import encode_prompt
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.train.trainer import held_out_tau

from .draft import parameter_bytes


@dataclass
class DraftComparison:
    tau_original: float
    tau_quantized: float
    bytes_original: int
    bytes_quantized: int
    prompts: int
    max_tokens: int

    @property
    def tau_change(self) -> float:
        return self.tau_quantized - self.tau_original

    @property
    def bytes_saved(self) -> int:
        return self.bytes_original - self.bytes_quantized


def compare_drafts(
    model: nn.Module,
    tokenizer,
    original: DFlashDraft,
    quantized: DFlashDraft,
    *,
    prompts: int = 6,
    max_tokens: int = 64,
) -> DraftComparison:
    """Tau (mean tokens per verify at the full block, greedy: `train.held_out_tau`) of both
    drafts on the same prompts."""
    suite = load_suite("all")
    chosen = suite[:: max(1, len(suite) // prompts)][:prompts]
    chat = bool(getattr(tokenizer, "has_chat_template", False))
    ids = [
        encode_prompt(
            tokenizer, p.messages or ([{"role": "user", "content": p.text}] if chat else p.text)
        )
        for p in chosen
    ]
    return DraftComparison(
        tau_original=held_out_tau(Pair(model, original), tokenizer, ids, max_tokens),
        tau_quantized=held_out_tau(Pair(model, quantized), tokenizer, ids, max_tokens),
        bytes_original=parameter_bytes(original),
        bytes_quantized=parameter_bytes(quantized),
        prompts=len(chosen),
        max_tokens=max_tokens,
    )
