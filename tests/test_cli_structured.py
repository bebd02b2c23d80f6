"""Structured output and the penalties on the command line (issue 24): `generate
--json-schema FILE`, the penalty flags of the one table of generation options, and chat's
`/set` for them; on the tiny random session pair, in this process (typer's runner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.chat.settings import parse_setting
from dflash_mlx.cli.main import app

from .test_server_edge import BAD_SCHEMAS

PROMPT = "def add(a, b):"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


def generate(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(app, ["generate", *args])
    return done.exit_code, done.output


def test_generate_json_schema_replies_parse_and_follow_the_schema(pair, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for seed in ("0", "1"):
        done = CliRunner().invoke(app, [
            "generate", *pair, "--raw", "--temp", "1", "--seed", seed, "--json-schema",
            str(path), "--json", PROMPT,
        ])  # fmt: skip
        assert done.exit_code == 0, done.output
        # stdout alone: a first run on this pair says on stderr that it calibrates
        result = json.loads(done.stdout)
        assert result["finish_reason"] == "stop", result["text"]
        reply = json.loads(result["text"])
        assert reply["color"] in ("red", "green", "blue") and 0 <= reply["n"] <= 99, reply
        assert set(reply) == {"color", "n"}


def test_generate_json_schema_with_tree_verifies_trees(pair, tmp_path):
    """`generate --json-schema F --tree`: the grammar row verifies trees (the stats say so,
    no `chains only` note), and the greedy reply is the one chains give."""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    common = [*pair, "--raw", "--temp", "0", "--max-tokens", "40", "--verify-width", "6"]
    common += ["--json-schema", str(path), "--json", PROMPT]
    got = {}
    for shape in ("--tree", "--no-tree"):
        done = CliRunner().invoke(app, ["generate", shape, *common])
        assert done.exit_code == 0, done.output
        got[shape] = json.loads(done.stdout)
    assert got["--tree"]["text"] == got["--no-tree"]["text"]
    ran = got["--tree"]["ran"]
    assert ran["trees"] and ran["tree_note"] is None, ran
    assert not got["--no-tree"]["ran"]["trees"]


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "cannot read it"),
        ("[1, 2", "not JSON"),
        ("[1, 2]", "a JSON schema is an object"),
        ('{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}', "nope"),
    ],
)
def test_a_bad_schema_file_is_a_user_error_naming_it(pair, tmp_path, content, says):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    code, out = generate(*pair, "--json-schema", str(path), PROMPT)
    assert code == 2, out
    assert f"--json-schema {path}" in out and says in out, out


def nested(levels: int) -> str:
    """A schema whose properties nest `levels` deep (two JSON objects a level)."""
    return '{"type": "object", "properties": {"a": ' * levels + "{}" + "}}" * levels


# Schemas the server refuses with a 400 before it builds a grammar (`dflash_mlx.json_schema`;
# a 1 MB `const` and the two patterns once failed at the reply's first token), and the
# words the refusal says.
OVER_BOUNDS = {
    "a 1 MB const": (
        json.dumps({"type": "object", "properties": {"a": {"const": "x" * 1_000_000}}}),
        "a string of 1,000,000 characters",
    ),
    "a pattern a{1000000}": (
        json.dumps({"type": "string", "pattern": "^a{1000000}$"}),
        "'pattern' '^a{1000000}$' spells out more than 65,536 characters",
    ),
    "a pattern (x{1000}){1000}": (
        json.dumps({"type": "string", "pattern": "^(x{1000}){1000}$"}),
        "spells out more than 65,536 characters",
    ),
    "a type that is no JSON type": ('{"type": 5}', "not a JSON Schema: 'type' is 5"),
    "nested 80 deep": (nested(40), "more than 64 levels deep (at properties/a/"),
    "nested past Python's parser": (nested(100_000), "more than 64 levels deep"),
}


@pytest.mark.parametrize("name", list(OVER_BOUNDS))
def test_a_schema_beyond_the_servers_bounds_is_refused_before_the_model_loads(
    pair, tmp_path, monkeypatch, name
):
    """The server's bounds (65,536 characters a string or a pattern's counted repetitions,
    64 levels, a JSON Schema at all): exit 2, one line naming the flag, and no model load."""
    from dflash_mlx.cli import generate as generate_module

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the schema was checked")

    monkeypatch.setattr(generate_module, "load", load)
    content, says = OVER_BOUNDS[name]
    path = tmp_path / "schema.json"
    path.write_text(content)
    done = CliRunner().invoke(app, ["generate", *pair, "--json-schema", str(path), PROMPT])
    message = " ".join(done.stderr.split())
    assert done.exit_code == 2, done.output
    assert message.startswith(f"error: --json-schema {path}: ") and says in message, message
    assert "internal" not in message and "Traceback" not in done.output


@pytest.mark.parametrize("name", list(BAD_SCHEMAS))
def test_the_schemas_the_server_refuses_are_user_errors_here_too(pair, tmp_path, name):
    """Issue 43's six (the `$ref` loops need the tokenizer: found by the grammar's check once
    the pair is loaded, before any decoding)."""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(BAD_SCHEMAS[name]))
    done = CliRunner().invoke(app, ["generate", *pair, "--json-schema", str(path), PROMPT])
    message = " ".join(done.stderr.split())
    assert done.exit_code == 2 and message.startswith(f"error: --json-schema {path}: "), message
    assert "$ref" in message or "65,536" in message, message


def test_the_real_command_refuses_an_oversized_schema_on_one_line(tmp_path):
    """`dflash-mlx generate --demo --json-schema` in a process of its own: exit 2, one
    `error:` line on stderr naming the flag, nothing on stdout (the demo pair never loads)."""
    path = tmp_path / "schema.json"
    path.write_text(OVER_BOUNDS["a 1 MB const"][0])
    done = subprocess.run(
        [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "generate",
         "--demo", "--json-schema", str(path), PROMPT],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: --json-schema {path}: too large"), done.stderr
    assert "at most 65,536" in done.stderr and "demo:" not in done.stderr


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--presence-penalty", "2"], "presence_penalty", 2.0),
        (["--frequency-penalty", "2"], "frequency_penalty", 2.0),
        (["--repetition-penalty", "3"], "repetition_penalty", 3.0),
    ],
)
def test_penalty_flags_reach_the_engine(pair, target, draft, flags, field, value):
    """The greedy reply with the flag is the library's with the option, and not the plain
    greedy reply (the random model repeats itself within 24 tokens)."""
    model, tok = target
    kw = dict(max_tokens=24, temperature=0)
    plain = dflash_mlx.generate(model, draft, tok, PROMPT, **kw)
    want = dflash_mlx.generate(model, draft, tok, PROMPT, **kw, **{field: value})
    assert want.tokens != plain.tokens, f"{field} changed nothing"
    code, out = generate(*pair, "--raw", "--temp", "0", "-n", "24", *flags, "--json", PROMPT)
    assert code == 0, out
    assert json.loads(out)["tokens"] == want.tokens


def test_out_of_range_penalties_name_their_flag(pair):
    code, out = generate(*pair, "--presence-penalty", "3", PROMPT)
    assert code == 2 and "--presence-penalty 3" in out, out
    code, out = generate(*pair, "--repetition-penalty", "0", PROMPT)
    assert code == 2 and "--repetition-penalty" in out, out


def test_set_takes_the_penalties():
    assert parse_setting("presence_penalty", "1.5") == ("presence_penalty", 1.5, None)
    assert parse_setting("frequency_penalty", "-1") == ("frequency_penalty", -1.0, None)
    assert parse_setting("repetition_penalty", "1.2") == ("repetition_penalty", 1.2, None)
    assert parse_setting("repetition_penalty", "off") == ("repetition_penalty", None, None)
