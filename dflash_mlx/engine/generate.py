"""stream_generate / generate: text, stop strings and statistics over the decode cycle.

Owns the public generation API: a `Pair` (or a model and a draft), a tokenizer, a prompt
(text, token ids, chat messages) and one `GenerateOptions`; streaming detokenization, stop
strings (never emitted, found across chunk boundaries, reported), finish reasons, and the
request's `Stats`. The token decisions themselves all come from the engine (`batch.BatchDecoder`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from ..cache.prompt_cache import PromptCache
from ..errors import BadArgument
from ..models.draft import DFlashDraft
from ..options import GenerateOptions
from ..pair import Pair
from ..stats import Stats
from .controls import TokenLogprob
from .decode import Cycle
from .text import Prompt, StopMatcher, encode_prompt, special_token_ids

__all__ = [
    "GenerationResponse",
    "GenerationResult",
    "Prompt",
    "TokenLogprob",
    "encode_prompt",
    "generate",
    "stream_generate",
]


def _stat(name: str, doc: str | None = None) -> property:
    """A read-only property reading `self.stats.<name>`."""
    return property(lambda self: getattr(self.stats, name), doc=doc or f"`stats.{name}`")


class _StatsView:
    """The figures that used to be fields of responses and results, read from `stats`."""

    stats: Stats
    prompt_tokens = _stat("prompt_tokens")
    prompt_tps = _stat("prompt_tps")
    generation_tokens = _stat("generation_tokens")
    generation_tps = _stat("generation_tps")
    peak_memory = _stat("peak_memory")
    cycles = _stat("cycles")
    mean_acceptance = _stat("tau", "tau: mean tokens committed per verify pass")
    time_to_first_token = _stat("time_to_first_token")
    cached_tokens = _stat("cached_tokens")
    verify_width = _stat("verify_width", "The request's verify width W; None: chosen per cycle.")
    acceptance_rates = _stat("acceptance_rates")

    @property
    def block_size(self) -> int | None:
        """Deprecated name of `verify_width`."""
        warnings.warn(
            "'block_size' is deprecated: use 'verify_width'", DeprecationWarning, stacklevel=2
        )
        return self.stats.verify_width


@dataclass
class GenerationResponse(_StatsView):
    """One streamed chunk: the text and tokens a cycle added, and the request's `Stats` as of
    that cycle (a copy: responses kept for later keep their own figures)."""

    text: str
    tokens: list[int]
    accepted: int  # drafted tokens this cycle accepted
    width: int  # verify width of this cycle (0: the token sampled right after prefill)
    stats: Stats = field(repr=False)
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop: str | None = None  # the stop string that ended the reply, if one did
    # With `options.logprobs`: one per token of `tokens`, in order (else None).
    logprobs: list[TokenLogprob] | None = None

    drafted_tokens = _stat("drafted")
    accepted_tokens = _stat("accepted")


@dataclass
class GenerationResult(_StatsView):
    """What `generate` returns: the whole text, its tokens, how it ended and its `Stats`."""

    text: str
    tokens: list[int]
    finish_reason: str | None
    stats: Stats = field(repr=False)
    stop: str | None = None
    logprobs: list[TokenLogprob] | None = None  # with `options.logprobs`: one per token

    accepted_per_position = _stat("accepted_per_position")
    drafted_per_position = _stat("drafted_per_position")


def stream_generate(
    target: Pair | nn.Module,
    *args: Any,
    prompt_cache: PromptCache | None = None,
    prompt_progress: Callable[[int, int], None] | None = None,
    **kwargs: Any,
) -> Iterator[GenerationResponse]:
    """Stream a completion, one `GenerationResponse` per decode cycle.

    `stream_generate(pair, tokenizer, prompt, options)`; `stream_generate(model, draft,
    tokenizer, prompt)` makes a Pair for this request alone (a Pair kept across requests
    carries what they learn). Keyword arguments change fields of `options` (see
    `GenerateOptions`; `block_size` is the deprecated name of `verify_width`).
    `prompt_cache` (a `PromptCache` kept across the requests of one conversation) makes a
    request prefill only from the longest common prefix with the previous one;
    `prompt_progress(done, total)` is called after each prefill chunk. Output equals the
    target's own decoding: token for token at temperature 0, in distribution otherwise.
    Settings are checked when the first response is asked for.
    """
    pair, tokenizer, prompt, options = _arguments(target, args, kwargs)
    opts = GenerateOptions.from_kwargs(options, **kwargs)
    from .batch import BatchDecoder  # the engine; a request alone is a batch of one

    decoder = BatchDecoder(pair, tokenizer, max_batch=1)
    row = decoder.submit(prompt, opts, prompt_cache=prompt_cache, progress=prompt_progress)
    with _wired_limit():
        yield from decoder.run(row)


class Reply:
    """One request's text, stop strings, finish reason and `Stats`, cycle by cycle: what
    turns the decode engine's `Cycle`s into `GenerationResponse`s (`stream_generate`, and
    each row of a batch, `batch.BatchDecoder`)."""

    def __init__(
        self,
        tokenizer: Any,
        opts: GenerateOptions,
        prompt_tokens: int,
        eos: frozenset[int],
        ticket: Any = None,
        speculate: bool = True,
        width: int | None = None,
    ):
        self.opts = opts
        self.eos = eos
        self.ticket = ticket  # its row in the width policy (None: a fixed width)
        self.detok = tokenizer.detokenizer  # a copy of its own
        self.special = special_token_ids(tokenizer)  # never a reply's text
        self.matcher = StopMatcher(opts.stop)
        self.tic = self.gen_start = time.perf_counter()
        self.stats = Stats(
            prompt_tokens=prompt_tokens,
            verify_width=None if ticket is not None else width,
            draft="active" if speculate else None,
        )
        self.finish: str | None = None

    def feed(self, cyc: Cycle) -> GenerationResponse:
        """The response for the next committed cycle (its `finish_reason` set when the
        request ends with it)."""
        stats, opts, detok, matcher, eos = self.stats, self.opts, self.detok, self.matcher, self.eos
        now = time.perf_counter()
        if cyc.width == 0:
            stats.time_to_first_token = now - self.tic
            stats.cached_tokens = cyc.reused
            stats.tree_note = cyc.tree_note
            self.gen_start = now
        else:
            stats.add(cyc.width, cyc.accepted, cyc.tree, cyc.batch, cyc.steps)
            if self.ticket is not None:
                stats.probes = self.ticket.probes
                stats.draft = "active" if self.ticket.capture else "dormant"
        tokens = list(cyc.tokens)
        hit_eos = tokens[-1] in eos
        if hit_eos:
            self.finish = "stop"
        text_tokens = tokens[:-1] if hit_eos else tokens
        text, stopped = "", None
        if matcher.stop:
            # Token by token, so that a reply ends at the token completing a stop string:
            # what the same cycle committed after it is neither shown nor counted.
            for i, t in enumerate(text_tokens):
                if t in self.special:
                    continue
                detok.add_token(t)
                segment, stopped = matcher.feed(detok.last_segment)
                text += segment
                if stopped:
                    tokens = tokens[: i + 1]
                    break
        else:
            for t in text_tokens:
                if t not in self.special:
                    detok.add_token(t)
        stats.generation_tokens += len(tokens)
        stats.decode_seconds = now - self.gen_start
        if not stopped:
            if self.finish is not None or stats.generation_tokens >= opts.max_tokens:
                detok.finalize()
                self.finish = self.finish or "length"
            segment, stopped = matcher.feed(detok.last_segment)
            text += segment
        if stopped:
            self.finish = "stop"
        elif self.finish is not None:
            text += matcher.flush()
        stats.peak_memory = mx.get_peak_memory() / 1e9
        return GenerationResponse(
            text=text,
            tokens=tokens,
            accepted=cyc.accepted,
            width=cyc.width,
            stats=stats.copy(),
            finish_reason=self.finish,
            stop=stopped,
            logprobs=cyc.logprobs[: len(tokens)] if cyc.logprobs is not None else None,
        )


def _arguments(target: Any, args: tuple, kwargs: dict):
    """`(pair, tokenizer, prompt, options)` from either calling form: `(pair, tokenizer,
    prompt[, options])` or `(model, draft, tokenizer, prompt[, options])`."""
    legacy = not isinstance(target, Pair)
    names = ("draft",) * legacy + ("tokenizer", "prompt", "options")
    if len(args) > len(names):
        raise TypeError(f"stream_generate takes at most {len(names) + 1} positional arguments")
    given = dict(zip(names, args))
    for name in names:
        if name in kwargs:
            if name in given:
                raise TypeError(f"stream_generate got two values for {name!r}")
            given[name] = kwargs.pop(name)
    missing = [n for n in names[:-1] if n not in given]
    if missing:
        raise TypeError(f"stream_generate is missing {', '.join(map(repr, missing))}")
    options = given.get("options")
    if options is not None and not isinstance(options, GenerateOptions):
        raise BadArgument(f"options must be a GenerateOptions, got {type(options).__name__}")
    if legacy:
        draft = given["draft"]
        if draft is not None and not isinstance(draft, DFlashDraft):
            raise BadArgument(f"draft must be a DFlashDraft or None, got {type(draft).__name__}")
        target = Pair(target, draft)
    return target, given["tokenizer"], given["prompt"], options


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


def generate(target: Pair | nn.Module, *args: Any, **kwargs: Any) -> GenerationResult:
    """Run `stream_generate` to the end and return the text with the run's `Stats`."""
    return collect(stream_generate(target, *args, **kwargs))


def collect(responses: Iterable[GenerationResponse]) -> GenerationResult:
    """One request's responses, in order, as its `GenerationResult`."""
    text, tokens, logprobs = [], [], []
    last = None
    for r in responses:
        text.append(r.text)
        tokens.extend(r.tokens)
        if r.logprobs is not None:
            logprobs.extend(r.logprobs)
        last = r
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        finish_reason=last.finish_reason,
        stats=last.stats,
        stop=last.stop,
        logprobs=logprobs if last.logprobs is not None else None,
    )


def batch_generate(
    pair: Pair,
    tokenizer: Any,
    prompts: list[Any],
    options: GenerateOptions | list[GenerateOptions] | None = None,
    *,
    max_batch: int = 8,
) -> list[GenerationResult]:
    """Generate a reply to each of `prompts` (texts, token ids or chat messages), decoded
    together `max_batch` at a time with the draft on; one `GenerationResult` per prompt, in
    order. `options` is one `GenerateOptions` for all, or one per prompt. Each reply is what
    `generate` gives for its prompt alone: token for token at temperature 0 (and with a
    seed at a fixed verify width), in distribution otherwise. A prompt that fails raises
    its error after the others finished."""
    from .batch import BatchDecoder

    many = options if isinstance(options, list) else [options] * len(prompts)
    if len(many) != len(prompts):
        raise BadArgument(f"{len(many)} options for {len(prompts)} prompts: give one, or one each")
    decoder = BatchDecoder(pair, tokenizer, max_batch=max_batch)
    rows = [decoder.submit(p, o, handle=i) for i, (p, o) in enumerate(zip(prompts, many))]
    got: dict[int, list[GenerationResponse]] = {i: [] for i in range(len(rows))}
    errors: dict[int, BaseException] = {}
    while decoder.busy:
        for row, item in decoder.step():
            if isinstance(item, BaseException):
                errors[row.handle] = item
            else:
                got[row.handle].append(item)
    if errors:
        raise errors[min(errors)]
    return [collect(got[i]) for i in range(len(rows))]


def __getattr__(name: str):
    """Old names: `DecodeStats` is `Stats`."""
    if name == "DecodeStats":
        warnings.warn(
            "DecodeStats is deprecated: use dflash_mlx.Stats", DeprecationWarning, stacklevel=2
        )
        return Stats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
