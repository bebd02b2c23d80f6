"""stream_generate / generate: text, stop strings and statistics over the decode cycle.

Owns the public generation API: prompt forms (text, token ids, chat messages), streaming
detokenization, stop strings (never emitted, found across chunk boundaries), finish
reasons and the numbers users see (tok/s, tau, acceptance per block position). The token
decisions themselves all come from `decode.speculative_decode`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .adaptive import WidthChooser
from .calibrate import load_or_measure
from .decode import default_verify_width, speculative_decode
from .draft import DFlashDraft
from .loading import bind_draft
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .target import TargetAdapter

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | mx.array


@dataclass
class GenerationResponse:
    """One streamed chunk: the text and tokens a cycle added, with running statistics."""

    text: str
    tokens: list[int]
    accepted: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" | "length" | None while running
    cycles: int = 0
    mean_acceptance: float = 0.0  # tau so far: mean tokens per verify
    time_to_first_token: float = 0.0  # seconds
    width: int = 0  # verify width of this cycle (0: the token sampled right after prefill)
    # The request's verify width W (a cycle may use less near max_tokens); None: chosen per
    # cycle from measured costs and the acceptance seen so far.
    block_size: int | None = 1
    cached_tokens: int = 0  # prompt tokens reused from the PromptCache, not prefilled


@dataclass
class GenerationResult:
    """What `generate` returns: the whole text plus the run's statistics."""

    text: str
    tokens: list[int]
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    cycles: int
    mean_acceptance: float
    verify_width: int | None  # None: chosen per cycle
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    time_to_first_token: float = 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Fraction of cycles whose drafted token at block index i+1 was accepted."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        for i, m in enumerate(prompt):
            if "role" not in m or "content" not in m:
                raise ValueError(f"message {i} needs 'role' and 'content', got keys {sorted(m)}")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if isinstance(ids, str):
            ids = tokenizer.encode(ids, add_special_tokens=False)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise ValueError(
            "prompt must be a string, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    return [int(t) for t in ids]


class _StopMatcher:
    """Holds back text that could still become a stop string."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was found."""
        self.buffer += text
        if not self.stop:
            out, self.buffer = self.buffer, ""
            return out, False
        hits = [i for i in (self.buffer.find(s) for s in self.stop) if i >= 0]
        if hits:
            out = self.buffer[: min(hits)]
            self.buffer = ""
            return out, True
        cut = max(0, len(self.buffer) - self.hold)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


def _plan_widths(
    model, draft: DFlashDraft | None, block_size: int | None, draft_block: int | None
) -> tuple[int, int, WidthChooser | None]:
    """Verify width W, draft block L, and the chooser that picks them per cycle (auto)."""
    if draft is None:
        if block_size not in (None, 1):
            raise ValueError(f"block_size {block_size} exceeds 1 (no draft given)")
        return 1, 1, None
    block = draft.config.block_size
    if draft_block is not None:
        if not isinstance(draft_block, int) or not 2 <= draft_block <= block:
            raise ValueError(f"draft_block {draft_block!r} must be an integer in 2..{block}")
        if draft.config.is_dflash2 and draft_block != block:
            raise ValueError(
                f"draft_block {draft_block}: a DFlash 2 draft always drafts its trained block "
                f"of {block} (its conv and selector see the whole block)"
            )
    rows = draft_block or block
    if block_size is None:
        try:
            curves = load_or_measure(model, draft)
        except OSError:  # no writable cache: fall back to the fixed default
            width = min(default_verify_width(model, draft), rows)
            return width, rows, None
        fixed = block if draft.config.is_dflash2 else draft_block
        # One chooser per (target, draft block) for the draft's lifetime: what a request
        # learnt about acceptance (and how rarely speculation is worth probing) carries over
        # to the next one, instead of every request paying for its own probes.
        choosers = draft.__dict__.setdefault("_dflash_choosers", {})
        key = (id(model), fixed)
        if key not in choosers or choosers[key].costs != curves:
            choosers[key] = WidthChooser(curves, block, draft_block=fixed)
        return rows, rows, choosers[key]
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size {block_size!r} must be an integer >= 1")
    if block_size > block:
        raise ValueError(f"block_size {block_size} exceeds the draft's trained block size {block}")
    if block_size > rows:
        raise ValueError(f"block_size {block_size} exceeds draft_block {rows}")
    return block_size, rows, None


def stream_generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer,
    prompt: Prompt,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    block_size: int | None = None,
    draft_block: int | None = None,
    stop: str | Sequence[str] | None = None,
    prefill_step: int = 512,
    prompt_progress: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
) -> Iterator[GenerationResponse]:
    """Stream a completion of `prompt`, one `GenerationResponse` per decode cycle.

    `block_size` is the verify width W (tokens the target checks per cycle, at most the
    draft's trained block size). By default (None) W and the draft block are chosen each
    cycle to maximise expected tokens per second from cost curves measured once per device
    and model pair (`calibrate.py`, cached) and the acceptance seen so far; W = 1 (plain
    decoding) is chosen when speculation does not pay. `draft_block` fixes the number of
    rows the draft runs (default: its trained block size, or chosen when W is automatic).
    `prompt_cache` (a `PromptCache` kept across the requests of one conversation) makes a
    request prefill only from the longest common prefix with the previous one.
    `draft=None` or `block_size=1` decodes with the target alone. Output equals the
    target's own decoding: token for token at temperature 0, in distribution otherwise.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens {max_tokens!r} must be an integer >= 1")
    params = SamplingParams(float(temperature), float(top_p), int(top_k), float(min_p))
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    ids = encode_prompt(tokenizer, prompt)
    target = TargetAdapter.of(model)
    if draft is not None:
        bind_draft(draft, model)
    width, rows, chooser = _plan_widths(model, draft, block_size, draft_block)
    if width == 1 and chooser is None:
        draft = None  # plain decoding: no draft pass, no features kept
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())

    detok = tokenizer.detokenizer
    matcher = _StopMatcher(stop)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = gen_tps = ttft = 0.0
    cached = 0
    n_gen = cycles = verified_tokens = 0
    finish = None
    cycle_iter = speculative_decode(
        target,
        draft,
        ids,
        max_tokens=max_tokens,
        params=params,
        key=mx.random.key(seed),
        width=width,
        draft_block=rows,
        eos_ids=eos,
        chooser=chooser,
        prefill_step=prefill_step,
        progress=prompt_progress,
        prompt_cache=prompt_cache,
    )
    gen_start = tic
    for cyc in cycle_iter:
        now = time.perf_counter()
        if cyc.width == 0:
            ttft = now - tic
            cached = cyc.reused
            prompt_tps = (len(ids) - cached) / max(ttft, 1e-9)
            gen_start = now
        else:
            cycles += 1
            verified_tokens += cyc.accepted + 1
        tokens = list(cyc.tokens)
        hit_eos = tokens[-1] in eos
        if hit_eos:
            finish = "stop"
        text_tokens = tokens[:-1] if hit_eos else tokens
        text, stopped = "", False
        if matcher.stop:
            # Token by token, so that a reply ends at the token completing a stop string:
            # what the same cycle committed after it is neither shown nor counted.
            for i, t in enumerate(text_tokens):
                detok.add_token(t)
                segment, stopped = matcher.feed(detok.last_segment)
                text += segment
                if stopped:
                    tokens = tokens[: i + 1]
                    break
        else:
            for t in text_tokens:
                detok.add_token(t)
        n_gen += len(tokens)
        gen_tps = (n_gen - 1) / (now - gen_start) if n_gen > 1 else 0.0
        if not stopped:
            if finish is not None or n_gen >= max_tokens:
                detok.finalize()
                finish = finish or "length"
            segment, stopped = matcher.feed(detok.last_segment)
            text += segment
        if stopped:
            finish = "stop"
        elif finish is not None:
            text += matcher.flush()
        yield GenerationResponse(
            text=text,
            tokens=tokens,
            accepted=cyc.accepted,
            prompt_tokens=len(ids),
            prompt_tps=prompt_tps,
            generation_tokens=n_gen,
            generation_tps=gen_tps,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            cycles=cycles,
            mean_acceptance=verified_tokens / cycles if cycles else 0.0,
            time_to_first_token=ttft,
            width=cyc.width,
            block_size=None if chooser is not None else width,
            cached_tokens=cached,
        )
        if finish is not None:
            cycle_iter.close()
            return


def generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer,
    prompt: Prompt,
    **kwargs: Any,
) -> GenerationResult:
    """Run `stream_generate` to the end and return the text with the run's statistics."""
    text, tokens = [], []
    accepted: list[int] = []
    drafted: list[int] = []
    last = None
    for r in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text.append(r.text)
        tokens.extend(r.tokens)
        missing = r.width - 1 - len(drafted)
        if missing > 0:
            accepted += [0] * missing
            drafted += [0] * missing
        for i in range(r.width - 1):
            drafted[i] += 1
            accepted[i] += int(r.accepted > i)
        last = r
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        prompt_tps=last.prompt_tps,
        generation_tokens=last.generation_tokens,
        generation_tps=last.generation_tps,
        peak_memory=last.peak_memory,
        cycles=last.cycles,
        mean_acceptance=last.mean_acceptance,
        verify_width=last.block_size,
        accepted_per_position=accepted,
        drafted_per_position=drafted,
        time_to_first_token=last.time_to_first_token,
    )
