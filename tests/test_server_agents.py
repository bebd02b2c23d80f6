"""Agent-grade serving: tool calls and reasoning through the official `openai` (chat
completions, Responses) and `anthropic` (Messages) SDKs, and the server's safe defaults,
against real uvicorn on loopback.

The target is scripted: an mlx-lm Qwen3 whose attention and MLP outputs are zero, whose
embedding is one-hot and whose LM head maps each token to the next token of a scripted
reply, so the greedy reply depends on the prompt's last token only. Its chat template
(which mlx-lm's parser inference reads as the JSON `<tool_call>` family, with `<think>`
reasoning) ends the prompt with a mode token: `<|tools|>` when tools are offered (reply:
reasoning, then two tool calls), `<|answer|>` after a tool result (a text answer),
`<think>` when the user says `/think` (the template opens the reasoning: the reply goes
on from inside it), `<|plain|>` otherwise. Script pieces are added tokens, so each token
has one successor. It runs through the DFlash engine with a random draft at verify width 4.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.models.tiny import (
    build_draft,
    draft_config,
    qwen3_config,
    save_model,
    write_tokenizer,
)

from .test_server import MODEL, TIMEOUT, serving

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant"
    "{%- if messages[-1].role == 'tool' %}<|answer|>"
    "{% elif messages[-1].content == '/think' %}<think>{% elif tools %}<|tools|>"
    "{% else %}<|plain|>{% endif %}{%- endif %}"
)
REASONING = "The user wants the weather."
CALL1 = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
# A whole second call in one token: the text state machine splits decoded text, not ids.
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
PLAIN = ["Hello", " from the script."]
ANSWER = "It is sunny in Paris."
SCRIPTS = {
    "<|plain|>": PLAIN,
    "<|tools|>": ["<think>", REASONING, "</think>", "<tool_call>", CALL1, "</tool_call>", CALL2],
    "<|answer|>": [ANSWER],
}
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "clé-ü-🔑"  # a non-ASCII API key: clients send it UTF-8 encoded
ALLOWED = "https://app.example"


def build_scripted(root: Path, scripts: dict | None = None, template: str = TEMPLATE) -> None:
    """The scripted target in `root/scripted` and a random draft in `root/scripted-draft`:
    `scripts` (SCRIPTS) maps a mode token to the pieces the reply is, each an added token."""
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    folder = root / "scripted"
    write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    scripts = SCRIPTS if scripts is None else scripts
    extra = [*scripts, *MARKERS]
    extra += [p for pieces in scripts.values() for p in pieces if p not in extra]
    tok.add_special_tokens(extra)
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))

    hidden = 64 * -(-tok.get_vocab_size() // 64)  # one-hot embeddings need hidden >= vocab
    eos = tok.token_to_id("<|endoftext|>")
    successor = {}
    for start, pieces in scripts.items():
        seq = [tok.token_to_id(start), *(tok.token_to_id(p) for p in pieces), eos]
        for a, b in zip(seq, seq[1:]):
            assert a not in successor, "a script token with two successors"
            successor[a] = b
    # Attention and MLP add nothing (their outputs are zero): they are as narrow as they can
    # be, so that a long prompt (the fuzzer's thousands of brackets) costs the lm head alone.
    narrow = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16)
    config = {**qwen3_config(vocab=hidden, layers=2, hidden=hidden), **narrow}
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    weights = {
        k: mx.zeros_like(v)
        for k, v in tree_flatten(model.parameters())
        if k.endswith(("o_proj.weight", "down_proj.weight"))
    }
    weights["model.embed_tokens.weight"] = mx.eye(hidden)
    rows = mx.array([successor.get(t, eos) for t in range(hidden)])
    head = mx.zeros((hidden, hidden)).at[rows, mx.arange(hidden)].add(4.0)
    weights["lm_head.weight"] = head
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    save_model(folder, model, config)
    draft = {**draft_config(2, [0, 1], hidden=hidden, vocab=hidden), **narrow}
    build_draft(root / "scripted-draft", draft, 5)


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scripted")
    build_scripted(root)
    return root


@pytest.fixture(scope="module")
def agent(scripted_dir):
    settings = dict(cors_origins=(ALLOWED,), max_body_mb=1.0, body_timeout=1.0, header_timeout=1.0)
    pair = dict(target="scripted", draft="scripted-draft", verify_width=4)
    with serving(scripted_dir, settings=settings, **pair) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(scripted_dir):
    pair = dict(target="scripted", draft="scripted-draft", verify_width=4)
    with serving(scripted_dir, api_key=KEY, **pair) as s:
        yield s


@pytest.fixture
def oai(agent) -> openai.OpenAI:
    agent.wait_idle()
    return agent.client()


@pytest.fixture
def claude(agent) -> anthropic.Anthropic:
    agent.wait_idle()
    return anthropic.Anthropic(
        base_url=agent.base, api_key="unused", timeout=TIMEOUT, max_retries=0
    )


def no_markup(text: str | None) -> None:
    for marker in MARKERS:
        assert marker not in (text or ""), f"{marker} leaked into {text!r}"


# ---------------------------------------------------------------------------------------
# OpenAI chat completions


def test_tool_calls_come_back_as_openai_sends_them(oai):
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.type == "function" and c.id for c in calls) and calls[0].id != calls[1].id
    assert not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == REASONING
    timings = out.model_extra["timings"]
    assert timings["cycles"] > 0 and timings["verify_width"] == 4  # through DFlash cycles


def test_streamed_tool_calls_are_deltas_with_an_index(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, stream=True
    )
    content, reasoning, calls, finishes = "", "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finishes.append(chunk.choices[0].finish_reason)
    assert content == "" and reasoning == REASONING
    assert sorted(calls) == [0, 1]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
        "city": "Paris"
    }
    assert calls[1]["name"] == "get_time" and calls[0]["id"] != calls[1]["id"]
    assert finishes[-1] == "tool_calls" and finishes.count(None) == len(finishes) - 1


def test_a_tool_result_in_the_history_gets_the_answer(oai, agent):
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": call.function.model_dump()}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    out = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0)
    assert out.choices[0].message.content == ANSWER
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls
    # The call went through the template: the prompt holds it, arguments as JSON.
    tok = agent.engine.tokenizer
    ids = tok.apply_chat_template(
        [ASK[0], {**history[1], "tool_calls": [{"function": {**call.function.model_dump(),
         "arguments": {"city": "Paris"}}}]}, history[2]],
        tools=TOOLS,
        add_generation_prompt=True,
    )  # fmt: skip
    assert out.usage.prompt_tokens == len(ids)


def test_reasoning_opened_by_the_template_is_reasoning(oai):
    think = [{"role": "user", "content": "/think"}]
    out = oai.chat.completions.create(model=MODEL, messages=think, tools=TOOLS, temperature=0)
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING and not message.content
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]


def test_tool_choice_and_parallel_tool_calls(oai):
    one = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, parallel_tool_calls=False
    )
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    none = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0
    )  # the tools are not shown to the model
    assert none.choices[0].message.content == "".join(PLAIN)
    # A named (forced) choice is a grammar, which the script's added-token pieces cannot
    # follow: tests/test_server_structured.py forces calls on a random model.
    with pytest.raises(openai.BadRequestError) as e:
        missing = {"type": "function", "function": {"name": "nope"}}
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=missing)
    assert e.value.param == "tool_choice" and "nope" in e.value.message


def test_a_call_cut_off_by_max_tokens_is_reported_not_leaked(oai):
    # <think>, reasoning, </think>, <tool_call>, the call's JSON: the budget ends inside it.
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=5)
    out = oai.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.model_extra["truncated_tool_call"]
    assert not choice.message.tool_calls and not choice.message.content
    text = ""
    for chunk in oai.chat.completions.create(**kw, stream=True):
        text += chunk.choices[0].delta.content or ""
        last = chunk
    assert text == "" and last.choices[0].finish_reason == "length"


def test_plain_chat_has_no_reasoning_and_no_markup(oai):
    out = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
    assert out.choices[0].message.content == "".join(PLAIN)
    assert "reasoning_content" not in out.choices[0].message.model_extra
    assert out.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------
# Anthropic Messages

A_TOOLS = [
    {
        "name": t["function"]["name"],
        "input_schema": t["function"]["parameters"],
        **({"description": t["function"]["description"]} if "description" in t["function"] else {}),
    }
    for t in TOOLS
]


def test_anthropic_messages_with_tools(claude):
    msg = claude.messages.create(
        model=MODEL, max_tokens=64, messages=ASK, tools=A_TOOLS, extra_body={"temperature": 0}
    )
    assert [b.type for b in msg.content] == ["thinking", "tool_use", "tool_use"]
    assert msg.content[0].thinking == REASONING
    assert (msg.content[1].name, msg.content[1].input) == ("get_weather", {"city": "Paris"})
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 8 and msg.usage.input_tokens > 0
    # The tool result goes back in a user message; the answer is text.
    turn2 = ASK + [
        {"role": "assistant", "content": msg.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": msg.content[1].id, "content": "sunny"},
                {"type": "tool_result", "tool_use_id": msg.content[2].id, "content": "9:00"},
            ],
        },
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=64, messages=turn2, tools=A_TOOLS)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == ANSWER
    assert answer.stop_reason == "end_turn"


def test_anthropic_stream_has_its_event_sequence(claude, agent):
    kw = dict(model=MODEL, max_tokens=64, messages=ASK, tools=A_TOOLS)
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream if e.type.startswith(("message", "content_block"))]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use"]
    assert final.content[0].thinking == REASONING
    assert final.content[2].input == {"zone": "CET"} and final.stop_reason == "tool_use"
    whole = claude.messages.create(**kw)
    assert final.usage.output_tokens == whole.usage.output_tokens == 8
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        assert stream.get_final_text() == "".join(PLAIN)
    # On the wire: each event named, a ping after message_start, deltas of each kind.
    body = {**kw, "stream": True}
    with httpx.stream("POST", f"{agent.base}/v1/messages", json=body, timeout=TIMEOUT) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
        assert r.headers["content-type"].startswith("text/event-stream")
    assert names[:2] == ["message_start", "ping"]


def test_anthropic_stop_sequences_max_tokens_and_system(claude):
    msg = claude.messages.create(
        model=MODEL, max_tokens=64, messages=ASK, system="Be brief.", stop_sequences=["script"]
    )
    assert msg.content[0].text == "Hello from the " and msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == "script"
    short = claude.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert short.stop_reason == "max_tokens" and short.content[0].text == "Hello"


def test_anthropic_count_tokens_matches_the_rendered_prompt(claude, agent):
    system = [{"type": "text", "text": "You are terse."}]
    n = claude.messages.count_tokens(model=MODEL, messages=ASK, system=system, tools=A_TOOLS)
    tok = agent.engine.tokenizer
    msgs = [{"role": "system", "content": "You are terse."}, *ASK]
    assert n.input_tokens == len(
        tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True)
    )


def test_anthropic_errors_have_anthropic_shape(claude, agent):
    # Any model name is served by the loaded model (Claude Code sends its own names).
    served = claude.messages.create(model="claude-x", max_tokens=5, messages=ASK)
    assert served.model == MODEL and served.content[0].text
    r = httpx.post(agent.base + "/v1/messages/nowhere", json={}, timeout=TIMEOUT)
    body = r.json()
    assert r.status_code == 404, body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]


# ---------------------------------------------------------------------------------------
# Responses


R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_with_tools_streamed_and_not(oai):
    out = oai.responses.create(model=MODEL, input=ASK[0]["content"], tools=R_TOOLS, temperature=0)
    assert out.status == "completed"
    assert [i.type for i in out.output] == ["reasoning", "function_call", "function_call"]
    assert out.output[0].content[0].text == REASONING
    call = out.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.usage.output_tokens == 8
    events = list(
        oai.responses.create(
            model=MODEL, input=ASK[0]["content"], tools=R_TOOLS, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call", "function_call"]
    assert [i.arguments for i in final.output[1:]] == [i.arguments for i in out.output[1:]]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    # The calls' outputs go back as items: the answer is a message.
    follow = oai.responses.create(
        model=MODEL,
        input=[
            ASK[0],
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=R_TOOLS,
        temperature=0,
    )  # fmt: skip
    assert follow.output_text == ANSWER and [i.type for i in follow.output] == ["message"]
    streamed = oai.responses.create(model=MODEL, input="hi", instructions="Be brief.", stream=True)
    deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "".join(PLAIN)


def test_responses_refuses_stored_state(oai):
    for kw in ({"store": True}, {"previous_response_id": "resp_123"}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=MODEL, input="hi", **kw)
        assert "stateless" in e.value.message
    out = oai.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=1)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"


# ---------------------------------------------------------------------------------------
# Safe by default


def post(server, path: str, body, **headers) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    return httpx.post(f"{server.base}{path}", content=data, headers=headers, timeout=TIMEOUT)


def test_cors_grants_only_loopback_and_configured_origins(agent):
    body = {"messages": ASK, "max_tokens": 1}
    r = post(agent, "/v1/chat/completions", body, Origin="https://evil.example")
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "--cors-origin" in r.json()["error"]["message"]
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", ALLOWED):
        r = post(agent, "/v1/chat/completions", body, Origin=origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    preflight = {"Access-Control-Request-Method": "POST"}
    evil = httpx.options(
        f"{agent.base}/v1/messages",
        headers={"Origin": "https://evil.example", **preflight},
        timeout=TIMEOUT,
    )
    assert "access-control-allow-origin" not in evil.headers
    ok = httpx.options(
        f"{agent.base}/v1/messages", headers={"Origin": ALLOWED, **preflight}, timeout=TIMEOUT
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED


def test_foreign_host_names_are_refused_on_loopback(agent):
    port = agent.base.rsplit(":", 1)[1]
    body = {"messages": ASK, "max_tokens": 1}
    r = post(agent, "/v1/chat/completions", body, Host=f"attacker.example:{port}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = post(agent, "/v1/messages", {**body, "model": MODEL}, Host=f"rebind.example:{port}")
    assert r.status_code == 403 and r.json()["type"] == "error"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert post(agent, "/v1/chat/completions", body, Host=host).status_code == 200


def test_body_limit_is_enforced_before_parsing(agent):
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * 1_100_000 + b'"}]}'
    r = post(agent, "/v1/chat/completions", big)
    assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(12):
            yield b" " * 100_000

    r = httpx.post(
        f"{agent.base}/v1/messages",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_an_oversized_prompt_is_refused_before_tokenization(agent, monkeypatch):
    from dflash_mlx.server.core import Service

    def never(self, req):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(Service, "_encode", never)
    prompt = "fox " * 200_000  # 800 kB: within the body limit, far past 4096 tokens
    for path, extra in (("/v1/chat/completions", {}), ("/v1/messages", {"model": MODEL})):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, **extra}
        r = post(agent, path, body)
        assert r.status_code == 400, r.text
        assert "at least" in r.json()["error"]["message"]
    r = post(agent, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_clients_that_never_finish_sending_are_dropped(agent):
    host, port = agent.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no end
        # Closed by the server's header timeout (the socket's own timeout, TIMEOUT, would
        # raise instead): no threshold in seconds here.
        assert s.recv(1024) == b"", "the server answered a request it never got"
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mess'
        )
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_invalid_unicode_is_a_400_naming_it(agent):
    bad = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = post(agent, "/v1/chat/completions", bad)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    r = post(agent, "/v1/messages", bad.replace(b'"max_tokens"', b'"model": "tiny", "max_tokens"'))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert agent.health()["status"] == "ok"


def test_api_keys_are_bytes_compared_and_accepted_in_both_headers(keyed):
    keyed.wait_idle()
    utf8 = KEY.encode()
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    for headers in ({"Authorization": b"Bearer " + utf8}, {"x-api-key": utf8}):
        r = httpx.post(f"{keyed.base}/v1/messages", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{keyed.base}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed.base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(f"{keyed.base}/health", timeout=TIMEOUT).status_code == 200


def test_docs_work_offline(agent):
    r = httpx.get(f"{agent.base}/docs", timeout=TIMEOUT)
    assert r.status_code == 200 and "/v1/messages" in r.text and "/v1/responses" in r.text
    assert "<script" not in r.text and "cdn" not in r.text.lower() and "https://" not in r.text


# ---------------------------------------------------------------------------------------
# Failures: ours vs the caller's, and a worker that dies


def test_user_errors_are_4xx_and_ours_are_generic_500s(agent, monkeypatch):
    from dflash_mlx.engine.batch import BatchDecoder
    from dflash_mlx.errors import ContextTooLong
    from dflash_mlx.server import engine as engine_module

    def fail_with(exc):
        def stream_generate(*args, **kwargs):
            raise exc
            yield

        def submit(*args, **kwargs):
            raise exc

        # Where a request starts, one at a time or in a batch (the server's default).
        monkeypatch.setattr(engine_module, "stream_generate", stream_generate)
        monkeypatch.setattr(BatchDecoder, "submit", submit)

    body = {"messages": ASK, "max_tokens": 2}
    fail_with(ContextTooLong("the prompt and max_tokens need 5000 positions, the context has 4096"))
    r = post(agent, "/v1/chat/completions", body)
    assert r.status_code == 400 and "5000 positions" in r.json()["error"]["message"]
    fail_with(RuntimeError("secret internal detail"))
    r = post(agent, "/v1/chat/completions", body)
    assert r.status_code == 500 and "secret" not in r.text
    r = post(agent, "/v1/messages", {**body, "model": MODEL})
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    monkeypatch.undo()
    assert post(agent, "/v1/chat/completions", body).status_code == 200


class _Crash(BaseException):
    """Not an Exception: escapes the per-request handling and kills the worker."""


def test_a_dead_worker_answers_503_and_is_restarted(agent, monkeypatch):
    from dflash_mlx.server.batching import Batcher

    engine = agent.engine
    agent.wait_idle()
    before = engine.restarts
    release = threading.Event()
    serve = engine._serve

    def crash(job):
        # The replacement worker waits for the test before serving: the gap is observable.
        engine._serve = lambda: (release.wait(TIMEOUT), serve())
        raise _Crash("boom")

    monkeypatch.setattr(engine, "_run", crash)  # one request at a time
    monkeypatch.setattr(Batcher, "_start", lambda self, job: crash(job))  # in a batch
    body = {"messages": ASK, "max_tokens": 2}
    r = post(agent, "/v1/chat/completions", body)  # the request running when it died
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting"
    health = httpx.get(f"{agent.base}/health", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json()["status"] == "restarting"
    r = post(agent, "/v1/chat/completions", body)  # refused at once, not queued
    assert r.status_code == 503
    monkeypatch.undo()
    engine._serve = serve
    release.set()
    state = agent.wait_until(lambda h: h["status"] == "ok", "the worker is back")
    assert state["restarts"] == before + 1
    assert post(agent, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
