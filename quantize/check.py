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
    # One full-block draft pass on this device, median seconds (None: not measured).
    draft_seconds_original: float | None = None
    draft_seconds_quantized: float | None = None

    @property
    def slowdown(self) -> float | None:
        """The quantized draft pass's time over the original's (> 1: slower here)."""
        a, b = self.draft_seconds_original, self.draft_seconds_quantized
        return b / a if a and b else None

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
        draft_seconds_original=draft_seconds(model, original),
        draft_seconds_quantized=draft_seconds(model, quantized),
    )


def draft_seconds(model: nn.Module, draft: DFlashDraft, repeats: int = 5) -> float:
    """One full-block draft pass on this device after 64 tokens of context: the median of
    `repeats` after a warm-up (what a quantized draft may cost in speed where its kernels
    are slower, e.g. on a CPU)."""
    import statistics
    import time

    import mlx.core as mx

    from dflash_mlx.engine.sampling import SamplingParams, propose

    pair = Pair(model, draft)
    block = pair.draft.config.block_size
    cache = pair.target.make_cache()
    prompt = mx.random.randint(0, pair.draft.config.vocab_size, (1, 64), key=mx.random.key(0))
    _, feats = pair.target.forward(prompt, cache, pair.draft.config.target_layer_ids)
    state = pair.draft_state()
    pair.draft.add_context(feats, state)
    mx.eval(state.arrays)
    anchor = mx.array([1], dtype=mx.int32)

    def once() -> float:
        tic = time.perf_counter()
        tokens, _ = propose(pair.draft, state, anchor, block, block - 1, SamplingParams(), None)
        mx.eval(tokens)
        state.commit(None)
        return time.perf_counter() - tic

    once()
    return statistics.median(once() for _ in range(repeats))
