"""A fuzzer against a real server: generated malformed requests on all five endpoints.

Each case starts from a valid body of one endpoint and breaks it one way: a value of another
type, JSON nested thousands deep, huge strings and counts, invalid encodings (lone
surrogates, bytes that are not UTF-8), missing and unknown fields, non-object bodies,
truncated JSON, and tool messages out of order. Every answer must be a 2xx or a 4xx (never
a 5xx) within a bound no stall stays under, and afterwards the server must answer a
reference request exactly as before. Seeded: a failure names its case and replays.

`FUZZ_CASES=N` (random cases after the sweep; 60 by default, CI's own step runs 2000),
`FUZZ_SEED`, `FUZZ_CLIENTS` (threads sending at once; 1 replays the cases one at a time),
`FUZZ_REPORT=path` writes what was tried and how the server answered (`FUZZ_ALL=1`: every
case's time). Where the time goes: a 400 costs the server a few milliseconds; almost all of
it is the 200s whose prompts hold thousands of brackets (prefills of a few thousand tokens),
which the scripted target (`test_server_agents`: attention and MLP as narrow as they go)
keeps cheap. The "missing" cases send their JSON as JSON (they were once all 415s).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .test_server import MODEL
from .test_server_agents import agent, scripted_dir  # noqa: F401  (the tool-capable server)
from .test_server_grammar_cage import MID_REPLY, chain, chained_object

# Cases after the sweep: a count, not a time budget, so that a loaded machine runs the same
# cases (seeded) as an idle one and the test never decides from the clock.
RANDOM_CASES = int(os.environ.get("FUZZ_CASES", "60"))
# No answer may take longer: a stall, not a slow machine, exceeds it. The slowest honest
# cases are long prompts (JSON nested 500-1000 deep inside a message's text, 2000-4000
# tokens: up to 3.5 s here behind the other clients' cases, 2.5x that on CI's machine).
LATENCY = 60.0
SEED = int(os.environ.get("FUZZ_SEED", "20261201"))
# Clients sending at once, each on its own keep-alive connection.
CLIENTS = int(os.environ.get("FUZZ_CLIENTS", "4"))
HOLE = "__FUZZ__"  # a placeholder string replaced by raw JSON text
# Fields that hold JSON text or free-form objects (tool arguments, schemas, results).
LOOSE = {"arguments", "input", "parameters", "input_schema", "content", "output", "prompt"}

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
BASES = {
    "/v1/chat/completions": {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [TOOL],
        "stop": ["\n\n"],
    },
    "/v1/completions": {"model": MODEL, "prompt": "def", "max_tokens": 4, "temperature": 0},
    "/v1/responses": {
        "model": MODEL,
        "max_output_tokens": 4,
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    },
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
            },
        ],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "stop_sequences": ["\n\n"],
    },
    "/v1/messages/count_tokens": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
    },
}


def paths(value, prefix=()):
    """Every path into a JSON value (keys and list indices), the root included."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


def put(body, path, value):
    """A copy of `body` with the value at `path` replaced (the root: `value` itself)."""
    if not path:
        return value
    body = json.loads(json.dumps(body))
    node = body
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return body


def delete(body, path):
    body = json.loads(json.dumps(body))
    node = body
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return body


def deep(rng: random.Random, string: bool = False) -> str:
    """JSON nested thousands of levels deep: lists or objects, or (`string`) JSON text
    nested so deep inside a string (tool arguments, say)."""
    n = rng.choice([100, 1000, 3000, 20000])
    kind = "string" if string else rng.choice(["list", "dict"])
    if kind == "list":
        return "[" * n + "]" * n
    if kind == "dict":
        return '{"a":' * n + "1" + "}" * n
    return json.dumps("[" * n + "]" * n)  # JSON text in a string: tool arguments, say


def odd_value(rng: random.Random) -> str:
    """A JSON value of a random kind, as raw text (only the one drawn is built)."""
    return rng.choice(
        [
            lambda: "null",
            lambda: "true",
            lambda: "-1",
            lambda: "0",
            lambda: "1e308",
            lambda: "1e999",  # parses as infinity
            lambda: "NaN",
            lambda: "-Infinity",
            lambda: "123456789012345678901234567890",
            lambda: '""',
            lambda: json.dumps("x" * rng.choice([10, 100_000])),
            lambda: '"\\ud800"',  # a lone surrogate: valid JSON, invalid Unicode
            lambda: '"\\u0000"',
            lambda: "[]",
            lambda: "{}",
            lambda: '[{"role": "tool"}]',
            lambda: '{"type": 5}',
            lambda: json.dumps(["s"] * rng.choice([5, 5000])),
            lambda: json.dumps([{"role": "user", "content": ""}] * rng.choice([3, 20000])),
        ]
    )()


def mutate(rng: random.Random, endpoint: str) -> tuple[str, bytes, dict]:
    """(kind of break, raw body, extra headers) for one case."""
    base = BASES[endpoint]
    kind = rng.choice(
        ["type", "type", "deep", "deep", "missing", "unknown", "encoding", "shape", "tools"]
    )
    headers = {"content-type": "application/json"}
    if kind in ("type", "deep"):
        every = list(paths(base))
        # Half the deep values go where JSON text or free-form objects are expected.
        loose = [p for p in every if p and p[-1] in LOOSE]
        path = rng.choice(loose if kind == "deep" and loose and rng.random() < 0.5 else every)
        here = base
        for key in path:
            here = here[key]
        raw = deep(rng, isinstance(here, str)) if kind == "deep" else odd_value(rng)
        text = json.dumps(put(base, path, HOLE)).replace(json.dumps(HOLE), raw, 1)
        return f"{kind} at {'/'.join(map(str, path)) or 'root'}", text.encode(), headers
    if kind == "missing":
        path = rng.choice([p for p in paths(base) if p])
        return (
            f"missing {'/'.join(map(str, path))}",
            json.dumps(delete(base, path)).encode(),
            headers,
        )
    if kind == "unknown":
        body = dict(base, **{rng.choice(["n", "logprobs", "x" * 50, "seed"]): odd_value(rng)})
        return "unknown field", json.dumps(body).encode(), headers
    if kind == "encoding":
        text = json.dumps(base)
        choice = rng.choice(["latin1", "bad-bytes", "bom", "utf16"])
        if choice == "latin1":
            raw = text.replace('"hi"', '"h\u00e9"').encode("latin-1", errors="replace")
        elif choice == "bad-bytes":
            raw = text.encode().replace(b"hi", b"h\xff\xfe", 1)
        elif choice == "bom":
            raw = b"\xef\xbb\xbf" + text.encode()
        else:
            raw = text.encode("utf-16")
        return f"encoding {choice}", raw, headers
    if kind == "shape":
        choice = rng.choice(["empty", "truncated", "list", "string", "form", "huge-key"])
        text = json.dumps(base)
        raw = {
            "empty": lambda: b"",
            "truncated": lambda: text[: rng.randrange(1, len(text))].encode(),
            "list": lambda: json.dumps([base]).encode(),
            "string": lambda: b'"hello"',
            "form": lambda: b"a=1&b=2",
            "huge-key": lambda: json.dumps({("k" * 100_000): 1, **base}).encode(),
        }[choice]()
        if choice == "form":
            headers = {"content-type": "application/x-www-form-urlencoded"}
        return f"shape {choice}", raw, headers
    # Tool messages in orders a client should not send.
    body = json.loads(json.dumps(base))
    msgs = body.get("messages") or body.get("input")
    if isinstance(msgs, list) and len(msgs) > 1:
        choice = rng.choice(["reverse", "drop-first", "duplicate-last", "only-last"])
        msgs = {
            "reverse": msgs[::-1],
            "drop-first": msgs[1:],
            "duplicate-last": msgs + msgs[-1:],
            "only-last": msgs[-1:],
        }[choice]
        body["messages" if "messages" in body else "input"] = msgs
        return f"tools {choice}", json.dumps(body).encode(), headers
    return "tools none", json.dumps(body).encode(), headers


def sweep() -> list[tuple[str, str, bytes, dict]]:
    """Cases tried first on every endpoint: each loose field (JSON text or a free-form
    object) nested 500 and 3000 deep."""
    headers = {"content-type": "application/json"}
    out = []
    for endpoint, base in BASES.items():
        for path in paths(base):
            if not path:
                continue
            here = base
            for key in path:
                here = here[key]
            name = "/".join(map(str, path))
            raws = []
            if path[-1] in LOOSE:
                for n in (500, 3000):  # below and above the parser's own depth limit
                    nested = "[" * n + "]" * n
                    raws.append(json.dumps(nested) if isinstance(here, str) else nested)
                    raws.append('{"a":' * n + "1" + "}" * n)
            for raw in raws:
                text = json.dumps(put(base, path, HOLE)).replace(json.dumps(HOLE), raw, 1)
                out.append((endpoint, f"sweep deep at {name}", text.encode(), headers))
    out += [(e, f"issue 63 {k}", json.dumps(b).encode(), headers) for e, k, b in issue63()]
    return out


def issue63() -> Iterator[tuple[str, str, dict]]:
    """Issue 63's bodies: schemas that took the server down (a `$ref` chain 2,500 deep) or
    ended in a 500 mid-reply, at every grammar entry point, and tool parameters of no
    object schema."""
    schemas = {"a 2,500-deep $ref chain": chain(2_500), "a 12,000-deep $ref chain": chain(12_000),
               **MID_REPLY}  # fmt: skip
    chat, responses = BASES["/v1/chat/completions"], BASES["/v1/responses"]
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    for name, schema in schemas.items():
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        yield "/v1/chat/completions", f"response_format {name}", {**chat, "response_format": fmt}
        text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
        yield "/v1/responses", f"text.format {name}", {**responses, "text": text}
        params = schema if schema.get("type") in ("object", "array") else chained_object(2_500)
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        yield "/v1/chat/completions", f"tool_choice required {name}", {
            **chat, **ask, "tools": [tool], "tool_choice": "required"}  # fmt: skip
        yield "/v1/messages", f"tool_choice any {name}", {
            **BASES["/v1/messages"], **ask, "tool_choice": {"type": "any"},
            "tools": [{"name": "f", "input_schema": params}]}  # fmt: skip
    for kind in ({"type": "string"}, {"type": "array"}, {"type": ["integer", "null"]}):
        tool = {"type": "function", "function": {"name": "f", "parameters": kind}}
        yield "/v1/chat/completions", f"tool parameters {kind}", {**chat, "tools": [tool]}


def reference(client: httpx.Client) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def cases(rng: random.Random) -> Iterator[tuple[int, str, str, bytes, dict]]:
    """(number, endpoint, kind, raw body, headers): the sweep, then RANDOM_CASES drawn from
    `rng` (the endpoints in turn), each built only when asked for."""
    first = sweep()
    yield from ((i, *case) for i, case in enumerate(first, 1))
    for i in range(len(first) + 1, len(first) + RANDOM_CASES + 1):
        endpoint = list(BASES)[(i - 1) % len(BASES)]
        yield (i, endpoint, *mutate(rng, endpoint))


def send(client: httpx.Client, case: tuple) -> tuple:
    """(number, endpoint, kind, status or why there was none, seconds, start of the body)."""
    number, endpoint, kind, raw, headers = case
    tic = time.monotonic()
    try:
        r = client.post(endpoint, content=raw, headers=headers)
        status, detail = r.status_code, r.text[:200]
    except httpx.HTTPError as e:  # a dropped connection is no answer
        status, detail = f"no answer ({type(e).__name__})", ""
    return number, endpoint, kind, status, time.monotonic() - tic, detail


def test_malformed_requests_never_make_a_5xx_or_a_stall(agent):  # noqa: F811
    """The cases go out from CLIENTS threads, each on its own keep-alive connection, taking
    the next case in order: the same seeded cases whatever the machine's speed, answered
    side by side as a busy server answers its clients."""
    source = cases(random.Random(SEED))
    lock = threading.Lock()
    answered: list[tuple] = []

    def client_thread() -> None:
        with httpx.Client(base_url=agent.base, timeout=LATENCY + 5) as client:
            while True:
                with lock:
                    case = next(source, None)
                if case is None:
                    return
                answered.append(send(client, case))

    with httpx.Client(base_url=agent.base, timeout=LATENCY + 5) as client:
        before = reference(client)
        with ThreadPoolExecutor(CLIENTS) as pool:
            for done in [pool.submit(client_thread) for _ in range(CLIENTS)]:
                done.result()  # a client thread's own error fails here
        health = client.get("/health").json()
        after = reference(client)
    answered.sort()
    tried = Counter((endpoint, kind.split(" at ")[0]) for _, endpoint, kind, *_ in answered)
    answers = Counter(status for *_, status, _, _ in answered)
    failures = [
        f"case {number} {endpoint} {kind}: {status} in {spent:.1f} s {detail}"
        for number, endpoint, kind, status, spent, detail in answered
        if not isinstance(status, int) or status >= 500 or spent > LATENCY
    ]
    timed = [(round(spent, 3), e, k, str(status)) for _, e, k, status, spent, _ in answered]
    slowest = max(timed)
    report = {
        "seed": SEED,
        "cases": len(answered),
        "clients": CLIENTS,
        "slowest_s": slowest[0],
        "slowest_case": f"{slowest[1]} {slowest[2]}",
        "answers": {str(k): v for k, v in sorted(answers.items(), key=str)},
        "tried": {f"{e} {k}": n for (e, k), n in sorted(tried.items())},
        "failures": failures,
        "slowest_cases": sorted(timed, reverse=True)[:20],
        "timed": timed if os.environ.get("FUZZ_ALL") else None,
    }
    if os.environ.get("FUZZ_REPORT"):
        with open(os.environ["FUZZ_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    assert len(answered) == len(sweep()) + RANDOM_CASES, "a case was never sent"
    assert not failures, "\n".join(failures[:20])
    assert set(e for e, _ in tried) == set(BASES), "an endpoint was never fuzzed"
    assert health["status"] == "ok", health
    assert after == before, "the server answers differently after the fuzzing"


@pytest.mark.parametrize("endpoint", list(BASES))
def test_each_fuzzer_base_body_is_served(agent, endpoint):  # noqa: F811
    """The bodies the fuzzer breaks are valid: a refusal is the break's, not the base's."""
    r = httpx.post(agent.base + endpoint, json=BASES[endpoint], timeout=LATENCY)
    assert r.status_code == 200, r.text
