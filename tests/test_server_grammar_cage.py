"""Grammars that cannot take the process down (issue 63): a schema whose `$ref`s chain
2,500 deep made llguidance overflow its stack while building the matcher (SIGSEGV, the
server gone); schemas whose grammar starts and then fails mid-reply (a `$ref` loop inside a
property, a required array nesting itself forever, `^(a|aa){1000}$`) ended in a 500.

The crash is tried where a crash cannot take the tests along: the real `dflash-mlx serve`
and `dflash-mlx generate` in processes of their own, asked as clients ask (httpx, the
`openai` and `anthropic` clients). Every case is a correct reply or a 400 naming its field,
and the server answers /health after each.
"""

from __future__ import annotations

import json
import subprocess

import anthropic
import httpx
import openai
import pytest

from dflash_mlx.json_schema import MAX_VARYING_REPEATS, varying_repeats
from dflash_mlx.schema_graph import MAX_GRAPH_DEPTH, schema_graph_problem

from .test_cli_serve import TIMEOUT, dflash, serve
from .test_server_structured import build_tool_model

MODEL = "dflash"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chain(links: int, last: dict | None = None) -> dict:
    """`links` `$defs`, each a `$ref` to the next, the last one `last`."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    defs[f"d{links}"] = last or {"enum": ["a", "b"]}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def chained_object(links: int) -> dict:
    """A tool's parameters: one required property following a 2,500-deep chain."""
    inner = chain(links)
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"],
            "$defs": inner["$defs"]}  # fmt: skip


# The three that passed the checks, started a reply and ended in a 500 (issue 63's 2nd).
MID_REPLY = {
    "a $ref loop inside a property": {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "required": ["a"],
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
    },
    "a required array nesting itself forever": {
        "type": "array",
        "items": {"$ref": "#"},
        "minItems": 1,
    },
    "the pattern ^(a|aa){1000}$": {"type": "string", "pattern": "^(a|aa){1000}$"},
}


# -- the checks, without a model ------------------------------------------------------------


@pytest.mark.parametrize("name", list(MID_REPLY))
def test_schemas_that_fail_mid_reply_are_refused_by_the_checks(name):
    schema = MID_REPLY[name]
    from dflash_mlx.json_schema import schema_too_large

    problem = schema_graph_problem(schema) or schema_too_large(schema)
    assert problem is not None, name
    if "pattern" in name:
        assert f"at most {MAX_VARYING_REPEATS}" in problem and "(a|aa){1000}" in problem
    else:
        assert "never written out" in problem, problem


def test_the_loop_is_named_from_where_the_reply_enters_it():
    problem = schema_graph_problem(MID_REPLY["a $ref loop inside a property"])
    assert "'properties.a' -> '$defs.x' -> '$defs.y' -> '$defs.x'" in problem, problem


@pytest.mark.parametrize(
    "schema",
    [
        # recursion with a way out: a tree, a linked list, a nullable node, left recursion
        {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array",
         "items": {"$ref": "#/$defs/n"}}}, "required": ["kids"]}}, "$ref": "#/$defs/n"},
        {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
         "required": ["next"]},
        {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        {"$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}]}},
         "$ref": "#/$defs/x"},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        chain(2_500),
    ],
)  # fmt: skip
def test_recursive_schemas_with_a_way_out_pass(schema):
    assert schema_graph_problem(schema) is None


def test_a_graph_deeper_than_the_bound_is_refused_and_a_loop_counts_its_members():
    assert schema_graph_problem(chain(MAX_GRAPH_DEPTH - 10)) is None
    assert f"at most {MAX_GRAPH_DEPTH:,}" in schema_graph_problem(chain(MAX_GRAPH_DEPTH))
    loop = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{(i + 1) % 6000}"}}
            for i in range(6000)}  # fmt: skip
    # 6,000 arrays in one loop (12,000 subschemas), each an empty array at will: finite,
    # but llguidance's build follows the loop around
    assert f"at most {MAX_GRAPH_DEPTH:,}" in schema_graph_problem(
        {"$defs": loop, "$ref": "#/$defs/d0"}
    )


def test_varying_repeats_count_parts_of_varying_length_multiplied():
    assert varying_repeats("^(a|aa){1000}$") == 1000
    assert varying_repeats("^((a|aa){10}){30}$") == 300
    assert varying_repeats("^(a|aa){120}b(a|aa){120}$") == 240  # failed mid-reply
    assert varying_repeats(r"^(\d{1,3}\.){3}\d{1,3}$") == 3  # an IPv4 address
    assert varying_repeats("^a{0,100000}$") == 0  # one character, any count: no ambiguity
    assert varying_repeats(r"^\p{L}+$") == 0  # another dialect: not Python's to judge


# -- the real commands ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cage")
    build_tool_model(root)
    # Tools named in the prompt, not written out: a 2,500-link schema fits the tiny context.
    config = root / "tools" / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("t | tojson", "t.function.name")
    config.write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def server(tool_models):
    args = ["-m", str(tool_models / "tools"), "-d", str(tool_models / "tools-draft")]
    with serve(*args) as s:
        global MODEL
        MODEL = httpx.get(f"{s.base}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
        yield s


def healthy(server) -> None:
    assert httpx.get(f"{server.base}/health", timeout=TIMEOUT).json()["status"] == "ok"


def test_a_2500_deep_ref_chain_is_served_at_every_entry_point(server):
    """It took the process down at each: the matcher is now built on a deep stack."""
    oai = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
    schema = chain(2_500)
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    out = oai.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=8)
    assert out.choices[0].message.content in ('"a"', '"b"'), out
    healthy(server)
    text = {"format": {"type": "json_schema", "name": "deep", "schema": schema}}
    response = oai.responses.create(model=MODEL, input="hi", text=text, max_output_tokens=8)
    assert response.output_text in ('"a"', '"b"'), response
    healthy(server)
    params = chained_object(2_500)
    tool = {"type": "function", "function": {"name": "deep", "parameters": params}}
    out = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required", max_tokens=64
    )
    (call,) = out.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["x"] in ("a", "b"), call
    healthy(server)
    claude = anthropic.Anthropic(base_url=server.base, api_key="x", timeout=TIMEOUT, max_retries=0)
    msg = claude.messages.create(
        model=MODEL, max_tokens=64, messages=ASK, tool_choice={"type": "any"},
        tools=[{"name": "deep", "input_schema": params}],
    )  # fmt: skip
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.input["x"] in ("a", "b"), msg
    healthy(server)


def test_a_chain_past_the_bound_is_a_400_naming_the_format(server):
    """100,000 links (3.5 MB): refused by the bound before anything is built (within it,
    llguidance's stack never needs more than a fifth of the cage's; llguidance itself
    would refuse this one as "schema too large", after its build)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": chain(100_000)}}
    body = {"model": MODEL, "messages": ASK, "response_format": fmt, "max_tokens": 8}
    r = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"].startswith("response_format"), error
    assert f"at most {MAX_GRAPH_DEPTH:,}" in error["message"], error
    healthy(server)


@pytest.mark.parametrize("name", list(MID_REPLY))
def test_schemas_that_failed_mid_reply_are_400s_at_every_entry_point(server, name):
    schema = MID_REPLY[name]
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 32}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for path, body, field in [
        ("/v1/chat/completions", {**chat, "response_format": fmt}, "response_format"),
        ("/v1/chat/completions", {**chat, "response_format": fmt, "stream": True},
         "response_format"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 32,
         "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}, "text"),
        ("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema}}]}, "tools"),
        ("/v1/messages", {**chat, "tool_choice": {"type": "any"},
         "tools": [{"name": "f", "input_schema": schema}]}, "tools"),
    ]:  # fmt: skip
        r = httpx.post(f"{server.base}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert field in (error.get("param") or error["message"]), (path, error)
        healthy(server)


@pytest.mark.parametrize(
    "links, code, says",
    [(2_500, 0, None), (100_000, 2, f"at most {MAX_GRAPH_DEPTH:,}")],
)
def test_generate_json_schema_survives_a_deep_chain(tool_models, tmp_path, links, code, says):
    """`generate --json-schema` exited 139 on the 2,500 chain."""
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(chain(links)))
    pair = ["-m", str(tool_models / "tools"), "-d", str(tool_models / "tools-draft")]
    try:
        done = dflash("generate", *pair, "--raw", "--max-tokens", "8", "--json-schema",
                      str(path), "--json", "hi")  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("generate hung")
    assert done.returncode == code, done.stderr.decode()[-600:]
    if says is None:
        assert json.loads(json.loads(done.stdout)["text"]) in ("a", "b")
    else:
        assert f"--json-schema {path}" in done.stderr.decode() and says in done.stderr.decode()
