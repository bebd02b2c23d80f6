"""The result stream of one request: `Text`, `Reasoning` and `ToolCall` events then one
`Finish` carrying its `Usage` (the request's `Stats`).

Tool calls and reasoning are split from the decoded text with mlx-lm's own pieces: the
tokenizer wrapper's markers and parser (inferred by `mlx_lm.load` from the chat template)
and its `TextStateMachine`, fed whatever text a DFlash cycle committed. Markup never
reaches `Text`; a call cut off by the token budget is reported in `Finish`, not leaked.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_lm.generate import TextStateMachine

from ..engine.generate import GenerationResponse
from ..stats import Stats
from . import metrics
from .engine import Job
from .logprobs import Ledger, Scored
from .request import Request
from .tool_calls import CallSplitter, clean_call

if TYPE_CHECKING:
    from .core import Service

log = logging.getLogger("dflash_mlx.server")


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
class Logprobs:
    """The scores of the tokens whose text the events after it begin to show (streamed
    chunks carry them with their text)."""

    scores: list[Scored]


@dataclass
class Finish:
    reason: str  # stop | length | tool_calls
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    truncated_tool_call: bool = False  # the budget ran out inside a tool call


Event = Text | Reasoning | ToolCall | Logprobs | Finish


class Usage:
    """A request's figures as of its latest response (`Stats`): usage and DFlash timings."""

    def __init__(self, prompt_tokens: int) -> None:
        self.stats = Stats(prompt_tokens=prompt_tokens)
        self.finish_reason: str | None = None
        self.stop: str | None = None  # the stop string that ended the reply, if one did
        self.responses = 0
        # Of the cached prompt tokens, those the prompt store held in memory and on disk.
        self.sources: tuple[int, int] = (0, 0)

    def add(self, r: GenerationResponse) -> None:
        self.stats = r.stats
        self.finish_reason = r.finish_reason
        self.stop = r.stop
        self.responses += 1

    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.stats.generation_tokens

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings` keys, plus DFlash's: tau, cycles, verify width, memory."""
        if not self.responses:
            return {}
        s = self.stats
        return {
            "cache_n": s.cached_tokens,
            # From the prompt store (any conversation's prefix): in memory, read from disk.
            "cache_memory_n": self.sources[0],
            "cache_disk_n": self.sources[1],
            "prompt_n": s.prefilled_tokens,
            "prompt_ms": s.time_to_first_token * 1000,
            "prompt_per_second": s.prompt_tps,
            "predicted_n": s.generation_tokens,
            "predicted_ms": s.decode_seconds * 1000,
            "predicted_per_second": s.generation_tps,
            "draft_n": s.drafted,
            "draft_n_accepted": s.accepted,
            "tau": s.tau,
            "cycles": s.cycles,
            "verify_width": s.verify_width,  # None: chosen per cycle
            "peak_memory_gb": s.peak_memory,
            # What ran: cycles and tokens per width (1: plain), plain share, probes, draft.
            "ran": s.what_ran(),
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
        # What /metrics counts of this request, once its HTTP reply is over.
        self._record = metrics.current.get()
        if self._record is not None:
            self._record.usage = self.usage
        self.chat = chat
        tok = service.tokenizer
        initial = "normal"
        if chat and tok.has_thinking:
            if tok.rfind_think_start(ids) > tok.rfind_think_end(ids):
                initial = "reasoning"  # the template opened the reasoning block
        machine = service.text_machine
        self._calls = CallSplitter(machine.make_state(initial)) if chat else None
        self._ledger = None
        if req.logprobs is not None:
            self._ledger = Ledger(service.pieces, service.eos_ids)

    def cancel(self) -> None:
        self.job.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """The request's events; leaving early (a client gone) cancels the request."""
        usage = self.usage
        mode = self._calls.state[0] if self._calls else "normal"
        tool_text = ""
        made_call = False
        try:
            async for r in self.job.responses():
                usage.add(r)
                usage.sources = self.job.sources
                if self._ledger is not None:
                    scores = self._ledger.add(r)
                    if scores:
                        yield Logprobs(scores)
                if self._calls is None:
                    if r.text:
                        yield Text(r.text)
                    continue
                segments = self._calls.split(r.text)
                if r.finish_reason is not None:  # the end: whatever was held back is text
                    self._calls.state, rest, current = TextStateMachine.flush(self._calls.state)
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
            if not usage.responses:  # cancelled before the first token
                return
            reason = usage.finish_reason or "length"
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
            stop_sequence = usage.stop
            if made_call and reason == "stop" and stop_sequence is None:
                reason = "tool_calls"
            if self._record is not None:
                self._record.finished = True
            yield Finish(reason, usage, stop_sequence, truncated)
        except Exception:
            if self._record is not None:
                self._record.failed = True
            raise
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
            clean = clean_call(call, new_id("call_"))
            if isinstance(clean, str):
                log.warning("tool call refused (%s): %r", clean, text[:200])
                continue
            out.append(ToolCall(*clean))
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


def scores(events: list[Event]) -> list[Scored]:
    """The scores of a collected request's shown tokens, in order."""
    return [s for e in events if isinstance(e, Logprobs) for s in e.scores]


def merged(events: list[Event]) -> tuple[str, str, list[ToolCall], Finish | None]:
    """text, reasoning, tool calls and the finish of a collected request."""
    text = "".join(e.text for e in events if isinstance(e, Text))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [e for e in events if isinstance(e, ToolCall)]
    finish = next((e for e in events if isinstance(e, Finish)), None)
    return text, reasoning, calls, finish
