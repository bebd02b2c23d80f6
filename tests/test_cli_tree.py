"""Tree verification from the command line (issue 23, item 5): `--tree/--no-tree` in generate,
chat (`/set tree`) and serve (the requests' default, and a request field `tree`), tree cycles
in the stats line and under `ran`, and `bench --trees` beside the chain widths, identity
checked. The real `dflash-mlx` command in a subprocess (a pseudo-terminal for chat), on the
tiny session models."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import httpx
import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app

from .test_bench import PROMPTS
from .test_cli_flags import chat_terminal, type_lines
from .test_cli_serve import TIMEOUT, dflash, serve, text

PROMPT = "def add(a, b):"
TOKENS = "16"


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


def generate(args: list[str], *more: str) -> tuple[dict | None, str]:
    """`dflash-mlx generate ARGS MORE PROMPT -n 16`: (its --json object, or None without
    --json; stderr)."""
    done = dflash("generate", *args, "-n", TOKENS, *more, PROMPT)
    out, err = text(done)
    assert done.returncode == 0, err
    return (json.loads(out) if "--json" in more else None), err


def stats_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_generate_tree_verifies_trees_of_the_width_and_keeps_the_target_tokens(pair):
    """--tree --verify-width 12: cycles verify trees of 12 tokens (counted under ran.trees and
    shown in the stats line), and at temperature 0 the tokens are plain decoding's."""
    tree, _ = generate(pair, "--tree", "--verify-width", "12", "--json")
    plain, _ = generate(pair, "--verify-width", "1", "--json")
    trees = tree["ran"]["trees"]
    assert trees.get("12", {}).get("cycles", 0) > 0, f"no trees of 12 tokens ran: {tree['ran']}"
    assert tree["ran"]["widths"]["12"]["cycles"] >= trees["12"]["cycles"]  # counted in both
    assert tree["ran"]["tree_note"] is None
    assert tree["tokens"] == plain["tokens"], "a tree of drafts must keep the target's tokens"
    _, err = generate(pair, "--tree", "--verify-width", "12", "-v")  # the detailed stats
    assert re.search(r" · trees 12×\d+", stats_line(err)), stats_line(err)


def test_no_tree_verifies_chains_only(pair):
    chains, err = generate(pair, "--no-tree", "--verify-width", "12", "--json")
    assert chains["ran"]["trees"] == {} and chains["ran"]["widths"]["12"]["cycles"] > 0
    _, err = generate(pair, "--no-tree", "--verify-width", "12", "-v")
    assert "trees" not in stats_line(err), stats_line(err)


def test_a_tree_budget_past_the_draft_is_refused_naming_the_flag(pair):
    done = dflash("generate", *pair, "--tree", "--verify-width", "500", PROMPT)
    _, err = text(done)
    assert done.returncode == 2 and err.startswith("error: --verify-width 500: a tree"), err


def test_on_a_hybrid_target_tree_says_why_chains_ran(models_dir):
    hybrid = ["-m", str(models_dir / "qwen35"), "-d", str(models_dir / "draft")]
    got, _ = generate(hybrid, "--tree", "--verify-width", "4", "--json")
    assert got["ran"]["trees"] == {}
    assert "recurrent" in (got["ran"]["tree_note"] or ""), got["ran"]
    _, err = generate(hybrid, "--tree", "--verify-width", "4", "-v")
    assert " · chains only: recurrent layers · " in stats_line(err), stats_line(err)


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_set_tree_on_reaches_the_engine_in_chat(tmp_path, pair):
    """/set tree on, then a reply: its stats line counts trees of the verify width."""
    pytest.importorskip("pexpect")
    # A fixed width: no calibration before the prompt.
    child = chat_terminal(
        tmp_path, *pair, "--max-tokens", TOKENS, "--verify-width", "12", "--verbose",
        timeout=TIMEOUT, columns=200,
    )  # fmt: skip
    type_lines(
        child,
        [
            ("/set tree on", "tree set to on"),
            ("/set", r"verify_width 12 ·\s+tree on"),
            (PROMPT, r"trees 12×\d+"),
        ],
    )
    assert child.exitstatus == 0


def test_serve_tree_is_the_default_and_a_request_field_overrides_it(pair):
    """serve --tree: requests that do not say verify trees; "tree": false chains; a `tree`
    that is no boolean (or null) is a 400 naming it, on both OpenAI endpoints."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}
    with serve(*pair, "--tree", "--verify-width", "8") as server:
        default = server.post("/v1/chat/completions", body)
        chains = server.post("/v1/chat/completions", {**body, "tree": False})
        chosen = server.post("/v1/chat/completions", {**body, "tree": None})
        bad = [
            httpx.post(f"{server.base}/v1/chat/completions", json={**body, "tree": "yes"}),
            httpx.post(
                f"{server.base}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4, "tree": 1},
            ),
        ]
    assert default["timings"]["ran"]["trees"].get("8", {}).get("cycles", 0) > 0, default
    assert chains["timings"]["ran"]["trees"] == {}, chains["timings"]["ran"]
    assert chosen["timings"]["ran"]["trees"], "null: the server's default (--tree)"
    same = {r["choices"][0]["message"]["content"] for r in (default, chains, chosen)}
    assert len(same) == 1, "greedy: trees and chains reply the same"
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tree", r.text
    assert re.search(r"request completed: .* · trees 8×\d+", "".join(server.log)), server.log


def test_bench_trees_run_beside_the_widths_and_match_the_baseline(models_dir, tmp_path):
    from .test_cli_bench import bench_command

    path = tmp_path / "bench.json"
    code, out, err = bench_command(
        models_dir,
        *("--suite", "math", "--repeats", "1", "--verify-widths", "4"),
        *("--trees", "6", "--json", str(path)),
    )
    assert code == 0, err
    row = re.search(r"^ *tree B=6 .*?(\d+%) *", out, re.M)
    assert row and re.search(r"\btrees\b", out), out
    assert "✓ lossless: all 4 DFlash runs" in out, out
    data = json.loads(path.read_text())
    assert data["settings"]["trees"] == [6]
    runs = {r["run"]: r for r in data["overall"]["runs"]}
    assert runs["tree=6"]["tree"] and runs["tree=6"]["tree_fraction"] > 0
    assert runs["W=4"]["tree_fraction"] == 0, "a fixed width verifies chains"
    trees = [r for r in data["records"] if r["run"] == "tree=6"]
    assert trees and all(r["ran"]["trees"] for r in trees)


def test_bench_identity_check_covers_tree_runs(models_dir, tmp_path, monkeypatch):
    """A tree run whose tokens differ from the baseline's is a losslessness failure naming
    it (exit code 1)."""
    real = dflash_mlx.generate

    def corrupted(*args, **kwargs):
        result = real(*args, **kwargs)
        if args[3].tree:
            tokens = list(result.tokens)
            tokens[1] = (tokens[1] + 1) % 7
            return dataclasses.replace(result, tokens=tokens)
        return result

    monkeypatch.setattr(dflash_mlx, "generate", corrupted)
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0].to_dict()) + "\n")
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    args = ["--prompts", str(prompts), "--max-tokens", "4", "--repeats", "1"]
    result = CliRunner().invoke(
        app, ["bench", *pair, *args, "--verify-widths", "2", "--trees", "5"]
    )
    assert result.exit_code == 1, result.output
    said = " ".join(result.stdout.split())
    assert "LOSSLESSNESS FAILURE" in said and "1 of 2 DFlash runs differ" in said, said
    assert "tree B=5 · repeat 1 · first difference at generated token 1" in said, said


def test_bench_trees_are_checked_before_anything_loads(pair):
    done = dflash("bench", *pair, "--trees", "2")
    assert done.returncode == 2 and "--trees '2': '2' is not a tree budget" in text(done)[1]
