"""The one request / result-stream layer that every API translates onto.

`Request` is what any API asks for: chat messages in the chat template's own shape
(OpenAI's: `role`, `content`, `tool_calls`, `tool_call_id`) or a raw prompt, function
tools, a tool choice, sampling settings, stop strings and a token budget. `Service.start`
checks it (valid Unicode, a size the context can hold, a template that knows tools),
renders and tokenizes it, queues it on the engine and returns a `Generation`, whose
`events()` are `Text`, `Reasoning` and `ToolCall` items then one `Finish`.

Tool calls and reasoning are split from the decoded text with mlx-lm's own pieces: the
tokenizer wrapper's markers and parser (inferred by `mlx_lm.load` from the chat template)
and its `TextStateMachine`, fed whatever text a DFlash cycle committed. Markup never
reaches `Text`; a call cut off by the token budget is reported in `Finish`, not leaked.

Its parts: `request.py` (the `Request`), `events.py` (the result stream and its usage),
`errors.py` (`APIError`, the one error type the APIs render); their names are re-exported
here, where the APIs import them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from jinja2 import TemplateError
from mlx_lm.generate import make_text_state_machine
from starlette.concurrency import run_in_threadpool

from ..engine.text import encode_prompt
from ..errors import BadArgument, ContextTooLong
from ..options import GenerateOptions
from ..pair import check_context
from . import structured
from .engine import Engine
from .errors import APIError, as_api_error
from .events import (
    Event,
    Finish,
    Generation,
    Logprobs,
    Reasoning,
    Text,
    ToolCall,
    Usage,
    collect,
    merged,
    new_id,
    scores,
)
from .logprobs import Pieces
from .request import MIN_TEMPERATURE, SEED_MODULUS, Request, _text_bytes, check_unicode

__all__ = [
    "MIN_TEMPERATURE",
    "SEED_MODULUS",
    "APIError",
    "Event",
    "Finish",
    "Generation",
    "Logprobs",
    "Reasoning",
    "Request",
    "Service",
    "Text",
    "ToolCall",
    "Usage",
    "as_api_error",
    "check_unicode",
    "collect",
    "merged",
    "new_id",
    "scores",
]


class Service:
    """What the APIs call: `start(Request)` -> `Generation`; `count(Request)` -> tokens."""

    def __init__(
        self,
        engine: Engine,
        *,
        context_length: int | None,
        default_max_tokens: int,
        sampling: dict[str, Any] | None = None,
    ):
        self.engine = engine
        # Sampling for requests that leave a field out (`serve --temp ...`).
        self.sampling = dict(sampling or {})
        # The context a request may use: the target's, or less (`serve --max-context`).
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        # The app tokenizes on its own copy (off the event loop, one at a time): the worker
        # detokenizes with the original, and HF tokenizers are not safe to share across
        # threads.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._lock = threading.Lock()
        self.text_machine = make_text_state_machine(self.tokenizer)
        self.eos_ids = frozenset(getattr(self.tokenizer, "eos_token_ids", None) or ())
        # The most bytes one token stands for: bytes / this is a lower bound on tokens.
        vocab = self.tokenizer.get_vocab()
        self._bytes_per_token = max((len(t.encode("utf-8")) for t in vocab), default=1) or 1
        self._pieces: Pieces | None = None

    @property
    def has_tools(self) -> bool:
        return bool(getattr(self.tokenizer, "has_tool_calling", False))

    def _check(self, req: Request) -> None:
        check_unicode(req.messages if req.messages is not None else req.prompt, req.param)
        check_unicode(req.stop, "stop")
        check_unicode(req.tools, "tools")
        if req.messages is not None:
            if not getattr(self.tokenizer, "has_chat_template", False):
                raise APIError(
                    400,
                    "This model's tokenizer has no chat template: use /v1/completions "
                    "with a prompt.",
                    param=req.param,
                )
            if req.tools and req.tool_choice != "none" and not self.has_tools:
                raise APIError(
                    400,
                    "This model's chat template has no tool-calling support (mlx-lm found no "
                    "tool-call format for it): send the request without tools.",
                    param="tools",
                    code="tools_unsupported",
                )
        if self.context_length is None:
            return
        if isinstance(req.prompt, list):
            n = len(req.prompt)
        else:  # no tokenizer yet: each token stands for at most _bytes_per_token bytes
            body = [req.messages, req.tools] if req.prompt is None else req.prompt
            n = -(-_text_bytes(body) // self._bytes_per_token)
        self._fits(req, n, "would take at least")

    def _fits(self, req: Request, n: int, how: str) -> None:
        """The engine's one context check (`pair.check_context`'s rule) against this
        server's context, as the client's error."""
        limit = self.context_length
        try:
            check_context(n, limit, "this server's")
        except ContextTooLong:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{req.param} {how} {n} tokens. Please reduce the length of the {req.param}.",
                param=req.param,
                code="context_length_exceeded",
            ) from None

    def _encode(self, req: Request) -> list[int]:
        with self._lock:
            if req.messages is None:
                return encode_prompt(self.tokenizer, req.prompt)
            ids = self.tokenizer.apply_chat_template(
                req.messages, tools=req.template_tools(), add_generation_prompt=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            if isinstance(ids, str):
                ids = self.tokenizer.encode(ids, add_special_tokens=False)
            return [int(t) for t in ids]

    async def tokenize(self, req: Request) -> list[int]:
        # Off the event loop: the checks walk the whole request, and the ids may be many.
        return await run_in_threadpool(self._tokenize, req)

    def _tokenize(self, req: Request) -> list[int]:
        self._check(req)  # cheap, before the tokenizer lock other requests need
        try:
            ids = self._encode(req)
        except APIError:
            raise
        except (ValueError, TemplateError, TypeError, KeyError, RecursionError) as e:
            raise APIError(400, f"Invalid '{req.param}': {e}", param=req.param) from None
        if not ids:
            raise APIError(400, f"Invalid '{req.param}': the prompt is empty", param=req.param)
        vocab = self.engine.vocab_size
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:  # token id prompts: an id past the embedding would read garbage
            valid = f"0..{vocab - 1}" if vocab is not None else ">= 0"
            raise APIError(
                400,
                f"Invalid '{req.param}': token id {bad[0]} is outside the vocabulary ({valid})",
                param=req.param,
                code="invalid_value",
            )
        return ids

    def budget(self, req: Request, n: int) -> int:
        """max_tokens for this request: asked for (or the default), cut to the context left."""
        self._fits(req, n, "resulted in")
        limit = self.context_length
        wanted = req.max_tokens or self.default_max_tokens
        return wanted if limit is None else min(wanted, limit - n)

    def options(self, req: Request, ids: list[int]) -> GenerateOptions:
        """The engine's options for a request whose prompt is `ids`: its sampling and
        processing, and its constraint (a JSON format, or the grammar of a forced tool
        call), checked here so that an invalid one is a 400 before anything streams."""
        vocab = self.engine.vocab_size
        for key in req.logit_bias or {}:
            if vocab is not None and int(key) >= vocab:
                raise APIError(
                    400,
                    f"Invalid 'logit_bias': token id {key} is outside the vocabulary "
                    f"(0..{vocab - 1})",
                    param="logit_bias",
                    code="invalid_value",
                )
        try:
            options = req.options(self.engine.options, self.budget(req, len(ids)), self.sampling)
        except BadArgument as e:
            field = str(e).split(" ", 1)[0].split("[", 1)[0]
            param = req.format_param if field == "json_schema" else field
            raise APIError(
                400, f"Invalid '{param}': {e}", param=param, code="invalid_value"
            ) from None
        if req.tree is not None and options.verify_width is not None:
            # Whether the server's fixed width holds this request's shape (`serve --tree
            # --verify-width 40`: a tree of 40 tokens, which no chain of a 16 block is).
            try:
                self.engine.pair.plan(options)
            except BadArgument as e:
                raise APIError(
                    400,
                    f"Invalid 'tree': {str(req.tree).lower()} with the server's {e}",
                    param="tree",
                    code="invalid_value",
                ) from None
        param = req.format_param
        if req.forced_tool and req.messages is not None:
            if options.json_schema is not None:
                raise APIError(
                    400,
                    f"'{param}' and a forced tool_choice both constrain the reply: send one.",
                    param=param,
                )
            options = options.replace(grammar=self._tool_grammar(req, ids))
            param = "tool_choice"
            tools = req.template_tools()
        else:
            tools = None
        if options.constrained:
            # Built with the engine's tokenizer (only read: llguidance copies what it needs)
            # over the logits row the engine masks, so that the engine's own compile for this
            # request is a copy of this build.
            engine = self.engine
            width = engine.pair.target.logits_width
            structured.check(options, engine.tokenizer, width, param, tools)
        return options

    def _tool_grammar(self, req: Request, ids: list[int]) -> str:
        tok = self.tokenizer
        reasoning = bool(tok.has_thinking) and tok.rfind_think_start(ids) > tok.rfind_think_end(ids)
        return structured.tool_grammar(tok, req.template_tools() or [], reasoning)

    @property
    def pieces(self) -> Pieces:
        """Each token's bytes (for logprobs), read from the vocabulary when first needed."""
        if self._pieces is None:
            self._pieces = Pieces(self.tokenizer, self._lock)
        return self._pieces

    def _prepare(self, req: Request) -> tuple[list[int], GenerateOptions]:
        ids = self._tokenize(req)
        options = self.options(req, ids)
        if options.logprobs is not None:
            self.pieces  # noqa: B018 - read off the event loop
        return ids, options

    async def start(self, req: Request) -> Generation:
        # Off the event loop: the checks walk the whole request, the ids may be many and a
        # grammar compiles.
        ids, options = await run_in_threadpool(self._prepare, req)
        job = self.engine.submit(ids, options)
        return Generation(self, job, req, ids, chat=req.messages is not None)

    async def count(self, req: Request) -> int:
        return len(await self.tokenize(req))
