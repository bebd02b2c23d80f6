"""Bounded requests: whatever a client sends is served or refused with a 4xx naming the
problem, in bounded time, without holding anyone else (issue 26, items 1, 2, 5, 9).

Against a real uvicorn server over the scripted tool-calling pair of
`test_server_agents` (its chat template renders tools and tool calls), with the default
body limit (32 MB). Each test ends with the reference answer unchanged.
"""

from __future__ import annotations

import json
import socket
import threading
import types

import httpx
import pytest

from dflash_mlx.server import limits

from .test_server import MODEL, TIMEOUT, serving
from .test_server_agents import ASK, PLAIN, TOOLS, scripted_dir  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def server(scripted_dir):  # noqa: F811
    with serving(scripted_dir, target="scripted", draft="scripted-draft", verify_width=4) as s:
        yield s


def post(server, path: str, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.base}{path}", content=data, headers=headers, timeout=TIMEOUT)


def refused(r: httpx.Response, status: int = 400) -> dict:
    """The error of a refusal (either API's shape), checked to be a `status`."""
    assert r.status_code == status, r.text
    body = r.json()
    return body["error"]


def still_answers(server) -> None:
    """The reference answer, unchanged after whatever came before."""
    server.wait_idle()
    r = post(server, "/v1/chat/completions", {"messages": ASK, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "".join(PLAIN)


def nested(depth: int, leaf=None) -> list:
    value = [] if leaf is None else leaf
    for _ in range(depth - 1):
        value = [value]
    return value


def deep_object(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
COUNT = "/v1/messages/count_tokens"


def called(arguments) -> list[dict]:
    """A chat history whose assistant called get_weather with `arguments`, answered."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def used(tool_input) -> list[dict]:
    """An Anthropic history whose assistant used get_weather with `tool_input`, answered."""
    return ASK + [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": tool_input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]  # fmt: skip


def function_call(arguments: str) -> list[dict]:
    return [
        ASK[0],
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]


# ---------------------------------------------------------------------------------------
# 1. Deep nesting: a 400 naming the field, never a RecursionError's 500


def test_deeply_nested_json_is_a_400_naming_the_field(server):
    deep_string = "[" * 3000 + "]" * 3000
    cases = [
        # (path, body, the param named)
        (CHAT, {"messages": called(deep_string), "tools": TOOLS}, "messages[1]"),
        (CHAT, {"messages": called(json.dumps(nested(500)))}, "messages[1]"),
        (CHAT, {"messages": called(deep_object(500))}, "messages[1].tool_calls[0]"),
        (MESSAGES, {"model": MODEL, "max_tokens": 4, "messages": used(deep_object(500))},
         "messages[1].content[0].input"),
        (COUNT, {"model": MODEL, "messages": used(deep_object(500))},
         "messages[1].content[0].input"),
        (RESPONSES, {"input": function_call(deep_string)}, "input[1]"),
        (RESPONSES, {"input": function_call(json.dumps(deep_object(900)))}, "input[1]"),
        (CHAT, {"messages": ASK, "x": nested(100)}, "x"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = post(server, path, body)
        err = refused(r)
        assert "nest" in err["message"] and "64" in err["message"], (path, param, err)
        if path != MESSAGES and path != COUNT:
            assert err["param"].startswith(param), (path, param, err)
        else:
            assert param in err["message"], err
    # Nested past what Python's parser takes: still a 400 that says so.
    for body in (
        b"[" * 100_000 + b"]" * 100_000,
        b'{"messages": [], "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ):
        err = refused(post(server, CHAT, body))
        assert "nest" in err["message"] and "64" in err["message"], err
    still_answers(server)


def test_nesting_within_the_limit_is_served(server):
    args = json.dumps(deep_object(40))
    r = post(server, CHAT, {"messages": called(args), "tools": TOOLS, "temperature": 0})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------
# 2. Responses text.format as a string


def test_a_responses_text_format_that_is_not_an_object_is_a_400(server):
    for text in ({"format": "json"}, {"format": 5}):
        err = refused(post(server, RESPONSES, {"input": "hi", "text": text}))
        assert err["param"] == "text.format" and err["code"] == "invalid_type", err
    err = refused(post(server, RESPONSES, {"input": "hi", "text": {"format": {"type": "xml"}}}))
    assert err["param"] == "text.format.type" and err["code"] == "invalid_value", err
    no_schema = {"format": {"type": "json_schema"}}
    err = refused(post(server, RESPONSES, {"input": "hi", "text": no_schema}))
    assert err["param"] == "text.format.schema", err
    assert err["code"] == "missing_required_parameter", err
    for text in ({"format": {"type": "text"}}, {}, {"format": None}, {"verbosity": "low"}):
        r = post(server, RESPONSES, {"input": "hi", "text": text, "max_output_tokens": 1})
        assert r.status_code == 200, (text, r.text)
    still_answers(server)


# ---------------------------------------------------------------------------------------
# 5. Sizes and counts: refused before parsing into models; /health answers meanwhile


def test_counts_over_the_limits_are_refused_naming_the_field(server):
    many = [{"role": "user", "content": "hi"}] * 10_001
    tool = TOOLS[0]
    cases = [
        (CHAT, {"messages": ASK, "stop": ["a", "b", "c", "d", "e"]}, "stop", 4),
        (CHAT, {"messages": many}, "messages", 10_000),
        (CHAT, {"messages": ASK, "tools": [tool] * 513}, "tools", 512),
        (MESSAGES, {"model": MODEL, "max_tokens": 1, "messages": ASK,
                    "stop_sequences": ["x"] * 17}, "stop_sequences", 16),
        (MESSAGES, {"model": MODEL, "max_tokens": 1, "messages": many}, "messages", 10_000),
        (RESPONSES, {"input": many}, "input", 10_000),
    ]  # fmt: skip
    for path, body, param, limit in cases:
        err = refused(post(server, path, body))
        assert f"maximum length {limit}," in err["message"], (param, err)
        if path != MESSAGES:
            assert (err["param"], err["code"]) == (param, "array_above_max_length"), err
    # Four stop strings are fine.
    r = post(server, CHAT, {"messages": ASK, "stop": ["a", "b", "c", "d"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    still_answers(server)


def test_a_tool_schema_too_big_is_refused(server):
    props = {f"p{i}": {"type": "string"} for i in range(6000)}
    big = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": props}}}  # fmt: skip
    err = refused(post(server, CHAT, {"messages": ASK, "tools": [big]}))
    assert err["param"] == "tools[0]" and "10000" in err["message"].replace(",", ""), err


def test_a_body_of_too_many_values_is_refused_before_parsing(server, monkeypatch):
    parsed = []
    real = limits.json.loads
    monkeypatch.setattr(limits, "json", types.SimpleNamespace(
        loads=lambda raw: parsed.append(len(raw)) or real(raw),
        JSONDecodeError=json.JSONDecodeError))  # fmt: skip
    body = b'{"messages": [], "stop": [' + b",".join([b'""'] * 1_100_000) + b"]}"
    err = refused(post(server, CHAT, body), 413)
    assert "1,000,000" in err["message"], err
    assert parsed == [], "the body was parsed before it was refused"
    still_answers(server)


def health(server) -> bytes:
    """/health's reply, on a new connection."""
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def test_health_answers_while_a_big_body_is_parsed(server, monkeypatch):
    """The parse of a body is held until /health has answered: were it parsed on the event
    loop, /health could not answer before the parse let go (after TIMEOUT), and the order
    seen would be parse, parse ended, health. Order, not seconds."""
    # 3 MB, 100k messages: over the count limit, refused once counted.
    many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 100_000}).encode()
    # 6 MB within the limits: 9,000 messages and 900k values the schemas ignore; parsed,
    # checked and rendered, then refused for its length.
    heavy = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}] * 9_000, "x": [0] * 900_000}
    ).encode()
    real = limits.parse
    for body, code in ((many, "array_above_max_length"), (heavy, "context_length_exceeded")):
        seen, parsing, answered = [], threading.Event(), threading.Event()

        def held(raw, schema, seen=seen, parsing=parsing, answered=answered):
            seen.append("parse")
            parsing.set()
            answered.wait(TIMEOUT)
            try:
                return real(raw, schema)
            finally:
                seen.append("parsed")

        monkeypatch.setattr(limits, "parse", held)
        server.wait_idle()
        result = []
        worker = threading.Thread(target=lambda b=body, r=result: r.append(post(server, CHAT, b)))
        worker.start()
        assert parsing.wait(TIMEOUT), "the body was never parsed"
        reply = health(server)
        seen.append("health")
        answered.set()
        worker.join(TIMEOUT)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        assert seen == ["parse", "health", "parsed"], seen
        assert refused(result[0])["code"] == code
    still_answers(server)


# ---------------------------------------------------------------------------------------
# 9. Leniencies: orphan tool results, bad schemas, NaN


def test_tool_results_must_answer_a_call(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}  # fmt: skip
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    cases = [
        (ASK + [{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[1]"),
        (ASK + [assistant, {"role": "tool", "tool_call_id": "call_2", "content": "x"}],
         "messages[2].tool_call_id"),
        (ASK + [assistant, {"role": "tool", "content": "x"}], "messages[2].tool_call_id"),
        (ASK + [assistant, {"role": "user", "content": "and?"},
                {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[3]"),
    ]  # fmt: skip
    for messages, param in cases:
        err = refused(post(server, CHAT, {"messages": messages, "tools": TOOLS}))
        assert err["param"] == param, err
    ok = ASK + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]
    assert post(server, CHAT, {"messages": ok, "tools": TOOLS}).status_code == 200

    def claude(blocks):
        tool_use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
        messages = ASK + [{"role": "assistant", "content": [tool_use]},
                          {"role": "user", "content": blocks}]  # fmt: skip
        return post(server, MESSAGES, {"model": MODEL, "max_tokens": 2, "messages": messages})

    err = refused(claude([{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]))
    assert "toolu_2" in err["message"] and "tool_use" in err["message"], err
    orphan = [ASK[0], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]  # fmt: skip
    err = refused(post(server, MESSAGES, {"model": MODEL, "max_tokens": 2, "messages": orphan}))
    assert "tool_use" in err["message"], err
    ok = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]
    assert claude(ok).status_code == 200
    items = [ASK[0], {"type": "function_call_output", "call_id": "c9", "output": "x"}]
    err = refused(post(server, RESPONSES, {"input": items}))
    assert err["param"] == "input[1].call_id" and "c9" in err["message"], err
    still_answers(server)


def test_tool_schemas_must_be_json_schemas(server):
    def chat(parameters):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        return post(server, CHAT, {"messages": ASK, "tools": [tool], "max_tokens": 1})

    bad = [
        ({"type": 5}, "tools[0].function.parameters", "5"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}},
         "tools[0].function.parameters", "properties.a.type"),
        ({"type": "object", "properties": {"a": {"type": ["string", 1]}}},
         "tools[0].function.parameters", "properties.a.type"),
        ({"type": "object", "properties": []}, "tools[0].function.parameters", "properties"),
        ({"type": "object", "properties": {"a": 3}}, "tools[0].function.parameters",
         "properties.a"),
        ({"type": "object", "required": "a"}, "tools[0].function.parameters", "required"),
        ({"type": "object", "items": {"anyOf": [{"type": {}}]}}, "tools[0].function.parameters",
         "items.anyOf[0].type"),
    ]  # fmt: skip
    for parameters, param, named in bad:
        err = refused(chat(parameters))
        assert err["param"] == param and named in err["message"], (parameters, err)
    good = [
        {"type": "object", "properties": {"type": {"type": "string"}}},  # a property "type"
        {"type": "object", "properties": {"a": {"enum": [{"type": 5}]}}},  # data, not schema
        {"type": ["object", "null"], "properties": {"a": True}},
        {},
    ]
    for parameters in good:
        assert chat(parameters).status_code == 200, parameters
    tool = {"name": "f", "input_schema": {"type": 5}}
    err = refused(post(server, MESSAGES, {"model": MODEL, "max_tokens": 1, "messages": ASK,
                                          "tools": [tool]}))  # fmt: skip
    assert "tools[0].input_schema" in err["message"], err
    tool = {"type": "function", "name": "f", "parameters": {"type": 5}}
    err = refused(post(server, RESPONSES, {"input": "hi", "tools": [tool]}))
    assert err["param"] == "tools[0].parameters", err
    still_answers(server)


def test_a_temperature_that_is_not_a_number_says_so(server):
    for path, extra in ((CHAT, {}), (MESSAGES, {"model": MODEL, "max_tokens": 1})):
        for value in (b"NaN", b"Infinity", b"-Infinity"):
            body = json.dumps({"messages": ASK, **extra, "temperature": 0.5}).encode()
            err = refused(post(server, path, body.replace(b"0.5", value)))
            assert "not a" in err["message"] and "number" in err["message"], err
            assert "less than" not in err["message"], err
    err = refused(post(server, RESPONSES, b'{"input": "hi", "top_p": NaN}'))
    assert err["param"] == "top_p" and "not a number" in err["message"], err
    still_answers(server)
