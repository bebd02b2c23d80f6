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

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import BadArgument
from .options import GenerateOptions

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


def compile_grammar(options: GenerateOptions, tokenizer: Any, vocab: int) -> Grammar | None:
    """A fresh matcher for `options`' constraint over a `vocab`-wide logits row, or None
    when it has none. An invalid schema or grammar is a `BadArgument` saying what is wrong."""
    source = grammar_source(options)
    if source is None:
        return None
    import llguidance

    ll_tok = _ll_tokenizer(tokenizer, vocab, _eos_ids(tokenizer))
    error = llguidance.LLMatcher.validate_grammar(source, ll_tok)
    if error:
        what = "json_schema" if options.json_schema is not None else "grammar"
        raise BadArgument(f"{what} is invalid: {error.strip()}")
    matcher = llguidance.LLMatcher(ll_tok, source, log_level=0)
    if matcher.is_error():
        raise BadArgument(f"grammar is invalid: {matcher.get_error()}")
    return Grammar(matcher, vocab)


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

    def __init__(self, matcher: Any, vocab: int):
        self.matcher = matcher
        self.vocab = vocab
        self.words = (vocab + 31) // 32

    def mask(self) -> np.ndarray:
        """The allowed tokens at the current position, a `(words,)` int32 bitmask."""
        out = np.zeros((self.words,), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check()
        return out

    def allows(self, mask: np.ndarray, token: int) -> bool:
        return 0 <= token < self.vocab and bool((int(mask[token >> 5]) >> (token & 31)) & 1)

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over committed or drafted `tokens`, which its masks allowed."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            self._check()
            raise RuntimeError(f"the grammar refused tokens {list(tokens)} it had allowed")

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            self._check()
            raise RuntimeError(f"the grammar could not roll back {n} tokens")

    @property
    def stopped(self) -> bool:
        """Nothing may follow (the grammar ended with EOS, or in error)."""
        return self.matcher.is_stopped()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self.matcher.get_error()}")


def bits_to_mask(masks: np.ndarray, vocab: int) -> mx.array:
    """`(rows, words)` int32 bitmasks as an `(rows, vocab)` bool array."""
    words = mx.array(masks.view(np.uint32))
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (words[..., None] >> shifts) & 1
    return bits.reshape(masks.shape[0], -1)[:, :vocab].astype(mx.bool_)
