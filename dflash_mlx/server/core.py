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

`APIError` is the one error type the APIs render, each in its own shape.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from mlx_lm.generate import TextStateMachine, make_text_state_machine
from starlette.concurrency import run_in_threadpool

from ..errors import UserError
from ..generate import GenerationResponse, encode_prompt
from .engine import Engine, EngineClosed, EngineDown, Job, QueueFull

log = logging.getLogger("dflash_mlx.server")

# Below this, a temperature is greedy decoding: 1/T overflows float32 long before T = 0.
MIN_TEMPERATURE = 1e-3
SEED_MODULUS = 2**64  # seeds are any integer; the engine's key takes an unsigned 64-bit one


class APIError(Exception):
    """An error the client must know about: HTTP status, message, OpenAI's type/param/code.

    The APIs render it in their own shapes; `kind` is the OpenAI `type`.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the error a client sees: the caller's with its message, ours generic."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(
            503,
            f"The server is busy: {exc}.",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineDown):
        return APIError(503, str(exc), code="engine_restarting", headers={"Retry-After": "1"})
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, UserError):
        return APIError(400, str(exc), code="invalid_value")
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, "The server had an internal error; its log has the details.")


# ---------------------------------------------------------------------------------------
# The internal request


@dataclass
class Request:
    messages: list[dict[str, Any]] | None = None  # chat, in the template's shape
    prompt: str | list[int] | None = None  # a raw completion prompt instead
    tools: list[dict[str, Any]] | None = None  # [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] = "auto"  # auto | none | required | {"name": ...}
    parallel_tool_calls: bool = True  # False: the first call of a reply only
    max_tokens: int | None = None  # None: the server's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    param: str = "messages"  # the request field errors about the prompt name

    def sampling(self) -> dict[str, Any]:
        top_p, top_k = self.top_p, max(self.top_k, 0)
        if top_p == 0:  # the smallest set holding mass 0 is the top token alone
            top_p, top_k = 1.0, 1
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": self.min_p,
            "seed": None if self.seed is None else self.seed % SEED_MODULUS,
            "stop": self.stop,
        }

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (tool_choice none: none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["name"]
            chosen = [t for t in self.tools if t["function"].get("name") == name]
            if not chosen:
                raise APIError(
                    400,
                    f"tool_choice names the function {name!r}, which is not among the tools "
                    f"({', '.join(repr(t['function'].get('name')) for t in self.tools)})",
                    param="tool_choice",
                    code="invalid_value",
                )
            return chosen
        return self.tools


def check_unicode(value: Any, param: str) -> None:
    """Refuse lone surrogates (valid JSON escapes, invalid Unicode) before any tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400,
                f"Invalid '{param}': the text holds an invalid Unicode code point "
                f"{value[e.start]!r} at position {e.start} (a lone surrogate)",
                param=param,
                code="invalid_value",
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, param)
            check_unicode(v, param)
    elif isinstance(value, list):
        for v in value:
            check_unicode(v, param)


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    return 0


# ---------------------------------------------------------------------------------------
# The result stream


@dataclass
class Text:
    text: str


@dataclass
class Reasoning:
    text: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Finish:
    reason: str  # stop | length | tool_calls
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    truncated_tool_call: bool = False  # the budget ran out inside a tool call


Event = Text | Reasoning | ToolCall | Finish


class Usage:
    """Running totals of one request's `GenerationResponse`s: usage and DFlash timings."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.last: GenerationResponse | None = None
        self.drafted = 0  # tokens the target verified beyond each cycle's anchor
        self.accepted = 0

    def add(self, r: GenerationResponse) -> None:
        self.last = r
        self.drafted += max(r.width - 1, 0)
        self.accepted += r.accepted

    @property
    def completion_tokens(self) -> int:
        return self.last.generation_tokens if self.last else 0

    @property
    def cached_tokens(self) -> int:
        return self.last.cached_tokens if self.last else 0

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings` keys, plus DFlash's: tau, cycles, verify width, memory."""
        r = self.last
        if r is None:
            return {}
        prefilled = r.prompt_tokens - r.cached_tokens
        # generation_tps counts the tokens after the first over their own time.
        predicted_ms = (
            (r.generation_tokens - 1) / r.generation_tps * 1000 if r.generation_tps else 0
        )
        return {
            "cache_n": r.cached_tokens,
            "prompt_n": prefilled,
            "prompt_ms": r.time_to_first_token * 1000,
            "prompt_per_second": r.prompt_tps,
            "predicted_n": r.generation_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_second": r.generation_tps,
            "draft_n": self.drafted,
            "draft_n_accepted": self.accepted,
            "tau": r.mean_acceptance,
            "cycles": r.cycles,
            "verify_width": r.block_size,  # None: chosen per cycle
            "peak_memory_gb": r.peak_memory,
            # What ran: cycles and tokens per width (1: plain), plain share, probes, draft.
            "ran": r.stats.what_ran(),
        }


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class Generation:
    """One queued request: its events, in order, as the worker commits tokens."""

    def __init__(self, service: Service, job: Job, req: Request, ids: list[int], chat: bool):
        self._service = service
        self.job = job
        self.request = req
        self.prompt_tokens = len(ids)
        self.usage = Usage(len(ids))  # running totals, up to date after each event
        self.chat = chat
        tok = service.tokenizer
        initial = "normal"
        if chat and tok.has_thinking:
            if tok.rfind_think_start(ids) > tok.rfind_think_end(ids):
                initial = "reasoning"  # the template opened the reasoning block
        self._state = service.text_machine.make_state(initial) if chat else None

    def cancel(self) -> None:
        self.job.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """The request's events; leaving early (a client gone) cancels the request."""
        usage = self.usage
        raw: list[str] = []  # the text as stream_generate gave it, markup included
        tokens: list[int] = []
        mode = self._state[0] if self._state else "normal"
        tool_text = ""
        made_call = False
        try:
            async for r in self.job.responses():
                usage.add(r)
                raw.append(r.text)
                tokens.extend(r.tokens)
                if self._state is None:
                    if r.text:
                        yield Text(r.text)
                    continue
                self._state, segments = TextStateMachine.split(self._state, r.text)
                if r.finish_reason is not None:  # the end: whatever was held back is text
                    self._state, rest, current = TextStateMachine.flush(self._state)
                    segments.append((current, rest))
                for state, text in segments:
                    if mode == "tool" and state != "tool":  # a call just closed
                        for c in self._parse_calls(tool_text):
                            if made_call and not self.request.parallel_tool_calls:
                                break
                            made_call = True
                            yield c
                        tool_text = ""
                    mode = state
                    if not text:
                        continue
                    if state == "tool":
                        tool_text += text
                    elif state == "reasoning":
                        yield Reasoning(text)
                    else:
                        yield Text(text)
            last = usage.last
            if last is None:  # cancelled before the first token
                return
            reason = last.finish_reason or "length"
            truncated = False
            if mode == "tool" and tool_text.strip():  # the reply ended inside a call
                calls = self._parse_calls(tool_text) if reason == "stop" else []
                for c in calls:
                    if made_call and not self.request.parallel_tool_calls:
                        break
                    made_call = True
                    yield c
                truncated = not calls
                if truncated:
                    log.warning("a tool call was cut off (%s): %r", reason, tool_text[:200])
            stop_sequence = None
            if reason == "stop" and tokens and tokens[-1] not in self._service.eos_ids:
                stop_sequence = self._service.which_stop(self.request.stop, "".join(raw), tokens)
            if made_call and reason == "stop" and stop_sequence is None:
                reason = "tool_calls"
            yield Finish(reason, usage, stop_sequence, truncated)
        finally:
            self.job.cancel()

    def _parse_calls(self, text: str) -> list[ToolCall]:
        parser = self._service.tokenizer.tool_parser
        try:
            parsed = parser(text, self.request.tools)
        except Exception as e:  # the model wrote something its family's parser rejects
            log.warning("unparsable tool call (%s: %s): %r", type(e).__name__, e, text[:200])
            return []
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or "name" not in call:
                log.warning("unparsable tool call: %r", text[:200])
                continue
            args = call.get("arguments", {})
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            out.append(ToolCall(call.get("id") or new_id("call_"), str(call["name"]), args))
        return out


async def collect(gen: Generation, receive) -> list[Event]:
    """All of a request's events; a client that disconnects meanwhile cancels it."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gen.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return [e async for e in gen.events()]
    finally:
        watcher.cancel()
        gen.cancel()


def merged(events: list[Event]) -> tuple[str, str, list[ToolCall], Finish | None]:
    """text, reasoning, tool calls and the finish of a collected request."""
    text = "".join(e.text for e in events if isinstance(e, Text))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [e for e in events if isinstance(e, ToolCall)]
    finish = next((e for e in events if isinstance(e, Finish)), None)
    return text, reasoning, calls, finish


# ---------------------------------------------------------------------------------------
# The service: checks, renders, tokenizes and queues


class Service:
    """What the APIs call: `start(Request)` -> `Generation`; `count(Request)` -> tokens."""

    def __init__(self, engine: Engine, *, context_length: int | None, default_max_tokens: int):
        self.engine = engine
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
        limit = self.context_length
        if limit is None:
            return
        if isinstance(req.prompt, list):
            n = len(req.prompt)
        else:  # no tokenizer yet: each token stands for at most _bytes_per_token bytes
            body = [req.messages, req.tools] if req.prompt is None else req.prompt
            n = -(-_text_bytes(body) // self._bytes_per_token)
        if n >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{req.param} would take at least {n} tokens. Please reduce the length of "
                f"the {req.param}.",
                param=req.param,
                code="context_length_exceeded",
            )

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
        self._check(req)  # cheap, before the tokenizer lock other requests need
        try:
            ids = await run_in_threadpool(self._encode, req)
        except APIError:
            raise
        except (ValueError, TemplateError, TypeError, KeyError) as e:
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
        limit = self.context_length
        if limit is not None and n >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{req.param} resulted in {n} tokens. Please reduce the length of the "
                f"{req.param}.",
                param=req.param,
                code="context_length_exceeded",
            )
        wanted = req.max_tokens or self.default_max_tokens
        return wanted if limit is None else min(wanted, limit - n)

    async def start(self, req: Request) -> Generation:
        ids = await self.tokenize(req)
        max_tokens = self.budget(req, len(ids))
        job = self.engine.submit(ids, max_tokens=max_tokens, **req.sampling())
        return Generation(self, job, req, ids, chat=req.messages is not None)

    async def count(self, req: Request) -> int:
        return len(await self.tokenize(req))

    def which_stop(self, stops: list[str], raw: str, tokens: list[int]) -> str | None:
        """The stop string that ended a reply: it starts where the returned text ends."""
        if not stops:
            return None
        with self._lock:
            full = self.tokenizer.decode(tokens)
        for s in stops:
            if full.startswith(s, len(raw)):
                return s
        found = [(full.find(s), s) for s in stops if s and s in full]
        return min(found)[1] if found else stops[0]
