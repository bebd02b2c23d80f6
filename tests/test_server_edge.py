"""The server's edge (issue 43), through a real uvicorn server on loopback.

Client input that once passed the server's checks and failed inside a request: JSON schemas
whose grammar builds but fails at the reply's first token, and `logit_bias` keys that are
digits to `str.isdigit` but not to `int`. Each must be a 400 naming the field, and the
server must serve normally afterwards. And the real `serve` command stopped by SIGINT or
SIGTERM mid-stream: each API's error event ends every stream, then exit code 130 / 143.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from dflash_mlx.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from dflash_mlx.json_schema import MAX_SCHEMA_STRING, pattern_size, schema_too_large

from .test_cli_serve import exe
from .test_server import MODEL, TIMEOUT, serving
from .test_server_agents import scripted_dir  # noqa: F401  (the tool-capable pair)

# The six schemas of the issue: each passed the grammar's build and failed (500) when the
# reply's first token was consumed.
BAD_SCHEMAS = {
    "$ref to itself": {"$ref": "#"},
    "$defs looping": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "$defs looping in two": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    },
    "pattern a{1000000}": {"type": "string", "pattern": "^a{1000000}$"},
    "pattern (x{1000}){1000}": {"type": "string", "pattern": "^(x{1000}){1000}$"},
    "1 MB const": {"const": "a" * 1_000_000},
}
# Keys that are no token id: digits to `isdigit` only, beyond Python's int digits, not ASCII
# decimal, and ids beyond the vocabulary.
BAD_BIAS_KEYS = ["²", "¹", "1" * 5000, "٣", "-1", " 1", "1e3", "0x10", "", "99999999"]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(scripted_dir):  # noqa: F811
    pair = dict(target="scripted", draft="scripted-draft", verify_width=4)
    with serving(scripted_dir, **pair) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=TIMEOUT)


def refused(response: httpx.Response, field: str) -> str:
    """The error message of a 400 whose `param` names `field` (or a part of it)."""
    assert response.status_code == 400, (response.status_code, response.text[:400])
    error = response.json()["error"]
    assert error["param"] and error["param"].startswith(field), error
    return error["message"]


@pytest.mark.parametrize("name", list(BAD_SCHEMAS))
def test_schemas_failing_at_the_first_token_are_400s_naming_their_field(server, name):
    schema = BAD_SCHEMAS[name]
    chat = {"model": MODEL, "messages": USER, "max_tokens": 4}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    message = refused(post(server, "/v1/chat/completions", {**chat, "response_format": fmt}),
                      "response_format")  # fmt: skip
    assert "$ref" in message or f"{MAX_SCHEMA_STRING:,}" in message, message
    responses = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    refused(post(server, "/v1/responses", {**responses, "text": text}), "text.format")
    # The same schema as a forced tool's parameters: the tool field, or the tool choice
    # whose grammar holds it.
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    answer = post(
        server, "/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}
    )
    assert answer.status_code == 400, answer.text[:400]
    assert answer.json()["error"]["param"].startswith(("tools", "tool_choice")), answer.text
    # Nothing was left broken: a valid schema is served.
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a", "b"]}}}
    answer = post(server, "/v1/chat/completions", {**chat, "response_format": ok, "max_tokens": 8})
    assert answer.status_code == 200, answer.text[:400]
    assert answer.json()["choices"][0]["message"]["content"] in ('"a"', '"b"')


@pytest.mark.parametrize("key", BAD_BIAS_KEYS, ids=lambda k: repr(k[:12]))
def test_logit_bias_keys_are_ascii_token_ids_within_the_vocabulary(server, key):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "logit_bias": {key: 1}}
    message = refused(post(server, "/v1/chat/completions", body), "logit_bias")
    assert len(message) < 400, message  # a 5000-digit key is not echoed whole
    completion = {"model": MODEL, "prompt": "def", "max_tokens": 2, "logit_bias": {key: 1}}
    refused(post(server, "/v1/completions", completion), "logit_bias")


def test_a_valid_logit_bias_key_is_served(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "logit_bias": {"7": 1}}
    assert post(server, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(
    "host, allowed",
    [
        ("[::1]evil.com", False),  # passed: the address between brackets was read alone
        ("[::1]:80evil.com", False),
        ("[::1", False),
        ("localhost.evil.com", False),
        ("127.0.0.1:8080:9", False),
        ("localhost:", False),
        ("[::1]:8080", True),
        ("[::1]", True),
        ("localhost:8080", True),
        ("127.0.0.1", True),
    ],
)
def test_the_host_check_parses_the_whole_header(server, host, allowed):
    r = httpx.get(f"{server.base}/v1/models", headers={"Host": host}, timeout=TIMEOUT)
    if allowed:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text


def test_pattern_size_multiplies_counted_repetitions():
    assert pattern_size("^a{1000000}$") > MAX_SCHEMA_STRING
    assert pattern_size("^(x{1000}){1000}$") > MAX_SCHEMA_STRING
    assert pattern_size("^a{0,1000000}$") > MAX_SCHEMA_STRING
    assert pattern_size("a{99999999999}") > MAX_SCHEMA_STRING  # Python refuses the count
    assert pattern_size("(?<n>x{1000}){1000}") > MAX_SCHEMA_STRING  # another dialect
    assert pattern_size(r"^\d{3}-\d{4}$") == 10
    assert pattern_size("a|bcd") == 3
    assert pattern_size(r"^[a-z]{1,64}@[a-z]{1,255}\.[a-z]{2,63}$") < 400
    # Ordinary schemas pass; a long name or value anywhere is named.
    assert schema_too_large({"type": "object", "properties": {"a": {"pattern": "^x+$"}}}) is None
    problem = schema_too_large({"type": "object", "properties": {"a" * 70_000: {}}})
    assert problem and "70,000 characters" in problem
    problem = schema_too_large({"patternProperties": {"^(x{1000}){1000}$": {}}})
    assert problem and "'patternProperties'" in problem


# -- signals: every stream ends with its API's error event, then the documented exit code --

STREAMS = {  # path -> a streamed request that is still decoding when the signal comes
    "/v1/chat/completions": {"messages": USER, "max_tokens": 100_000, "stream": True},
    "/v1/responses": {"input": "hi", "max_output_tokens": 100_000, "stream": True},
    "/v1/messages": {"messages": USER, "max_tokens": 100_000, "stream": True},
}


def last_event(lines: list[str]) -> tuple[str | None, dict]:
    """The last server-sent event of a stream (its `event:` name and JSON data), [DONE] aside."""
    name, data = None, {}
    for i, line in enumerate(lines):
        if line.startswith("data: ") and line != "data: [DONE]":
            before = lines[i - 1] if i else ""
            name = before[len("event: ") :] if before.startswith("event: ") else None
            data = json.loads(line[len("data: ") :])
    return name, data


@pytest.mark.slow  # two real `serve --demo` processes: ~12 s each here
@pytest.mark.parametrize(
    "sig, code, inherited",
    [
        # Started from a script's background job, which ignores SIGINT: it exited 0.
        (signal.SIGINT, EXIT_INTERRUPTED, signal.SIG_IGN),
        (signal.SIGTERM, EXIT_TERMINATED, signal.SIG_DFL),  # it died by the signal
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_ends_every_stream_with_an_error_event_and_exits_128_plus_it(sig, code, inherited):
    proc = subprocess.Popen(
        [*exe(), "serve", "--demo", "--port", "0", "--no-prompt-cache-dir"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, inherited),
    )
    log: list[str] = []
    try:
        base = None
        for line in proc.stdout:
            log.append(line)
            found = re.search(r"serving (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                base = found.group(1)
                break
        assert base, "".join(log)
        threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(f"{base}/health", timeout=TIMEOUT).json()["status"] != "ok":
            assert time.monotonic() < deadline, "".join(log)
            time.sleep(0.05)
        streams: dict[str, list[str]] = {path: [] for path in STREAMS}
        started = threading.Barrier(len(STREAMS) + 1, timeout=TIMEOUT)

        def read(path: str) -> None:
            body = {"model": "demo", **STREAMS[path]}
            with httpx.stream("POST", f"{base}{path}", json=body, timeout=TIMEOUT) as r:
                lines = r.iter_lines()
                for line in lines:  # up to the first token's event
                    streams[path].append(line)
                    if '"delta"' in line or "output_text.delta" in line:
                        break
                started.wait()
                streams[path].extend(lines)

        readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in STREAMS]
        for t in readers:
            t.start()
        started.wait()  # every stream is decoding
        proc.send_signal(sig)
        for t in readers:
            t.join(timeout=TIMEOUT)
        assert proc.wait(timeout=TIMEOUT) == code, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    # Each API's own error event, last: OpenAI chat `{"error": {...}}`; Responses an `error`
    # event whose type is "error" (it was "server_error", the error object's own type);
    # Anthropic `event: error` with `{"type": "error", "error": {type, message}}`.
    name, data = last_event(streams["/v1/chat/completions"])
    assert set(data) == {"error"} and data["error"]["message"], data
    assert set(data["error"]) == {"message", "type", "param", "code"}, data
    name, data = last_event(streams["/v1/responses"])
    assert name == "error" and data["type"] == "error", (name, data)
    assert {"code", "message", "param", "sequence_number"} <= set(data), data
    assert data["message"] and data["code"], data
    name, data = last_event(streams["/v1/messages"])
    assert name == "error" and data["type"] == "error", (name, data)
    assert data["error"]["type"] and data["error"]["message"], data


# -- memory: flat over many requests ---------------------------------------------------------


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


@pytest.mark.slow  # 1500 requests: ~30 s here
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
def test_memory_stays_flat_over_many_short_requests(server):
    """RSS grew ~150 KB per short request (issue 43): each request of a conversation chained
    the draft's context rows onto a lazy graph over the previous request's. After 500
    requests of warm-up, 1000 more (repeated and new conversations, streamed and not, all
    four APIs) must grow the server's process by less than 5 MB."""
    bodies = [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "stream": True}),
        ("/v1/completions", {"prompt": "def", "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("/v1/messages", {"messages": USER, "max_tokens": 2}),
    ]

    def requests(n: int, start: int) -> None:
        with httpx.Client(timeout=TIMEOUT) as client:
            for i in range(start, start + n):
                path, body = bodies[i % len(bodies)]
                body = {"model": MODEL, "temperature": 0, **body}
                if "messages" in body and i % 7 == 0:  # now and then another conversation
                    body["messages"] = [{"role": "user", "content": f"n{i % 5}"}]
                r = client.post(f"{server.base}{path}", json=body)
                assert r.status_code == 200, r.text

    requests(500, 0)
    server.wait_idle()
    gc.collect()
    before = rss_mb()
    requests(1000, 500)
    server.wait_idle()
    gc.collect()
    grown = rss_mb() - before
    assert grown < 5.0, f"RSS grew {grown:.1f} MB over 1000 requests after warm-up"
