"""stream_generate / generate: text, stop strings and statistics over the decode cycle.

Owns the public generation API: prompt forms (text, token ids, chat messages), streaming
detokenization, stop strings (never emitted, found across chunk boundaries), finish
reasons and the numbers users see (tok/s, tau, acceptance per block position). The token
decisions themselves all come from `decode.speculative_decode`.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from .adaptive import WidthChooser
from .calibrate import load_or_measure
from .decode import default_verify_width, speculative_decode
from .draft import DFlashDraft
from .errors import BadArgument, ContextTooLong
from .loading import bind_draft
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .target import TargetAdapter

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | mx.array


@dataclass
class DecodeStats:
    """A request's decoding statistics, computed here once (the CLI, chat, bench, server
    and quantize check read them): cycles, tau, drafted and accepted tokens per position."""

    cycles: int = 0  # verify passes (plain steps included)
    committed: int = 0  # tokens committed by verify passes: the sum of their tau
    accepted_per_position: list[int] = field(default_factory=list)  # block index i+1
    drafted_per_position: list[int] = field(default_factory=list)
    # What ran: per verify width W (1: a plain step), [cycles, tokens committed]; the
    # speculative cycles the width chooser made as probes; the draft at the end: "active",
    # "dormant" (plain steps capture nothing for it) or None (no draft).
    widths: dict[int, list[int]] = field(default_factory=dict)
    probes: int = 0
    draft: str | None = None

    def add(self, width: int, accepted: int) -> None:
        """One verify pass of `width` tokens that accepted `accepted` drafts."""
        self.cycles += 1
        self.committed += accepted + 1
        ran = self.widths.setdefault(width, [0, 0])
        ran[0] += 1
        ran[1] += accepted + 1
        missing = width - 1 - len(self.drafted_per_position)
        if missing > 0:
            self.accepted_per_position += [0] * missing
            self.drafted_per_position += [0] * missing
        for i in range(width - 1):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(accepted > i)

    def merge(self, other: DecodeStats) -> DecodeStats:
        """Both requests pooled (tau over all their cycles)."""
        out = DecodeStats(self.cycles + other.cycles, self.committed + other.committed)
        for stats in (self, other):
            for w, (c, t) in stats.widths.items():
                ran = out.widths.setdefault(w, [0, 0])
                ran[0] += c
                ran[1] += t
        out.probes = self.probes + other.probes
        out.draft = other.draft if other.cycles else self.draft
        for stats in (self, other):
            for i, (a, d) in enumerate(
                zip(stats.accepted_per_position, stats.drafted_per_position)
            ):
                if i >= len(out.drafted_per_position):
                    out.accepted_per_position.append(0)
                    out.drafted_per_position.append(0)
                out.accepted_per_position[i] += a
                out.drafted_per_position[i] += d
        return out

    @property
    def plain_fraction(self) -> float:
        """The fraction of committed tokens decoded plainly (W = 1)."""
        return self.widths.get(1, [0, 0])[1] / self.committed if self.committed else 0.0

    def what_ran(self) -> dict[str, Any]:
        """JSON-ready: cycles and tokens per width, plain fraction, probes, draft state."""
        return {
            "widths": {
                str(w): {"cycles": c, "tokens": t} for w, (c, t) in sorted(self.widths.items())
            },
            "plain_fraction": round(self.plain_fraction, 4),
            "probes": self.probes,
            "draft": self.draft,
        }

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify pass (0 before the first)."""
        return self.committed / self.cycles if self.cycles else 0.0

    @property
    def drafted(self) -> int:
        """Drafted tokens the target checked."""
        return sum(self.drafted_per_position)

    @property
    def accepted(self) -> int:
        """Drafted tokens the target accepted."""
        return sum(self.accepted_per_position)

    @property
    def acceptance_rates(self) -> list[float]:
        """Per block position: the fraction of cycles that drafted it and accepted it."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]


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
    peak_memory: float  # GB, the MLX allocator's peak in this request (0.0: not measured)
    finish_reason: str | None = None  # "stop" | "length" | None while running
    cycles: int = 0
    mean_acceptance: float = 0.0  # tau so far: mean tokens per verify
    time_to_first_token: float = 0.0  # seconds
    width: int = 0  # verify width of this cycle (0: the token sampled right after prefill)
    # The request's verify width W (a cycle may use less near max_tokens); None: chosen per
    # cycle from measured costs and the acceptance seen so far.
    block_size: int | None = 1
    cached_tokens: int = 0  # prompt tokens reused from the PromptCache, not prefilled
    drafted_tokens: int = 0  # drafted tokens verified so far in this request
    accepted_tokens: int = 0  # ... and accepted
    # Running statistics of the request (shared by the responses of one stream).
    stats: DecodeStats = field(default_factory=DecodeStats, repr=False)


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
    stats: DecodeStats = field(default_factory=DecodeStats, repr=False)

    @property
    def acceptance_rates(self) -> list[float]:
        """Fraction of cycles whose drafted token at block index i+1 was accepted."""
        return self.stats.acceptance_rates


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
                raise BadArgument(f"message {i} needs 'role' and 'content', got keys {sorted(m)}")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if isinstance(ids, str):
            ids = tokenizer.encode(ids, add_special_tokens=False)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise BadArgument(
            "prompt must be a string, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if not ids:
        raise BadArgument("prompt is empty: at least one token is needed")
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


class _PairState:
    """What the engine keeps per loaded (target, draft) pair between requests: one width
    chooser per fixed draft block, so that what a request learnt about acceptance, costs
    and how rarely speculation is worth probing carries over to the next one."""

    def __init__(self, model: nn.Module):
        self.model = weakref.ref(model)
        self.choosers: dict[int | None, WidthChooser] = {}
        self.recalibrated = False  # at most once per pair and process


_PAIRS: dict[tuple[int, int], _PairState] = {}


def _pair_state(model: nn.Module, draft: DFlashDraft) -> _PairState:
    """The pair's state, for as long as both are alive (keyed by identity: an `nn.Module`
    is a dict and cannot be hashed)."""
    key = (id(model), id(draft))
    pair = _PAIRS.get(key)
    if pair is None or pair.model() is not model:
        pair = _PAIRS[key] = _PairState(model)
        weakref.finalize(draft, _PAIRS.pop, key, None)
    return pair


def _plan_widths(
    model,
    draft: DFlashDraft | None,
    block_size: int | None,
    draft_block: int | None,
    seeded: bool = False,
) -> tuple[int, int, WidthChooser | None]:
    """Verify width W, draft block L, and the chooser that picks them per cycle (auto).

    A seeded request gets a chooser of its own, fresh from the calibrated curves, so that
    its widths follow from the request alone (the acceptance its own tokens show), never
    from what earlier requests taught or from wall-clock timings: seeds replay.
    """
    if draft is None:
        if block_size not in (None, 1):
            raise BadArgument(f"block_size {block_size} exceeds 1 (no draft given)")
        return 1, 1, None
    block = draft.config.block_size
    if draft_block is not None:
        if not isinstance(draft_block, int) or not 2 <= draft_block <= block:
            raise BadArgument(f"draft_block {draft_block!r} must be an integer in 2..{block}")
        if draft.config.is_dflash2 and draft_block != block:
            raise BadArgument(
                f"draft_block {draft_block}: a DFlash 2 draft always drafts its trained block "
                f"of {block} (its conv and selector see the whole block)"
            )
    rows = draft_block or block
    if block_size is None:
        fixed = block if draft.config.is_dflash2 else draft_block
        pair = _pair_state(model, draft)
        known = pair.choosers.get(fixed)
        # Measured costs that kept disagreeing with the calibration: measure it again (once
        # per pair and process: a difference that persists is the engine's, not the device's).
        refresh = known is not None and known.recalibrate and not pair.recalibrated
        try:
            curves = load_or_measure(model, draft, refresh=refresh)
        except OSError:  # no writable cache: fall back to the fixed default
            width = min(default_verify_width(model, draft), rows)
            return width, rows, None
        pair.recalibrated = pair.recalibrated or refresh
        if seeded:
            return rows, rows, WidthChooser(curves, block, draft_block=fixed)
        choosers = pair.choosers
        if fixed not in choosers or choosers[fixed].costs != curves:
            choosers[fixed] = WidthChooser(curves, block, draft_block=fixed)
        return rows, rows, choosers[fixed]
    if not isinstance(block_size, int) or block_size < 1:
        raise BadArgument(f"block_size {block_size!r} must be an integer >= 1")
    if block_size > block:
        raise BadArgument(f"block_size {block_size} exceeds the draft's trained block size {block}")
    if block_size > rows:
        raise BadArgument(f"block_size {block_size} exceeds draft_block {rows}")
    return block_size, rows, None


def check_draft_window(value: Any) -> None:
    """Refuse a `draft_window` that is not None or an integer >= 2."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
        raise BadArgument(
            f"draft_window {value!r} must be an integer >= 2 (the anchor and at least one "
            "position before it), or None for the draft's own window"
        )


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
    draft_window: int | None = None,
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
    `draft_window` bounds what the draft attends to and caches on long contexts: a block
    sees its anchor and the `draft_window - 1` positions before it (default: the draft
    checkpoint's own sliding window if it has one, else the whole context).
    `draft=None` or `block_size=1` decodes with the target alone. Output equals the
    target's own decoding: token for token at temperature 0, in distribution otherwise.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadArgument(f"max_tokens {max_tokens!r} must be an integer >= 1")
    check_draft_window(draft_window)
    params = SamplingParams(float(temperature), float(top_p), int(top_k), float(min_p))
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    ids = encode_prompt(tokenizer, prompt)
    target = TargetAdapter.of(model)
    limit = target.context_limit
    if limit is not None and len(ids) >= limit:
        raise ContextTooLong(
            f"prompt of {len(ids)} tokens does not fit the target's context of {limit} "
            "(max_position_embeddings): at least one position must be left to generate"
        )
    if draft is not None:
        bind_draft(draft, model)
    seeded = seed is not None
    width, rows, chooser = _plan_widths(model, draft, block_size, draft_block, seeded)
    if width == 1 and chooser is None:
        draft = None  # plain decoding: no draft pass, no features kept
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())

    detok = tokenizer.detokenizer
    matcher = _StopMatcher(stop)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = gen_tps = ttft = 0.0
    cached = 0
    n_gen = 0
    stats = DecodeStats(draft="active" if draft is not None else None)
    probes = chooser.probes if chooser is not None else 0
    finish = None
    cycle_iter = speculative_decode(
        target,
        draft,
        ids,
        max_tokens=max_tokens,
        params=params,
        seed=seed,
        width=width,
        draft_block=rows,
        eos_ids=eos,
        chooser=chooser,
        learn_costs=not seeded,
        prefill_step=prefill_step,
        progress=prompt_progress,
        prompt_cache=prompt_cache,
        draft_window=draft_window,
    )
    gen_start = tic
    memory = contextlib.ExitStack()
    memory.enter_context(_wired_limit())
    try:
        for cyc in cycle_iter:
            now = time.perf_counter()
            if cyc.width == 0:
                ttft = now - tic
                cached = cyc.reused
                prompt_tps = (len(ids) - cached) / max(ttft, 1e-9)
                gen_start = now
            else:
                stats.add(cyc.width, cyc.accepted)
                if chooser is not None:
                    stats.probes = chooser.probes - probes
                    stats.draft = "active" if chooser.capture else "dormant"
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
                cycles=stats.cycles,
                mean_acceptance=stats.tau,
                time_to_first_token=ttft,
                width=cyc.width,
                block_size=None if chooser is not None else width,
                cached_tokens=cached,
                drafted_tokens=stats.drafted,
                accepted_tokens=stats.accepted,
                stats=stats,
            )
            if finish is not None:
                return
    except Exception as e:
        # Our own code failed after a cycle (detokenizer, stop matcher): the request ends
        # without committing its state to the prompt cache.
        _abandon(cycle_iter, e)
        raise
    finally:
        # Ended, or closed by the consumer between two responses: the cycle generator
        # closes here, on this thread, and commits what was committed.
        cycle_iter.close()
        memory.close()


@contextlib.contextmanager
def _wired_limit() -> Iterator[None]:
    """On Metal, wire the device's recommended working set while generating, as mlx-lm's
    generate does, so that a large model's weights are not paged out between passes.
    Elsewhere (no recommended size) nothing changes."""
    info = mx.device_info() if hasattr(mx, "device_info") and mx.metal.is_available() else {}
    size = info.get("max_recommended_working_set_size")
    if not size:
        yield
        return
    old = mx.set_wired_limit(size)
    try:
        yield
    finally:
        mx.synchronize(generation_stream)  # no async eval may run across the change
        mx.set_wired_limit(old)


def _abandon(cycle_iter: Iterator, error: BaseException) -> None:
    """Raise `error` inside the (suspended) cycle generator, so that it ends as failed."""
    try:
        cycle_iter.throw(error)
    except BaseException:  # noqa: BLE001 - it is `error`, re-raised by the caller
        pass


def generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer,
    prompt: Prompt,
    **kwargs: Any,
) -> GenerationResult:
    """Run `stream_generate` to the end and return the text with the run's statistics."""
    text, tokens = [], []
    last = None
    for r in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text.append(r.text)
        tokens.extend(r.tokens)
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
        accepted_per_position=list(last.stats.accepted_per_position),
        drafted_per_position=list(last.stats.drafted_per_position),
        time_to_first_token=last.time_to_first_token,
        stats=last.stats,
    )
