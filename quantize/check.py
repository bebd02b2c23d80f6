"""The acceptance cost of a quantized draft: tau of the original and quantized drafts,
measured with the real decode engine on a few built-in prompts against one target."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from dflash_mlx import generate
from dflash_mlx.bench_prompts import load_suite
from dflash_mlx.draft import DFlashDraft

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


def _tau(model, draft, tokenizer, prompts, max_tokens) -> float:
    cycles = tokens = 0
    for p in prompts:
        msgs = p.messages or [{"role": "user", "content": p.text}]
        prompt = msgs if getattr(tokenizer, "has_chat_template", False) else msgs[-1]["content"]
        r = generate(
            model,
            draft,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            block_size=draft.config.block_size,
        )
        cycles += r.cycles
        tokens += round(r.mean_acceptance * r.cycles)
    return tokens / cycles if cycles else 0.0


def compare_drafts(
    model: nn.Module,
    tokenizer,
    original: DFlashDraft,
    quantized: DFlashDraft,
    *,
    prompts: int = 6,
    max_tokens: int = 64,
) -> DraftComparison:
    """Tau (mean tokens per verify at the full block) of both drafts on the same prompts."""
    suite = load_suite("all")
    chosen = suite[:: max(1, len(suite) // prompts)][:prompts]
    return DraftComparison(
        tau_original=_tau(model, original, tokenizer, chosen, max_tokens),
        tau_quantized=_tau(model, quantized, tokenizer, chosen, max_tokens),
        bytes_original=parameter_bytes(original),
        bytes_quantized=parameter_bytes(quantized),
        prompts=len(chosen),
        max_tokens=max_tokens,
    )
