"""Structured output and the penalties on the command line (issue 24): `generate
--json-schema FILE`, the penalty flags of the one table of generation options, and chat's
`/set` for them; on the tiny random session pair, in this process (typer's runner)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.chat.settings import parse_setting
from dflash_mlx.cli.main import app

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
        code, out = generate(
            *pair, "--raw", "--temp", "1", "--seed", seed, "--json-schema", str(path), "--json",
            PROMPT,
        )  # fmt: skip
        assert code == 0, out
        result = json.loads(out)
        assert result["finish_reason"] == "stop", result["text"]
        reply = json.loads(result["text"])
        assert reply["color"] in ("red", "green", "blue") and 0 <= reply["n"] <= 99, reply
        assert set(reply) == {"color", "n"}


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
