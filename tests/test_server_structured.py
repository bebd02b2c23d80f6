"""Structured output and sampling controls through the server (issue 24): JSON replies
(`response_format`, Responses' `text.format`), forced tool calls (OpenAI's, Anthropic's and
Responses' `tool_choice`), logprobs, penalties and logit_bias, with the official `openai`
and `anthropic` clients against a real uvicorn server on loopback.

The targets are untrained random models speculating with a random draft (verify width 4):
whatever they write, a constrained reply must parse and follow its schema; logprobs are
compared with the target's own log-softmax, computed here from the model.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest

import dflash_mlx
from dflash_mlx.models.tiny import (
    build_draft,
    build_target,
    draft_config,
    qwen3_config,
    write_tokenizer,
)
from dflash_mlx.server.errors import APIError
from dflash_mlx.server.structured import tool_grammar

from .test_server import MODEL, TIMEOUT, WIDTH, serving

PROMPT = "def add(a, b):"
USER = [{"role": "user", "content": PROMPT}]
COLORS = ["red", "green", "blue"]
# Every property bounded (an enum, a number range, short strings, few items), so that even a
# random model's reply ends: the grammar closes the object once each is written.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": COLORS},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "tags", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
LOGPROB_TOLERANCE = 2e-2


def follows(value, schema=SCHEMA) -> None:
    """Assert that `value` follows SCHEMA (the keywords it uses, nothing more)."""
    assert isinstance(value, dict), f"not an object: {value!r}"
    assert set(value) == set(schema["required"]), f"keys {sorted(value)}"
    assert value["color"] in COLORS, value
    size = value["size"]
    assert isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= 99, value
    tags = value["tags"]
    assert isinstance(tags, list) and len(tags) <= 3, value
    assert all(isinstance(t, str) and len(t) <= 6 for t in tags), value
    assert isinstance(value["ok"], bool), value


@pytest.fixture(scope="module")
def server(models_dir):
    with serving(models_dir, verify_width=WIDTH, settings={"default_max_tokens": 200}) as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    server.wait_idle()  # references below run MLX on this thread: never beside the worker
    return server.client()


def log_softmax_rows(model, ids: list[int]) -> mx.array:
    """The target's log-probabilities of the next token after each prefix of `ids`."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------
# JSON replies


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_replies_of_a_random_model_parse_and_follow_the_schema(client, seed):
    out = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=1, seed=seed, response_format=FORMAT
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    follows(json.loads(choice.message.content))


def test_streamed_json_schema_replies_parse_and_follow_the_schema(client):
    for seed in (3, 4):
        text, finish = "", None
        stream = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            temperature=1,
            seed=seed,
            response_format=FORMAT,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", (finish, text)
        follows(json.loads(text))


def test_text_completions_take_a_response_format_too(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=1, seed=5, extra_body={"response_format": FORMAT}
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    follows(json.loads(out.choices[0].text))


def test_json_object_replies_parse_as_an_object(client):
    for seed in (0, 1):
        out = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            temperature=1,
            seed=seed,
            max_tokens=400,
            response_format={"type": "json_object"},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        assert isinstance(json.loads(choice.message.content), dict)


def test_an_invalid_schema_is_a_400_naming_what_is_wrong(client):
    bad_type = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, response_format=bad_type)
    assert e.value.param.startswith("response_format") and "strin" in e.value.message
    # Structurally a schema, but no grammar can be made of it: the engine's check says why.
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    bad_ref = {"type": "json_schema", "json_schema": {"name": "x", "schema": dangling}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, response_format=bad_ref)
    assert e.value.param == "response_format" and "missing" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_schema"}
        )
    assert e.value.param == "response_format.json_schema"
    # Plain text is what it always was.
    out = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=4, response_format={"type": "text"}
    )
    assert out.choices[0].finish_reason == "length"


class CountingMatcher:
    """llguidance's `LLMatcher`, counting the grammars built and the threads that built them."""

    def __init__(self, real):
        self.real = real
        self.threads: list[str] = []

    def __getattr__(self, name):  # its static methods
        return getattr(self.real, name)

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.real(*args, **kwargs)


def test_a_grammar_is_built_once_off_the_engine_thread(client, monkeypatch):
    """A request's grammar is built when the server checks it, not on the engine's thread
    (where every running stream would wait for it); the engine's matcher is a copy."""
    import llguidance

    counting = CountingMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    # A schema of its own, so that no earlier request's build is kept for it.
    schema = {**SCHEMA, "description": f"once {uuid.uuid4()}"}
    fmt = {"type": "json_schema", "json_schema": {"name": "once", "schema": schema}}
    for _ in range(2):
        out = client.chat.completions.create(
            model=MODEL, messages=USER, temperature=0, max_tokens=60, response_format=fmt
        )
        assert out.choices[0].message.content
    assert len(counting.threads) == 1, counting.threads
    assert counting.threads[0] != "dflash-mlx-engine"


def test_a_grammar_too_costly_to_build_is_a_400_naming_the_format(client, monkeypatch):
    from dflash_mlx.engine import controls
    from dflash_mlx.server import structured

    real = controls.check_grammar

    def slow(*args, **kwargs):
        time.sleep(1.0)  # longer than the bound below: a build that would take too long
        return real(*args, **kwargs)

    monkeypatch.setattr(controls, "check_grammar", slow)
    monkeypatch.setattr(structured, "BUILD_SECONDS", 0.2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, response_format=FORMAT)
    assert e.value.param == "response_format", e.value.message
    assert "longer than 0.2 s to build" in e.value.message
    time.sleep(1.2)  # the refused build ends in its thread
    monkeypatch.setattr(structured, "BUILD_SECONDS", 5.0)
    monkeypatch.setattr(controls, "check_grammar", real)
    out = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=60, response_format=FORMAT
    )
    follows(json.loads(out.choices[0].message.content))


def test_compiled_grammars_are_copies_that_never_share_their_state(tokenizer_and_vocab):
    from dflash_mlx.engine.controls import compile_grammar

    tok, vocab = tokenizer_and_vocab
    opts = dflash_mlx.GenerateOptions(json_schema={"type": "object"})
    a = compile_grammar(opts, tok, vocab)
    b = compile_grammar(opts, tok, vocab)
    assert a.matcher is not b.matcher
    first = int(np.flatnonzero(a.allowed(a.mask()))[0])  # '{'
    a.consume([first])
    assert not np.array_equal(a.mask(), b.mask()), "consuming one changed the other"
    c = compile_grammar(opts, tok, vocab)
    assert np.array_equal(c.mask(), b.mask()), "a later copy starts where a fresh one does"


@pytest.fixture(scope="module")
def tokenizer_and_vocab(server):
    return server.engine.tokenizer, server.engine.pair.target.logits_width


def test_responses_text_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    for stream in (False, True):
        kw = dict(model=MODEL, input=PROMPT, temperature=1, text={"format": fmt})
        if stream:
            events = list(client.responses.create(**kw, stream=True))
            response = events[-1].response
        else:
            response = client.responses.create(**kw)
        assert response.status == "completed", response
        assert response.text.format.type == "json_schema"
        follows(json.loads(response.output_text))
    with pytest.raises(openai.BadRequestError) as e:
        bad = {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nope"}}
        client.responses.create(model=MODEL, input=PROMPT, text={"format": bad})
    assert e.value.param == "text.format"


# ---------------------------------------------------------------------------------------
# Logprobs


def test_completion_logprobs_are_the_targets_log_softmax(client, target):
    model, tok = target
    ids = tok.encode(PROMPT)
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=ids, temperature=0, max_tokens=12, logprobs=5)
        if stream:
            chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for c in chunks:
                if c.choices[0].logprobs is not None:
                    for key in lp:
                        lp[key] += getattr(c.choices[0].logprobs, key)
        else:
            out = client.completions.create(**kw)
            text = out.choices[0].text
            lp = out.choices[0].logprobs.model_dump()
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 12
        assert all(len(t) == 5 for t in lp["top_logprobs"])
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
        reference = dflash_mlx.generate(model, None, tok, ids, max_tokens=12, temperature=0)
        rows = log_softmax_rows(model, ids + reference.tokens)
        for i, (token, got) in enumerate(zip(reference.tokens, lp["token_logprobs"])):
            want = rows[len(ids) - 1 + i, token].item()
            assert abs(got - want) < LOGPROB_TOLERANCE, (i, got, want)
            best = sorted(rows[len(ids) - 1 + i].tolist(), reverse=True)[:5]
            tops = sorted(lp["top_logprobs"][i].values(), reverse=True)
            assert len(tops) <= 5 and abs(tops[0] - best[0]) < LOGPROB_TOLERANCE


def test_chat_logprobs_streamed_and_not_have_the_asked_top_count(client, target):
    model, tok = target
    ids = tok.apply_chat_template(USER, add_generation_prompt=True)
    kw = dict(model=MODEL, messages=USER, temperature=0, max_tokens=10, logprobs=True)
    out = client.chat.completions.create(**kw, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 10 and all(len(t.top_logprobs) == 3 for t in content)
    assert shown(content) == out.choices[0].message.content
    greedy = dflash_mlx.generate(model, None, tok, USER, max_tokens=10, temperature=0)
    rows = log_softmax_rows(model, ids + greedy.tokens)
    for i, entry in enumerate(content):
        want = rows[len(ids) - 1 + i, greedy.tokens[i]].item()
        assert abs(entry.logprob - want) < LOGPROB_TOLERANCE, (i, entry.logprob, want)
        assert bytes(entry.bytes).decode("utf-8", "replace") or entry.token
        top = entry.top_logprobs[0]
        assert abs(top.logprob - rows[len(ids) - 1 + i].max().item()) < LOGPROB_TOLERANCE
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert all(t.top_logprobs == [] for t in streamed)  # top_logprobs left out: none
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, top_logprobs=2)
    assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs"


def shown(content) -> str:
    """The text chat logprobs' tokens make (the random model writes broken UTF-8)."""
    return b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")


def test_tokens_cut_by_a_stop_string_and_the_eos_get_no_logprobs(client, target):
    model, tok = target
    ids = tok.encode(PROMPT)
    greedy = dflash_mlx.generate(model, None, tok, ids, max_tokens=16, temperature=0)
    # The first token of the greedy reply whose text is a word, new to the reply: the stop.
    texts = [tok.decode([t]) for t in greedy.tokens]
    k = next(i for i, t in enumerate(texts) if t.isalpha() and t not in "".join(texts[:i]))
    out = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=16, logprobs=0, stop=[texts[k]]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and texts[k] not in choice.text
    assert len(choice.logprobs.tokens) == k, (choice.logprobs.tokens, texts)
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=16, logprobs=True, stop=["\x14"]
    )
    message = chat.choices[0].message.content
    assert "\x14" not in message and shown(chat.choices[0].logprobs.content) == message
    # A bias that makes the end of sequence the first token: an empty reply, no logprobs.
    eos = tok.eos_token_id
    out = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, logprobs=0, logit_bias={str(eos): 100}
    )
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].logprobs.tokens == []


# ---------------------------------------------------------------------------------------
# Penalties and logit_bias


def test_logit_bias_reaches_the_engine(client, target):
    model, tok = target
    ids = tok.encode(PROMPT)
    greedy = dflash_mlx.generate(model, None, tok, ids, max_tokens=8, temperature=0)
    favourite = tok.encode(" fox")[-1]
    out = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=8, logit_bias={str(favourite): 100}
    )
    assert out.usage.completion_tokens == 8
    assert out.choices[0].text == tok.decode([favourite] * 8)
    banned = client.completions.create(
        model=MODEL,
        prompt=ids,
        temperature=0,
        max_tokens=8,
        logit_bias={str(greedy.tokens[0]): -100},
    )
    assert banned.choices[0].text != greedy.text
    assert not banned.choices[0].text.startswith(tok.decode(greedy.tokens[:1]))
    for bias, param in [({"abc": 1}, "logit_bias"), ({"5": 101}, "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=ids, logit_bias=bias)
        assert e.value.param == param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, logit_bias={"100000": 1})
    assert e.value.param == "logit_bias" and "vocabulary" in e.value.message


@pytest.mark.parametrize(
    "penalty",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 3.0, "repetition_context_size": 64},
    ],
)
def test_penalties_reach_the_engine(client, target, draft, penalty):
    """The penalised greedy reply is the library's (same options), and no plain greedy one
    (the random model repeats itself within 32 tokens)."""
    model, tok = target
    ids = tok.encode(PROMPT)
    kw = dict(max_tokens=32, temperature=0, verify_width=WIDTH)
    plain = dflash_mlx.generate(model, draft, tok, ids, **kw)
    assert len(set(plain.tokens)) < len(plain.tokens), "no repetition to penalise"
    want = dflash_mlx.generate(model, draft, tok, ids, **kw, **penalty)
    body = {k: v for k, v in penalty.items() if k in ("presence_penalty", "frequency_penalty")}
    extra = {k: v for k, v in penalty.items() if k not in body}
    out = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=32, **body, extra_body=extra
    )
    assert out.choices[0].text == want.text
    assert want.tokens != plain.tokens, f"{penalty} changed nothing"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, presence_penalty=2.5)
    assert e.value.param == "presence_penalty"


# ---------------------------------------------------------------------------------------
# Forced tool calls: a random model whose chat template writes Qwen's `<tool_call>` JSON


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if messages[-1].content.endswith('/think') %}<think>\n{% endif %}{%- endif %}"
)
TOOL_VOCAB = 384
CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": CITIES},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 5}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def follows_tool(name: str, arguments: dict) -> None:
    if name == "get_weather":
        assert set(arguments) == {"city", "days"} and arguments["city"] in CITIES, arguments
        assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7, arguments
    else:
        assert name == "get_time", name
        assert set(arguments) == {"zone"} and len(arguments["zone"]) <= 5, arguments


def build_tool_model(root: Path) -> None:
    from tokenizers import Tokenizer

    folder = root / "tools"
    write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": TOOL_TEMPLATE})
    )
    build_target(folder, qwen3_config(vocab=TOOL_VOCAB), seed=7)
    build_draft(root / "tools-draft", draft_config(4, [1, 2], vocab=TOOL_VOCAB), seed=8)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    build_tool_model(root)
    pair = dict(target="tools", draft="tools-draft", verify_width=WIDTH)
    with serving(root, settings={"default_max_tokens": 300}, **pair) as s:
        yield s


@pytest.fixture
def oai(tool_server) -> openai.OpenAI:
    tool_server.wait_idle()
    return tool_server.client()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_makes_a_call_that_follows_its_schema(oai, stream):
    for seed in (0, 1, 2):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in oai.chat.completions.create(**kw, stream=True):
                delta = chunk.choices[0].delta
                for c in delta.tool_calls or []:
                    calls[c.index] = {"name": c.function.name, "arguments": c.function.arguments}
                finish = chunk.choices[0].finish_reason or finish
            got = list(calls.values())
        else:
            out = oai.chat.completions.create(**kw)
            finish = out.choices[0].finish_reason
            got = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in out.choices[0].message.tool_calls or []
            ]
            assert not out.choices[0].message.content
        assert finish == "tool_calls" and len(got) == 1, (finish, got)
        follows_tool(got[0]["name"], json.loads(got[0]["arguments"]))


def test_a_named_tool_choice_calls_that_tool(oai):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (3, 4):
        out = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, seed=seed
        )
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_time"
        follows_tool("get_time", json.loads(call.function.arguments))


def test_a_forced_call_may_follow_the_reasoning_the_template_opened(oai, tool_server):
    """The template opened `<think>`: the model reasons, closes it, then calls (a bias on
    `</think>` keeps the random model's reasoning short)."""
    think_end = str(tool_server.engine.tokenizer.convert_tokens_to_ids("</think>"))
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather? /think"}],
        tools=TOOLS,
        tool_choice="required",
        seed=0,
        logit_bias={think_end: 5},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    follows_tool(call.function.name, json.loads(call.function.arguments))


def test_anthropic_forced_tool_use(tool_server):
    tool_server.wait_idle()
    claude = anthropic.Anthropic(
        base_url=tool_server.base, api_key="unused", timeout=TIMEOUT, max_retries=0
    )
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = claude.messages.create(
            model=MODEL, max_tokens=300, messages=ASK, tools=tools, tool_choice=choice
        )
        assert msg.stop_reason == "tool_use", msg
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        if choice["type"] == "tool":
            assert use.name == "get_weather"
        follows_tool(use.name, use.input)


def test_responses_forced_tool_choice(oai):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    response = oai.responses.create(
        model=MODEL,
        input="Weather?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    follows_tool(call.name, json.loads(call.arguments))


def test_forced_tool_choice_is_refused_where_the_call_format_is_unknown():
    """A model whose calls are not JSON in markers (here Mistral's parser): a 400 saying
    so, rather than a grammar that pretends."""
    from mlx_lm.tool_parsers import json_tools, mistral

    class Tokenizer:  # what the grammar reads of mlx-lm's tokenizer wrapper
        tool_parser = staticmethod(mistral.parse_tool_call)
        tool_call_start, tool_call_end = mistral.tool_call_start, mistral.tool_call_end
        added_tokens_decoder: dict = {}

    with pytest.raises(APIError) as e:
        tool_grammar(Tokenizer(), TOOLS, reasoning=False)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    assert "not supported for this model" in e.value.message
    Tokenizer.tool_parser = staticmethod(json_tools.parse_tool_call)
    Tokenizer.tool_call_start, Tokenizer.tool_call_end = "<tool_call>", "</tool_call>"
    grammar = tool_grammar(Tokenizer(), TOOLS, reasoning=False)
    assert '"<tool_call>"' in grammar and "get_time" in grammar  # not an added token: text


def test_the_servers_penalty_defaults_apply_to_requests_that_do_not_say(models_dir, target, draft):
    """`serve --presence-penalty 2`: a request without one gets the server's."""
    model, tok = target
    ids = tok.encode(PROMPT)
    kw = dict(max_tokens=32, temperature=0, verify_width=WIDTH)
    want = dflash_mlx.generate(model, draft, tok, ids, **kw, presence_penalty=2.0)
    plain = dflash_mlx.generate(model, draft, tok, ids, **kw)
    assert want.tokens != plain.tokens
    settings = {"sampling": {"presence_penalty": 2.0}}
    with serving(models_dir, verify_width=WIDTH, settings=settings) as s:
        client = s.client()
        out = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=32)
        assert out.choices[0].text == want.text
        off = client.completions.create(
            model=MODEL, prompt=ids, temperature=0, max_tokens=32, presence_penalty=0
        )
        assert off.choices[0].text == plain.text


# Trees under a grammar (issue 38, item 3)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tree_request_under_a_json_schema_verifies_trees_and_keeps_its_reply(client, stream):
    """`tree: true` with `response_format`: the server's width is the tree's budget, the
    grammar row verifies trees (each node masked at its path), and the greedy reply is the
    one chains give; it follows the schema."""
    kw = dict(model=MODEL, messages=USER, temperature=0, max_tokens=120, response_format=FORMAT)
    chains = client.chat.completions.create(**kw, extra_body={"tree": False})
    if stream:
        text, timings = "", None
        for chunk in client.chat.completions.create(**kw, extra_body={"tree": True}, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            timings = (chunk.model_extra or {}).get("timings") or timings
    else:
        out = client.chat.completions.create(**kw, extra_body={"tree": True})
        text, timings = out.choices[0].message.content, out.model_extra["timings"]
    assert text == chains.choices[0].message.content
    assert timings["ran"]["trees"] and timings["ran"]["tree_note"] is None, timings["ran"]
    assert not chains.model_extra["timings"]["ran"]["trees"]
    assert chains.choices[0].finish_reason == "stop"
    follows(json.loads(text))


def test_a_forced_tool_call_verifies_trees(oai):
    """A forced tool call asking for trees: trees verified, the call the chains' call."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    got = [oai.chat.completions.create(**kw, extra_body={"tree": t}) for t in (False, True)]
    calls = [
        [(c.function.name, c.function.arguments) for c in o.choices[0].message.tool_calls]
        for o in got
    ]
    assert calls[0] == calls[1] and len(calls[1]) == 1
    follows_tool(calls[1][0][0], json.loads(calls[1][0][1]))
    ran = got[1].model_extra["timings"]["ran"]
    assert ran["trees"] and ran["tree_note"] is None, ran
