"""`/metrics`: the server's counters in Prometheus' text format (version 0.0.4).

Counted in the server layer from what each request's own reply reports (its `timings`,
read from the request's `Stats`), so the counters add up to what clients were told: one
ASGI middleware (`Counting`) sees every API request go through and its HTTP status, and the
request's `Generation` leaves its `Usage` on the record the middleware handed it (through a
context variable: no API module knows about metrics). Gauges (queue depth, running rows)
and the prompt store's own counters are read from the engine when scraped.
"""

from __future__ import annotations

import contextvars
import math
import threading
from dataclasses import dataclass, field
from typing import Any

# Path -> the `api` label; other paths (models, health, the page) are not counted.
APIS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
}

OUTCOMES = ("completed", "cancelled", "client_error", "rejected", "failed")

# Seconds: time to first token, and the time each token after the first took.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


@dataclass
class Record:
    """One API request as it goes: the `Usage` of its generation (if one started) and
    whether it ended with its `Finish` or failed mid-stream."""

    api: str
    usage: Any = None  # events.Usage, set when a generation starts
    finished: bool = False
    failed: bool = False


current: contextvars.ContextVar[Record | None] = contextvars.ContextVar(
    "dflash_mlx_request", default=None
)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """`value`, `times` times (a request's mean per-token latency, once per token)."""
        if times <= 0 or not math.isfinite(value):
            return
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += times
                break
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _label(value: object) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass
class Metrics:
    """The counters, updated from the event loop's thread and read by scrapes."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)  # counter name -> value
    widths: dict[int, list[int]] = field(default_factory=dict)  # W -> [cycles, tokens]
    batches: dict[int, int] = field(default_factory=dict)  # rows -> cycles
    cache_hits: dict[str, int] = field(default_factory=dict)  # where prompt tokens came from
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    per_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, rec: Record, status: int) -> None:
        """A request is over: its outcome from its status and its record, its figures from
        the usage its reply reported."""
        if status == 503:
            outcome = "rejected"
        elif status == 499:  # the client left before a whole reply was ready
            outcome = "cancelled"
        elif 400 <= status < 500:
            outcome = "client_error"
        elif status >= 500 or rec.failed:
            outcome = "failed"
        elif rec.usage is not None and not rec.finished:
            outcome = "cancelled"
        else:
            outcome = "completed"
        with self.lock:
            key = (rec.api, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1
            u = rec.usage
            if u is not None and u.responses:
                self._add(u)

    def _add(self, u: Any) -> None:
        t = u.timings()
        s = u.stats
        for name, value in (
            ("prompt_tokens", s.prompt_tokens),
            ("prompt_cached_tokens", t["cache_n"]),
            ("prompt_prefilled_tokens", t["prompt_n"]),
            ("generated_tokens", t["predicted_n"]),
            ("draft_tokens", t["draft_n"]),
            ("draft_accepted_tokens", t["draft_n_accepted"]),
            ("verify_cycles", t["cycles"]),
            ("committed_tokens", s.committed),
        ):
            self.tokens[name] = self.tokens.get(name, 0) + value
        for w, ran in t["ran"]["widths"].items():
            pair = self.widths.setdefault(int(w), [0, 0])
            pair[0] += ran["cycles"]
            pair[1] += ran["tokens"]
        for rows, cycles in t["ran"]["batches"].items():
            self.batches[int(rows)] = self.batches.get(int(rows), 0) + cycles
        memory, disk = t["cache_memory_n"], t["cache_disk_n"]
        conversation = t["cache_n"] - memory - disk
        for where, n in (("conversation", conversation), ("memory", memory), ("disk", disk)):
            if n > 0:
                self.cache_hits[where] = self.cache_hits.get(where, 0) + 1
        if t["cache_n"] == 0:
            self.cache_hits["miss"] = self.cache_hits.get("miss", 0) + 1
        self.ttft.observe(t["prompt_ms"] / 1000)
        decoded = t["predicted_n"] - 1  # the first token is the prefill's
        if decoded > 0 and t["predicted_ms"] > 0:
            self.per_token.observe(t["predicted_ms"] / 1000 / decoded, decoded)

    def render(self, status: dict[str, Any], info: dict[str, Any] | None = None) -> str:
        """The exposition: `info` (model, draft, version) as labels of `dflash_info`, these
        counters, then the engine's `status` as gauges."""
        out: list[str] = []

        def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        if info:
            labels = ",".join(f'{k}="{_label(v)}"' for k, v in info.items())
            family("dflash_info", "gauge", "What this server serves.", [(f"{{{labels}}}", 1)])
        with self.lock:
            family(
                "dflash_requests_total",
                "counter",
                "API requests by API and outcome (completed, cancelled, client_error, "
                "rejected, failed).",
                [
                    (f'{{api="{api}",outcome="{outcome}"}}', n)
                    for (api, outcome), n in sorted(self.requests.items())
                ],
            )
            for name, doc in (
                ("prompt_tokens", "Prompt tokens of the requests that generated."),
                ("prompt_cached_tokens", "Prompt tokens reused from a cache (timings.cache_n)."),
                ("prompt_prefilled_tokens", "Prompt tokens prefilled (timings.prompt_n)."),
                ("generated_tokens", "Tokens generated (timings.predicted_n)."),
                ("draft_tokens", "Drafted tokens the target checked (timings.draft_n)."),
                ("draft_accepted_tokens", "Drafted tokens accepted (timings.draft_n_accepted)."),
                ("verify_cycles", "Target verify passes, plain steps included (timings.cycles)."),
                (
                    "committed_tokens",
                    "Tokens committed by verify passes: tau = this / verify_cycles.",
                ),
            ):
                family(f"dflash_{name}_total", "counter", doc, [("", self.tokens.get(name, 0))])
            family(
                "dflash_verify_width_cycles_total",
                "counter",
                "Verify passes per verify width (1: a plain step).",
                [(f'{{width="{w}"}}', c) for w, (c, _) in sorted(self.widths.items())],
            )
            family(
                "dflash_verify_width_tokens_total",
                "counter",
                "Tokens committed per verify width.",
                [(f'{{width="{w}"}}', t) for w, (_, t) in sorted(self.widths.items())],
            )
            family(
                "dflash_batch_cycles_total",
                "counter",
                "A request's verify passes per batch size (rows in the pass), summed over "
                "requests.",
                [(f'{{rows="{b}"}}', c) for b, c in sorted(self.batches.items())],
            )
            family(
                "dflash_prompt_cache_requests_total",
                "counter",
                "Requests whose prompt reused tokens, by where they came from (conversation: "
                "the conversation's cache; memory, disk: the prompt store), and misses.",
                [(f'{{source="{k}"}}', n) for k, n in sorted(self.cache_hits.items())],
            )
            for name, hist, doc in (
                ("dflash_time_to_first_token_seconds", self.ttft, "Time to first token."),
                (
                    "dflash_time_per_output_token_seconds",
                    self.per_token,
                    "Time per token after the first (each request's mean, once per token).",
                ),
            ):
                out.append(f"# HELP {name} {doc}")
                out.append(f"# TYPE {name} histogram")
                out.extend(hist.lines(name))
        tau = self.tokens.get("committed_tokens", 0) / max(self.tokens.get("verify_cycles", 0), 1)
        family("dflash_tau", "gauge", "Mean tokens per verify pass since the start.", [("", tau)])
        family("dflash_running_rows", "gauge", "Requests decoding now.", [("", status["running"])])
        family(
            "dflash_queue_depth", "gauge", "Requests waiting to start.", [("", status["waiting"])]
        )
        family(
            "dflash_max_batch",
            "gauge",
            "Rows decoded together at most.",
            [("", status["max_batch"])],
        )
        family("dflash_max_queue", "gauge", "Requests that may wait.", [("", status["max_queue"])])
        family(
            "dflash_engine_restarts_total",
            "counter",
            "Engine workers that died and were replaced.",
            [("", status["restarts"])],
        )
        store = status.get("prompt_cache")
        if store is not None:
            family(
                "dflash_prompt_store_tokens_total",
                "counter",
                "Prompt tokens the prompt store restored, by tier.",
                [
                    ('{tier="memory"}', store.get("memory_tokens", 0)),
                    ('{tier="disk"}', store.get("disk_tokens", 0)),
                ],
            )
            family(
                "dflash_prompt_store_memory_bytes",
                "gauge",
                "Bytes of prompt blocks kept in memory.",
                [("", store.get("memory_bytes", 0))],
            )
        return "\n".join(out) + "\n"


class Counting:
    """ASGI middleware: each API request gets a `Record` (in `current`) and is counted
    once it is over, with the status it was answered with."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        api = APIS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if api is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        rec = Record(api)
        token = current.set(rec)
        status = 500

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            rec.failed = rec.failed or not rec.finished
            raise
        finally:
            current.reset(token)
            self.metrics.record(rec, status)
