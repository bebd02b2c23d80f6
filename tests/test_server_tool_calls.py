"""Tool calls that survive their arguments (issue 63): a call whose argument holds the end
marker (`</tool_call>`) was cut there, the client got no call and the markup as text; a
lone surrogate escape (`\\ud800`) broke every renderer; NaN and Infinity reached
`arguments` as no JSON; a number as the call's id went through; tool `parameters` that are
no object schema were accepted. On all three APIs (OpenAI chat, Anthropic messages,
Responses), streamed and not, with the official clients against real uvicorn on loopback.

The target is `test_server_agents`' scripted model: the last token of the prompt picks a
script (here the user's message itself, a mode token), which the model writes token by token.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from dflash_mlx.server.tool_calls import json_open

from .test_server import MODEL, TIMEOUT, serving
from .test_server_agents import TEMPLATE, build_scripted

# The prompt ends with the user's message when it is a mode token (`<|inside|>`).
MODE_TEMPLATE = TEMPLATE.replace(
    "{%- if messages[-1].role == 'tool' %}",
    "{%- if messages[-1].content.startswith('<|') %}{{ messages[-1].content }}"
    "{%- elif messages[-1].role == 'tool' %}",
)
CODE = "print('</tool_call>')"  # the argument holding the end marker
SCRIPTS = {
    # the marker inside the argument, whole in one token with the call's real end
    "<|whole|>": ['<tool_call>\n{"name": "run", "arguments": {"code": "print(\'</tool_call>\')"}}'
                  "\n</tool_call>"],
    # the marker split across tokens, the call's end a token of its own
    "<|split|>": ['<tool_call>\n{"name": "run", "arguments": {"code": "print(\'</tool_',
                  "call>')\"}}\n", "</tool_call>", "Done."],
    "<|nan|>": ['<tool_call>\n{"name": "run", "arguments": {"x": NaN}}\n</tool_call>'],
    "<|surrogate|>": ['<tool_call>\n{"name": "run", "arguments": {"s": "a\\ud800b"}}\n'
                      "</tool_call>"],
    "<|number id|>": ['<tool_call>\n{"name": "run", "id": 5, "arguments": {"x": 1}}\n'
                      "</tool_call>"],
}  # fmt: skip
RUN = {
    "type": "function",
    "function": {
        "name": "run",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("calls")
    build_scripted(root, SCRIPTS, MODE_TEMPLATE)
    pair = dict(target="scripted", draft="scripted-draft", verify_width=4)
    with serving(root, settings={"default_max_tokens": 64}, **pair) as s:
        yield s


@pytest.fixture
def oai(server) -> openai.OpenAI:
    server.wait_idle()
    return server.client()


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    server.wait_idle()
    return anthropic.Anthropic(base_url=server.base, api_key="x", timeout=TIMEOUT, max_retries=0)


def ask(mode: str) -> list[dict]:
    return [{"role": "user", "content": mode}]


def chat_calls(oai, mode: str, stream: bool) -> tuple[list[tuple[str, str, str]], str, str]:
    """(id, name, arguments) of each call, the text, and the finish reason."""
    kw = dict(model=MODEL, messages=ask(mode), tools=[RUN], temperature=0)
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        calls = choice.message.tool_calls or []
        out = [(c.id, c.function.name, c.function.arguments) for c in calls]
        return out, choice.message.content or "", choice.finish_reason
    calls: dict[int, list[str]] = {}
    text, finish = "", None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, [c.id, "", ""])
            entry[1] += c.function.name or ""
            entry[2] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["<|whole|>", "<|split|>"])
def test_a_call_whose_argument_holds_the_end_marker_is_one_call(oai, claude, mode, stream):
    calls, text, finish = chat_calls(oai, mode, stream)
    assert [(name, json.loads(args)) for _, name, args in calls] == [("run", {"code": CODE})]
    assert "tool_call" not in text and finish == "tool_calls", (text, finish)
    # Anthropic messages
    kw = dict(model=MODEL, max_tokens=64, messages=ask(mode),
              tools=[{"name": "run", "input_schema": RUN["function"]["parameters"]}])  # fmt: skip
    if stream:
        with claude.messages.stream(**kw) as events:
            msg = events.get_final_message()
    else:
        msg = claude.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("run", {"code": CODE})], msg.content
    assert not any("tool_call" in b.text for b in msg.content if b.type == "text")
    # Responses
    tools = [{"type": "function", **RUN["function"]}]
    rkw = dict(model=MODEL, input=mode, tools=tools, temperature=0)
    if stream:
        response = list(oai.responses.create(**rkw, stream=True))[-1].response
    else:
        response = oai.responses.create(**rkw)
    calls = [i for i in response.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", {"code": CODE})]
    assert "tool_call" not in (response.output_text or "")


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_a_call_breaks_no_renderer(oai, claude, stream):
    calls, _, _ = chat_calls(oai, "<|surrogate|>", stream)
    assert [json.loads(args) for _, _, args in calls] == [{"s": "a\ufffdb"}]
    kw = dict(model=MODEL, max_tokens=64, messages=ask("<|surrogate|>"),
              tools=[{"name": "run", "input_schema": {"type": "object"}}])  # fmt: skip
    if stream:
        with claude.messages.stream(**kw) as events:
            msg = events.get_final_message()
    else:
        msg = claude.messages.create(**kw)
    assert [b.input for b in msg.content if b.type == "tool_use"] == [{"s": "a\ufffdb"}]
    tools = [{"type": "function", **RUN["function"]}]
    rkw = dict(model=MODEL, input="<|surrogate|>", tools=tools)
    response = (
        list(oai.responses.create(**rkw, stream=True))[-1].response
        if stream
        else oai.responses.create(**rkw)
    )
    calls = [i for i in response.output if i.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"s": "a\ufffdb"}]


@pytest.mark.parametrize("stream", [False, True])
def test_nan_arguments_are_refused_and_a_number_id_becomes_a_string(oai, stream):
    calls, _, finish = chat_calls(oai, "<|nan|>", stream)
    assert calls == [] and finish == "stop", calls  # no call with arguments no JSON parses
    calls, _, finish = chat_calls(oai, "<|number id|>", stream)
    ((ident, name, args),) = calls
    assert isinstance(ident, str) and ident and ident != "5", ident
    assert (name, json.loads(args), finish) == ("run", {"x": 1}, "tool_calls")
    assert httpx.get(f"{oai.base_url}".removesuffix("/v1/") + "/health").status_code == 200


@pytest.mark.parametrize(
    "parameters",
    [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}, {"type": ["null"]}],
)
def test_tool_parameters_must_be_an_object_schema(server, parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    for path, body in [
        ("/v1/chat/completions", {"model": MODEL, "messages": ask("hi"), "tools": [tool]}),
        ("/v1/responses", {"model": MODEL, "input": "hi",
                           "tools": [{"type": "function", **tool["function"]}]}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": ask("hi"),
                          "tools": [{"name": "f", "input_schema": parameters}]}),
    ]:  # fmt: skip
        r = httpx.post(f"{server.base}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, (path, r.text[:300])
        error = r.json()["error"]
        assert "object" in error["message"] and "tools" in (error.get("param") or "tools"), error


def test_json_open_follows_strings_and_escapes():
    assert json_open('{"a": "</tool_call>')
    assert json_open('{"a": "x\\"}')
    assert not json_open('{"a": "x\\\\"}')
    assert not json_open('\n{"a": [1, {"b": "}"}]}\n')
    assert not json_open("not json")
