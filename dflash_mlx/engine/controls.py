"""What a request does to the target's logits before sampling, inside the cycle (SPEC 6).

Owns one request's logits processing (`Controls`): OpenAI's presence and frequency penalties
over the tokens generated before each position, mlx-lm's repetition penalty over the recent
context, a logit bias, and a grammar (a JSON schema or a Lark grammar, through llguidance's
token masks with rollback); and the log-probabilities a request asks for (`TokenLogprob`).

Every verified position is processed with its own history: the committed tokens plus the
drafted tokens before it in the block, so a verify pass of W rows processes W different
histories at once. The target's processed distribution is the one the request samples from:
speculative acceptance (SPEC 4) compares the draft's proposals with it, so the output is
exactly the target's processed distribution. The draft's proposals are processed too (with
the committed history, and under a grammar with the block's own earlier proposals), so
acceptance does not collapse; any processing of the draft keeps the output exact, as `q` is
whatever the proposals were drawn from.

Order, as mlx-lm's: penalties, bias and grammar on the raw logits, then log-softmax (what
`logprobs` report), then truncation and temperature (`sampling.probabilities`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import BadArgument
from ..options import GenerateOptions

# JSON as a grammar writes it: one space after ',' and ':', and no other whitespace between
# tokens, so that a weak model cannot loop in blanks.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NEG_INF = float("-inf")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target's processed distribution (after
    penalties, bias and grammar; before truncation and temperature, as mlx-lm reports it),
    and the `top` most likely tokens there, most likely first, as `(token id, logprob)`."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# -- grammars --------------------------------------------------------------------------------


def grammar_source(options: GenerateOptions) -> str | None:
    """The llguidance grammar of `options` (its `json_schema` or Lark `grammar`), or None."""
    import llguidance

    if options.json_schema is not None:
        schema = {"type": "object"} if options.json_schema is True else dict(options.json_schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=JSON_STYLE
            )
        except (ValueError, TypeError) as e:
            raise BadArgument(f"json_schema is not a valid JSON schema: {e}") from None
    if options.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(options.grammar)
    return None


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Any, vocab: int, eos: tuple[int, ...]):
    """llguidance's view of an mlx-lm tokenizer (about a second for a large vocabulary: kept)."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=list(eos) or None)
    except ValueError as e:
        raise BadArgument(f"grammar-constrained output needs a fast tokenizer: {e}") from None


def _eos_ids(tokenizer: Any) -> tuple[int, ...]:
    ids = getattr(tokenizer, "eos_token_ids", None) or ()
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = (tokenizer.eos_token_id,)
    return tuple(sorted(ids))


def compile_grammar(
    options: GenerateOptions, tokenizer: Any, vocab: int, mask_drafts: bool = True
) -> Grammar | None:
    """A fresh matcher for `options`' constraint over a `vocab`-wide logits row, or None
    when it has none. An invalid schema or grammar is a `BadArgument` saying what is wrong."""
    source = grammar_source(options)
    if source is None:
        return None
    import llguidance

    if options.grammar is not None:
        _check_special_literals(options.grammar, tokenizer)
    ll_tok = _ll_tokenizer(tokenizer, vocab, _eos_ids(tokenizer))
    key = (source, id(ll_tok))
    with _COMPILED_LOCK:
        kept = _COMPILED.get(key)
        if kept is not None and kept[0] is ll_tok:
            _COMPILED.move_to_end(key)
            return Grammar(kept[1].deep_copy(), vocab, _eos_ids(tokenizer), mask_drafts)
    # Built on a deep stack (`grammar_cage`): a schema nested deep enough overflows a thread's
    # (a library caller's, on a macOS secondary thread: 512 kB) inside llguidance.
    from ..grammar_cage import build_matcher

    error, matcher = build_matcher(llguidance, ll_tok, source)
    if error:
        what = "json_schema" if options.json_schema is not None else "grammar"
        raise BadArgument(f"{what} is invalid: {error.strip()}")
    if matcher.is_error():
        raise BadArgument(f"grammar is invalid: {matcher.get_error()}")
    # The first token's mask, on a copy, as the engine's first use computes it: some
    # grammars build and fail only there (a schema whose `$ref`s loop without end).
    try:
        Grammar(matcher.deep_copy(), vocab).mask()
    except RuntimeError as e:
        what = "json_schema" if options.json_schema is not None else "grammar"
        error = str(e).removeprefix("grammar matcher failed: ").strip().splitlines()[0]
        raise BadArgument(f"{what} cannot start a reply: {error} (a $ref loop?)") from None
    with _COMPILED_LOCK:
        _COMPILED[key] = (ll_tok, matcher)  # kept unconsumed: requests get copies
        while len(_COMPILED) > KEEP_COMPILED:
            _COMPILED.popitem(last=False)
        fresh = matcher.deep_copy()
    return Grammar(fresh, vocab, _eos_ids(tokenizer), mask_drafts)


# The grammars compiled lately, each a fresh matcher that is never consumed: a request
# gets a copy (microseconds), so a server compiles a request's grammar once, off the
# engine's thread, when it checks it (`check_grammar`), and the engine's compile for the
# same request, or the next request with the same schema, is a copy.
KEEP_COMPILED = 32
_COMPILED: collections.OrderedDict[tuple[str, int], tuple[Any, Any]] = collections.OrderedDict()
_COMPILED_LOCK = threading.Lock()


def _check_special_literals(grammar: str, tokenizer: Any) -> None:
    """Refuse a Lark grammar that writes a special (added) token as quoted text: llguidance
    would allow the token there and then refuse it. Bare `<name>` is that token."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "get_added_vocab", dict)()
    for name in sorted(added, key=len, reverse=True):
        if len(name) > 1 and (f'"{name}"' in grammar or f"'{name}'" in grammar):
            raise BadArgument(
                f"grammar writes the special token {name!r} as quoted text; write it bare, "
                f"as {name} (the token itself)"
            )


def check_grammar(options: GenerateOptions, tokenizer: Any, vocab: int | None = None) -> None:
    """Raise `BadArgument` when `options`' JSON schema or grammar is invalid (a server can
    answer 400 before it starts streaming). `vocab`: the model's logits width."""
    if options.constrained:
        compile_grammar(options, tokenizer, vocab or _vocab_of(tokenizer))


def _vocab_of(tokenizer: Any) -> int:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return len(hf)


class Grammar:
    """One request's grammar matcher: token masks at the current position, and the
    tokens it has consumed (committed ones, and a block's drafts until rolled back)."""

    def __init__(self, matcher: Any, vocab: int, eos: Sequence[int] = (), mask_drafts: bool = True):
        self.matcher = matcher
        self.vocab = vocab
        self.eos = frozenset(eos)  # what ends the reply once the grammar is complete
        self.words = (vocab + 31) // 32
        # Whether the draft's proposals are drawn within the grammar (on the host, from one
        # read of the draft's block), or drawn freely and checked (DFlash 2's always are).
        self.mask_drafts = mask_drafts

    def mask(self) -> np.ndarray:
        """The allowed tokens at the current position, a `(words,)` int32 bitmask."""
        out = np.zeros((self.words,), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check()
        return out

    def allowed(self, mask: np.ndarray) -> np.ndarray:
        """`(vocab,)` bool: the tokens a `mask` allows."""
        return np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def allows(self, mask: np.ndarray, token: int) -> bool:
        return 0 <= token < self.vocab and bool((int(mask[token >> 5]) >> (token & 31)) & 1)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here on (llguidance's fast-forward tokens: the
        bytes every continuation starts with, tokenized), before any choice; [] when the
        next token is a choice. Each is allowed in turn; where a mask allows it alone, the
        processed target gives it probability 1 (SPEC 6)."""
        tokens = self.matcher.compute_ff_tokens()
        self._check()
        return list(itertools.takewhile(lambda t: 0 <= t < self.vocab, tokens))

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over committed or drafted `tokens`, which its masks allowed."""
        for tok in tokens:  # one by one: a batch may not run on past the grammar's end
            if tok in self.eos:
                # The reply ends there. Not consumed: llguidance does not count an EOS
                # taken at the grammar's end among the tokens a rollback undoes.
                return
            if not self.matcher.consume_token(tok):
                self._check()
                raise RuntimeError(f"the grammar refused token {tok}, which it had allowed")

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            self._check()
            raise RuntimeError(f"the grammar could not roll back {n} tokens")

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self.matcher.get_error()}")


def bits_to_mask(masks: np.ndarray, vocab: int) -> mx.array:
    """`(rows, words)` int32 bitmasks as an `(rows, vocab)` bool array."""
    words = mx.array(masks.view(np.uint32))
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (words[..., None] >> shifts) & 1
    return bits.reshape(masks.shape[0], -1)[:, :vocab].astype(mx.bool_)


# -- one request's processing ----------------------------------------------------------------


class Controls:
    """One request's logits processing and logprobs, with the history it needs on the device:
    the count of each generated token (presence and frequency penalties: OpenAI counts the
    generated tokens only, not the prompt) and the latest `repetition_context_size` tokens of
    prompt and reply (mlx-lm's repetition penalty), both advanced by `commit`."""

    def __init__(
        self,
        options: GenerateOptions,
        vocab: int,
        prompt: Sequence[int],
        grammar: Grammar | None = None,
    ):
        self.vocab = vocab
        self.presence = options.presence_penalty
        self.frequency = options.frequency_penalty
        self.counts = (
            mx.zeros((vocab,), dtype=mx.float32) if self.presence or self.frequency else None
        )
        self.repetition = options.repetition_penalty
        self.window = options.repetition_context_size
        self.recent = (
            mx.array(list(prompt[-self.window :]), dtype=mx.int32)
            if self.repetition is not None
            else None
        )
        self.bias = None
        if options.logit_bias:
            bad = [t for t in options.logit_bias if t >= vocab]
            if bad:
                raise BadArgument(
                    f"logit_bias token id {bad[0]} is outside the vocabulary (ids 0..{vocab - 1})"
                )
            ids = mx.array(list(options.logit_bias), dtype=mx.int32)
            values = mx.array(list(options.logit_bias.values()), dtype=mx.float32)
            self.bias = mx.zeros((vocab,), dtype=mx.float32).at[ids].add(values)
        self.grammar = grammar
        self.top = options.logprobs  # None: no logprobs

    @classmethod
    def of(
        cls,
        options: GenerateOptions,
        vocab: int,
        prompt: Sequence[int],
        grammar: Grammar | None = None,
    ) -> Controls | None:
        """The request's controls, or None when it neither processes logits nor asks for
        logprobs (the cycle then runs exactly as without them)."""
        if options.constrained and grammar is None:
            raise BadArgument(
                "json_schema and grammar need the tokenizer: use stream_generate or generate"
            )
        if not options.processes_logits and options.logprobs is None:
            return None
        return cls(options, vocab, prompt, grammar)

    # -- history -----------------------------------------------------------------------------

    def commit(self, tokens: mx.array) -> None:
        """Committed `tokens` (emitted, in order; on the device) join the history."""
        if self.counts is not None:
            self.counts = self.counts.at[tokens].add(1.0)
        if self.recent is not None:
            self.recent = mx.concatenate([self.recent, tokens])[-self.window :]

    # -- processing --------------------------------------------------------------------------

    def target(
        self, logits: mx.array, drafts: mx.array, masks: np.ndarray | None = None
    ) -> mx.array:
        """The processed logits `(W, V)` of a verify pass over `[anchor, drafts]`: row `i`
        with the committed history and `drafts[:i]`; `masks` `(W, words)`: the grammar's
        allowed tokens at each row."""
        logits = logits.astype(mx.float32)
        w = logits.shape[0]
        drafts = drafts.astype(mx.int32)
        if self.bias is not None:
            logits = logits + self.bias
        if self.recent is not None:
            logits = _repetition(logits, self.recent, drafts, self.window, self.repetition)
        if self.counts is not None:
            counts = mx.broadcast_to(self.counts, logits.shape)
            if w > 1:
                drafted = mx.zeros((w - 1, self.vocab), dtype=mx.float32)
                drafted = drafted.at[mx.arange(w - 1), drafts].add(1.0)
                before = mx.concatenate(
                    [mx.zeros((1, self.vocab), dtype=mx.float32), mx.cumsum(drafted, axis=0)]
                )
                counts = counts + before
            logits = logits - self.presence * (counts > 0) - self.frequency * counts
        if masks is not None:
            logits = mx.where(bits_to_mask(masks, logits.shape[-1]), logits, NEG_INF)
        return logits

    @property
    def grammar_only(self) -> bool:
        """Whether a grammar is all this request's processing (no penalty, no bias, no
        logprobs): its tree's nodes are masked each at its own path (`tree.grammar_tree`)."""
        return (
            self.grammar is not None
            and self.bias is None
            and not self.follows_history
            and self.top is None
        )

    @property
    def follows_history(self) -> bool:
        """Whether a position's processing depends on the tokens before it (penalties)."""
        return self.counts is not None or self.recent is not None

    def draft(self, logits: mx.array) -> mx.array:
        """The draft's logits `(rows, V)` processed with the committed history alone (every
        row the same; no grammar): for proposals drawn all at once (DFlash 2's selector)."""
        return self._apply(logits.astype(mx.float32), self.counts, self.recent)

    def walk(self, logits: mx.array, pick: Callable[[mx.array, int], mx.array]) -> list[mx.array]:
        """The draft's proposals drawn row by row from its logits `(rows, V)`: row `i`
        processed with the committed history and the proposals before it, then
        `pick(row (1, V), i)` draws its token (on the device: no host sync)."""
        counts, recent = self.counts, self.recent
        tokens = []
        for i in range(logits.shape[0]):
            tok = pick(self._apply(logits[i : i + 1].astype(mx.float32), counts, recent), i)
            tokens.append(tok)
            if counts is not None:
                counts = counts.at[tok].add(1.0)
            if recent is not None:
                recent = mx.concatenate([recent, tok.reshape(1)])[-self.window :]
        return tokens

    def _apply(self, logits: mx.array, counts: mx.array | None, recent: mx.array | None):
        """Bias, repetition and presence/frequency penalties, every row with one history."""
        if self.bias is not None:
            logits = logits + self.bias
        if recent is not None:
            pen = self.repetition
            logits = mx.where(
                _present(recent, self.vocab),
                mx.where(logits < 0, logits * pen, logits / pen),
                logits,
            )
        if counts is not None:
            logits = logits - self.presence * (counts > 0) - self.frequency * counts
        return logits

    # -- logprobs ----------------------------------------------------------------------------

    def logprobs(self, logits: mx.array, tokens: mx.array) -> tuple[mx.array, ...] | None:
        """`(chosen (W,), top ids (W, k), top logprobs (W, k))` from processed logits `(W, V)`
        and the token emitted at each row (`tokens` `(W,)`), or None when not asked for."""
        if self.top is None:
            return None
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        k = min(self.top, lp.shape[-1])
        if k == 0:
            empty = mx.zeros((lp.shape[0], 0))
            return chosen, empty.astype(mx.int32), empty
        ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(lp, ids, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        return (
            chosen,
            mx.take_along_axis(ids, order, axis=-1),
            mx.take_along_axis(vals, order, axis=-1),
        )


def read_logprobs(
    lp: tuple[mx.array, ...] | None, rows: Sequence[int], tokens: Sequence[int]
) -> list[TokenLogprob] | None:
    """The `TokenLogprob`s of `tokens`, emitted at verify `rows`, from `Controls.logprobs`."""
    if lp is None:
        return None
    chosen, ids, vals = (x.tolist() for x in lp)
    return [
        TokenLogprob(t, chosen[r], tuple(zip(ids[r], vals[r], strict=True)))
        for r, t in zip(rows, tokens, strict=True)
    ]


def _present(tokens: mx.array, vocab: int) -> mx.array:
    """`(vocab,)` bool: which ids occur in `tokens`."""
    if tokens.size == 0:
        return mx.zeros((vocab,), dtype=mx.bool_)
    return mx.zeros((vocab,), dtype=mx.float32).at[tokens].add(1.0) > 0


def _repetition(
    logits: mx.array, recent: mx.array, drafts: mx.array, window: int, penalty: float
) -> mx.array:
    """mlx-lm's repetition penalty at each row `i` of `logits` `(W, V)`: over the last
    `window` tokens of `recent` (the committed history's tail) followed by `drafts[:i]`."""
    w, vocab = logits.shape
    seq = mx.concatenate([recent, drafts])
    r = recent.size
    idx = r + mx.arange(w)[:, None] - window + mx.arange(window)[None]  # (W, window)
    valid = idx >= 0
    if seq.size == 0:
        return logits
    toks = seq[mx.maximum(idx, 0)]
    rows = mx.broadcast_to(mx.arange(w)[:, None], toks.shape)
    present = mx.zeros((w, vocab), dtype=mx.float32).at[rows, toks].add(valid) > 0
    return mx.where(present, mx.where(logits < 0, logits * penalty, logits / penalty), logits)
